"""passes.solve on loops: a scan's body solved with it, other control flow laid out by greedy
and the rest solved around it, time limits, memory budgets on what the layer loops hold, and
the overlap of a loop's collectives with its matmuls."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import assert_trees_close
from solve_cases import layers_grad, mesh

import shardflow as sf
import shardflow.attention  # noqa: F401  (sf.attention: the attention primitive)
from shardflow.passes import solve


def test_a_scan_is_solved_with_its_body():
    """A scan's body is solved with the program around it: its carry one layout at the start and
    end of every iteration, its costs counted once per iteration. The plan equals one device,
    costs no more than greedy's, and sf.AUTO inputs feeding the loop are chosen too."""

    def f(w, x):
        h = jnp.tanh(x @ w)
        return jax.lax.scan(lambda c, hi: (jnp.tanh(c + hi), c * hi), h[0], h)[0] @ w.T

    r = np.random.default_rng(0)
    w, x = r.standard_normal((16, 16)).astype(np.float32) / 4, r.standard_normal((4, 8, 16)).astype(np.float32)
    specs = (jax.P(None, "model"), jax.P(None, "data"))
    step = sf.parallelize(f, mesh=mesh("2x4"), in_specs=specs, passes=sf.passes.SOLVER)
    np.testing.assert_allclose(np.asarray(step(w, x)), np.asarray(jax.jit(f)(w, x)), rtol=1e-5, atol=1e-6)
    plan = step.explain(w, x)
    assert plan.planner.startswith("solver (optimal") and "greedy" not in plan.planner, plan.planner
    greedy = sf.parallelize(f, mesh=mesh("2x4"), in_specs=specs).explain(w, x)
    assert plan.modelled_seconds <= greedy.modelled_seconds * (1 + 1e-9)
    auto = sf.parallelize(f, mesh=mesh("2x4"), in_specs=(sf.AUTO, jax.P(None, "data")), passes=sf.passes.SOLVER)
    np.testing.assert_allclose(np.asarray(auto(w, x)), np.asarray(jax.jit(f)(w, x)), rtol=1e-5, atol=1e-6)
    assert "sf.AUTO chose 1 input layout" in auto.explain(w, x).planner


def test_a_checkpointed_scan_body_is_solved_with_the_scan():
    """A layer loop whose body is rematerialised (jax.checkpoint inside lax.scan, as the presets
    run with remat): the remat's operands are the scan body's inputs, whose layouts the solver
    chooses with the loop; one solve, equal to one device."""

    def f(ws, x):
        layer = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w) + h, None))
        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    r = np.random.default_rng(1)
    ws, x = r.standard_normal((3, 16, 16)).astype(np.float32) / 4, r.standard_normal((8, 16)).astype(np.float32)
    specs = (jax.P(None, None, "model"), jax.P("data", None))
    step = sf.parallelize(jax.value_and_grad(f), mesh=mesh("2x4"), in_specs=specs, passes=sf.passes.SOLVER)
    want = jax.jit(jax.value_and_grad(f))(ws, x)
    for got, ref in zip(jax.tree.leaves(step(ws, x)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    plan = step.explain(ws, x)
    assert plan.planner.startswith("solver (optimal") and "greedy" not in plan.planner, plan.planner


def test_loops_laid_out_by_greedy_after_a_time_limit_are_said_to_be_left_out(monkeypatch):
    """Where solving a program's loops runs out of time, they are laid out as greedy lays them
    out and the rest solved; the planner line says so, and that the optimum it reports leaves
    the loops' own work and collectives out (explain's figure as boxed has them)."""
    choose = solve.assemble.choose

    def slow_loops(prop, jaxpr, out_sbp, time_limit=None, given=None, *args, **kwargs):
        if not any(eqn.primitive is jax.lax.scan_p for eqn in (given or ())):
            raise solve.Unsolvable("Time limit reached (as if)")
        return choose(prop, jaxpr, out_sbp, time_limit, given, *args, **kwargs)

    monkeypatch.setattr(solve.assemble, "choose", slow_loops)
    r = np.random.default_rng(0)
    ws, x = r.standard_normal((4, 64, 64)).astype(np.float32) / 8, r.standard_normal((64, 64)).astype(np.float32)
    step = sf.parallelize(
        layers_grad,
        mesh=mesh("2x4"),
        in_specs=(jax.P(), jax.P(("data", "model"))),
        out_specs=jax.P(),
        passes=sf.passes.SOLVER,
    )
    planner = step.explain(ws, x).planner
    assert planner.startswith("solver (optimal"), planner
    assert "the loops among them: solving them ran out of time, and the optimum leaves out" in planner, planner
    assert_trees_close(step(ws, x), jax.jit(layers_grad)(ws, x))


def test_a_memory_budget_bounds_what_the_layer_loops_hold():
    """explain's memory_bytes (the inputs, and what the loops not in a loop stack: the layer
    loop's residuals and its per-layer gradients) is what a budget bounds. A budget one byte
    below the unconstrained optimum's plan gives a plan that keeps to it — no cheaper by the
    model, equal to one device — and a budget below every plan is refused as infeasible,
    without falling back to a plan that breaks it."""
    r = np.random.default_rng(0)
    ws, x = r.standard_normal((4, 64, 64)).astype(np.float32) / 8, r.standard_normal((64, 64)).astype(np.float32)
    kw = dict(
        mesh=mesh("2x4"), in_specs=(jax.P(), jax.P(("data", "model"))), out_specs=jax.P(), passes=sf.passes.SOLVER
    )
    free = sf.parallelize(layers_grad, **kw).explain(ws, x)
    assert free.input_bytes == ws.nbytes + x.nbytes // 8
    assert free.loop_bytes > 0 and "held by loops" in str(free)
    step = sf.parallelize(layers_grad, memory_budget=free.memory_bytes - 1, **kw)
    tight = step.explain(ws, x)
    assert tight.planner.startswith("solver (optimal")
    assert tight.memory_bytes <= free.memory_bytes - 1
    assert tight.modelled_seconds >= free.modelled_seconds * (1 - 1e-9)
    assert_trees_close(step(ws, x), jax.jit(layers_grad)(ws, x))
    with pytest.raises(
        sf.ShardingError,
        match=r"memory_budget=70,000 bytes: the solver did not run \(the LP "
        r"relaxation is infeasible.*of which the inputs with specs take 67,584",
    ):
        sf.parallelize(layers_grad, memory_budget=70_000, **kw).explain(ws, x)


def test_a_loop_hides_its_gradient_reductions_behind_its_matmuls():
    """The overlap model: collectives inside a layer loop hide behind its matmuls; explain
    counts what hides (at most the loop's collectives) and the modelled time is the
    collectives and the work less what hides. With matmuls slow enough something hides; with
    free matmuls nothing does."""
    r = np.random.default_rng(0)
    ws, x = r.standard_normal((4, 64, 64)).astype(np.float32) / 8, r.standard_normal((64, 64)).astype(np.float32)
    kw = dict(mesh=mesh("2x4"), in_specs=(jax.P(), jax.P(("data", "model"))), out_specs=jax.P())
    slow = sf.LinkModel(flops=1e9)  # slow matmuls: room to hide the reductions behind
    step = sf.parallelize(layers_grad, passes=sf.passes.SOLVER, links=slow, **kw)
    assert_trees_close(step(ws, x), jax.jit(layers_grad)(ws, x))
    plan = step.explain(ws, x)
    in_loop = sum(c.seconds * c.count for c in plan.collectives if c.count == 4)
    assert 0 < plan.hidden_seconds <= in_loop * (1 + 1e-9)
    assert plan.modelled_seconds == pytest.approx(plan.total_seconds + plan.work_seconds - plan.hidden_seconds)
    assert "solver (optimal" in plan.planner
    free = sf.parallelize(layers_grad, passes=sf.passes.SOLVER, links=sf.LinkModel(flops=math.inf), **kw)
    assert free.explain(ws, x).hidden_seconds == 0.0
