"""passes.solve: the whole-program integer program. Its optimum is the brute-force minimum of
its model on small random programs; what it chooses runs equal to one device and costs, as
explain prices the plan, no more than greedy propagation; what it does not model goes to
greedy, and explain says which planner ran."""

import contextlib
import functools
import itertools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from programs import assert_trees_close
from scipy import optimize
from test_random_programs import BINARY, UNARY, build, nd_sbp

import shardflow as sf
import shardflow.ops  # noqa: F401  (sf.ops: the attention primitive)
from shardflow.conversion import local_bytes
from shardflow.passes import inline, solve
from shardflow.passes.propagate import Propagation, reduced
from shardflow.program import Program, is_literal, source_line
from shardflow.specs import B, S, Split

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
EXAMPLES = int(os.environ.get("SHARDFLOW_HYPOTHESIS_EXAMPLES", "200"))
STRAIGHT = sorted(k for k in UNARY if not any(w in k for w in ("scan", "fori", "remat")))  # regions: greedy


@functools.cache
def mesh(name):
    data, model = (int(n) for n in name.split("x"))
    return sf.make_mesh({"data": data, "model": model})


def inlined(fn, args, mesh, in_sbp, out_sbp) -> Program:
    closed = jax.make_jaxpr(fn)(*args)
    return inline.inline(Program(closed, mesh, tuple(in_sbp), tuple(out_sbp)))


def model_cost(prop, jaxpr, out_sbp, assignment, memo) -> float:
    """The solver's objective for one strategy per equation, computed directly."""

    def seconds(v, a, r):
        key = (v, a, r)
        if key not in memo:
            memo[key] = prop.seconds(v.aval, a, r)
        return memo[key]

    at, wants, cost = dict(prop.sbp), {}, 0.0
    for eqn, (decision, own) in zip(jaxpr.eqns, assignment):
        cost += own
        for x, r in zip(eqn.invars, decision.ins):
            if not is_literal(x):
                wants.setdefault(x, set()).add(r)
        at.update(zip(eqn.outvars, decision.outs))
    for v, want in zip(jaxpr.outvars, out_sbp):
        if want is not None:
            wants.setdefault(v, set()).add(want)
        else:
            cost += seconds(v, at[v], reduced(at[v]))
    return cost + sum(seconds(v, at[v], r) for v, rs in wants.items() for r in rs if r != at[v])


CHAIN_OPS = ("add", "mul", "tanh", "matmul", "T", "sum0", "sum1")


def chain(ops):
    """A program of a few primitives on (a [8, 16], b [16, 8]), each op one equation on the
    latest value (and a same-shaped input where it takes two)."""

    def fn(a, b):
        x = a
        for op in ops:
            other = {a.shape: a, b.shape: b}.get(x.shape, x)
            if op == "add":
                x = x + other
            elif op == "mul":
                x = x * other
            elif op == "tanh":
                x = jnp.tanh(x)
            elif op == "matmul" and x.ndim == 2:
                x = x @ (b if x.shape[1] == 16 else a)
            elif op == "T" and x.ndim == 2:
                x = x.T
            elif op in ("sum0", "sum1") and x.ndim == 2:
                x = jnp.sum(x, axis=int(op[-1]))
        return x

    return fn


@settings(max_examples=50, **SETTINGS)
@given(
    ops=st.lists(st.sampled_from(CHAIN_OPS), min_size=1, max_size=3),
    specs=st.tuples(nd_sbp(), nd_sbp()),
    out=st.one_of(st.none(), nd_sbp()),
)
@example(ops=["matmul", "matmul"], specs=((S(1), S(1)), (S(1), S(0))), out=None)
@example(ops=["T", "matmul"], specs=((S(1), S(0)), (B, B)), out=None)
def test_the_optimum_is_the_brute_force_minimum(ops, specs, out):
    """Every assignment of one strategy per equation, priced by the model: the solver's
    optimum is their minimum. (The examples: programs whose LP relaxation is fractional, where
    branch and bound stopped within HiGHS's default relative gap, 1e-4, above the optimum.)"""
    r = np.random.default_rng(0)
    args = (r.standard_normal((8, 16)).astype(np.float32), r.standard_normal((16, 8)).astype(np.float32))
    fn = chain(ops)
    shape = jax.eval_shape(fn, *args).shape
    if out is not None and any(s.dim >= len(shape) for s in out if hasattr(s, "dim")):
        out = None
    if out is not None and not all(dim % 8 == 0 for dim in shape):
        out = None
    program = inlined(fn, args, mesh("2x4"), specs, (out,))
    jaxpr = program.jaxpr.jaxpr
    prop = Propagation(program).seeded()
    options = [solve.build.strategies(prop, eqn) for eqn in jaxpr.eqns]
    assume(np.prod([len(o) for o in options]) <= 20_000)
    memo = {}
    best = min(model_cost(prop, jaxpr, program.out_sbp, a, memo) for a in itertools.product(*options))
    _, _, optimum, _ = solve.assemble.choose(Propagation(program).seeded(), jaxpr, program.out_sbp)
    assert optimum == pytest.approx(best, rel=1e-6, abs=1e-12)


# test_random_programs' programs, straight-line ops only (scans, loops and remat regions go to
# greedy), with pins
STEP = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(STRAIGHT), st.integers(0, 50)),
    st.tuples(st.just("binary"), st.sampled_from(sorted(BINARY)), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("matmul"), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("constrain"), st.integers(0, 50), nd_sbp()),
)


@settings(max_examples=max(EXAMPLES // 4, 10), **SETTINGS)
@given(
    steps=st.lists(STEP, min_size=1, max_size=6),
    specs=st.tuples(nd_sbp(), nd_sbp(), nd_sbp()),
    mesh_name=st.sampled_from(["2x4", "4x2"]),
)
def test_solved_programs_equal_one_device_and_cost_no_more_than_greedy(steps, specs, mesh_name):
    r = np.random.default_rng(0)
    args = [r.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 8), (8, 16))]
    fn = build(steps)
    expected = jax.jit(fn)(*args)
    solved = sf.parallelize(fn, mesh=mesh(mesh_name), in_specs=specs, passes=sf.passes.SOLVER)
    for a, e in zip(solved(*args), expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-4, atol=2e-4)
    plan = solved.explain(*args)
    assert plan.planner.startswith(("solver (optimal", "greedy (its plan")), plan.planner
    greedy = sf.parallelize(fn, mesh=mesh(mesh_name), in_specs=specs).explain(*args)
    assert plan.modelled_seconds <= greedy.modelled_seconds * (1 + 1e-9) + 1e-12, (str(plan), str(greedy))


def test_an_mlp_gradient_under_tensor_parallelism_beats_greedy():
    """Greedy gathers where the solver keeps the Megatron layout; both equal one device."""

    def loss(x, w1, w2):
        return jnp.sum((jnp.tanh(x @ w1) @ w2) ** 2)

    r = np.random.default_rng(0)
    args = (
        r.standard_normal((16, 32)).astype(np.float32),
        r.standard_normal((32, 64)).astype(np.float32) / 8,
        r.standard_normal((64, 32)).astype(np.float32) / 8,
    )
    grad = jax.grad(loss, argnums=(1, 2))
    kw = dict(
        mesh=mesh("2x4"),
        in_specs=(jax.P("data"), jax.P(None, "model"), jax.P("model")),
        out_specs=(jax.P(None, "model"), jax.P("model")),
    )
    solved, greedy = sf.parallelize(grad, passes=sf.passes.SOLVER, **kw), sf.parallelize(grad, **kw)
    for a, e in zip(solved(*args), jax.jit(grad)(*args)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-5)
    s, g = solved.explain(*args), greedy.explain(*args)
    assert s.modelled_seconds < g.modelled_seconds and "planner: solver" in str(s)


def test_a_data_parallel_gradient_is_all_reduced_not_computed_whole_on_every_device():
    """By the α-β model alone, a small data-parallel step is cheapest gathering its batch and
    running every matmul whole (one small all-gather instead of an all-reduce per gradient).
    The solver divides every matmul's flops as far as its operands allow, as GSPMD would."""

    def loss(w1, w2, x):
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)

    r = np.random.default_rng(0)
    args = (
        r.standard_normal((16, 32)).astype(np.float32) / 4,
        r.standard_normal((32, 16)).astype(np.float32) / 4,
        r.standard_normal((16, 16)).astype(np.float32),
    )
    grad = jax.grad(loss, argnums=(0, 1))
    step = sf.parallelize(
        grad,
        mesh=sf.make_mesh({"data": 8}),
        in_specs=(jax.P(), jax.P(), jax.P("data")),
        out_specs=(jax.P(), jax.P()),
        passes=sf.passes.SOLVER,
    )
    plan = step.explain(*args)
    assert plan.planner.startswith("solver"), plan.planner
    assert {c.kind for c in plan.collectives} == {"all_reduce"}, str(plan)  # no batch gathered
    # each weight's gradient all-reduced once (jax 0.11 reduces w2's before its transpose: (16, 32))
    assert sorted(math.prod(c.shape) * c.count for c in plan.collectives if c.shape) == [512, 512], str(plan)
    for a, e in zip(step(*args), jax.jit(grad)(*args)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-6)


def mlp_grad(w1, w2, x):
    return jax.grad(lambda w1, w2: jnp.sum(jnp.tanh(x @ w1) @ w2) ** 2, argnums=(0, 1))(w1, w2)


MLP_ARGS = tuple(
    np.random.default_rng(0).standard_normal(s).astype(np.float32) / 4 for s in ((16, 32), (32, 16), (16, 16))
)


@pytest.mark.parametrize("mesh_name", ["1x8", "2x4", "4x2", "8x1"])
def test_auto_finds_the_exhaustive_optimum_over_parameter_layouts(mesh_name):
    """sf.AUTO weights of an MLP's gradient, the batch split: on every factoring of the 8
    devices into (data, model), the solver's optimum equals the best of solving once per
    assignment of layouts to the weights — so the best over meshes is the exhaustive optimum
    over (mesh shape × parameter specs)."""
    m = mesh(mesh_name)
    batch = (Split(0), B)
    program = inlined(mlp_grad, MLP_ARGS, m, (None, None, batch), (None, None))
    prop = Propagation(program).seeded()
    _, chosen, optimum, _ = solve.assemble.choose(prop, program.jaxpr.jaxpr, program.out_sbp)
    w1, w2 = program.jaxpr.jaxpr.invars[:2]
    best = min(
        solve.assemble.choose(Propagation(p).seeded(), p.jaxpr.jaxpr, p.out_sbp)[2]
        for a in solve.build.layouts(prop, w1.aval)
        for b in solve.build.layouts(prop, w2.aval)
        for p in [inlined(mlp_grad, MLP_ARGS, m, (a, b, batch), (None, None))]
    )
    assert optimum == pytest.approx(best, rel=1e-6, abs=1e-12)
    assert set(chosen) == {w1, w2}


def attention_grad(wq, wo, x):
    """An attention block's weight gradients: q = k = v = x·wq per head, softmax attention, wo."""

    def loss(wq, wo):
        q = jnp.einsum("bsd,dhe->bshe", x, wq)
        p = jax.nn.softmax(jnp.einsum("bqhe,bkhe->bhqk", q, q) / 4.0, axis=-1)
        return jnp.sum(jnp.einsum("bhqk,bkhe,hed->bqd", p, q, wo) ** 2)

    return jax.grad(loss, argnums=(0, 1))(wq, wo)


def sf_attention_grad(wq, wo, x):
    """``attention_grad`` with shardflow's causal attention primitive (its forward and backward
    equations solved like the rest)."""

    def loss(wq, wo):
        q = jnp.einsum("bsd,dhe->bshe", x, wq)
        o = sf.ops.attention(q, q, q, causal=True, backend="xla")
        return jnp.sum(jnp.einsum("bqhe,hed->bqd", o, wo) ** 2)

    return jax.grad(loss, argnums=(0, 1))(wq, wo)


ATTENTION_ARGS = tuple(
    np.random.default_rng(1).standard_normal(s).astype(np.float32) / 4 for s in ((16, 4, 8), (4, 8, 16), (8, 8, 16))
)


@pytest.mark.parametrize("block", [attention_grad, sf_attention_grad])
@pytest.mark.parametrize("axes,auto", [({"model": 8}, (0, 1)), ({"data": 2, "model": 4}, (1,))])
def test_auto_finds_the_exhaustive_optimum_of_an_attention_block(axes, auto, block):
    """sf.AUTO weights of an attention block's gradient, the batch split over the first axis:
    the solver's optimum equals the best of solving once per assignment of layouts — both
    weights on one axis of 8 devices (9 assignments), the output projection on 2 x 4 (15; the
    query projection's heads over 'model'). With softmax attention written out, and with
    shardflow's attention primitive."""
    m = sf.make_mesh(axes)
    batch = (Split(0),) + (B,) * (len(axes) - 1)
    fixed = [None, None, batch]
    if 0 not in auto:
        fixed[0] = (B, Split(1))
    program = inlined(block, ATTENTION_ARGS, m, fixed, (None, None))
    prop = Propagation(program).seeded()
    _, chosen, optimum, _ = solve.assemble.choose(prop, program.jaxpr.jaxpr, program.out_sbp)
    invars = program.jaxpr.jaxpr.invars
    choices = [solve.build.layouts(prop, invars[k].aval) if k in auto else [fixed[k]] for k in (0, 1)]
    best = min(
        solve.assemble.choose(Propagation(p).seeded(), p.jaxpr.jaxpr, p.out_sbp)[2]
        for a, b in itertools.product(*choices)
        for p in [inlined(block, ATTENTION_ARGS, m, (a, b, batch), (None, None))]
    )
    assert optimum == pytest.approx(best, rel=1e-6, abs=1e-12)
    assert set(chosen) == {invars[k] for k in auto}


def test_auto_runs_and_equals_one_device_and_greedy_refuses_it():
    kw = dict(mesh=mesh("2x4"), in_specs=(sf.AUTO, sf.AUTO, jax.P("data")))
    step = sf.parallelize(mlp_grad, passes=sf.passes.SOLVER, **kw)
    for a, e in zip(step(*MLP_ARGS), jax.jit(mlp_grad)(*MLP_ARGS)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-5)
    plan = step.explain(*MLP_ARGS)
    assert "sf.AUTO chose 2 input layouts" in plan.planner, plan.planner
    assert all(s is not None for _, _, s in plan.inputs)
    with pytest.raises(sf.ShardingError, match=r"sf.AUTO for args\[0\], args\[1\].*passes=sf.passes.SOLVER"):
        sf.parallelize(mlp_grad, **kw).explain(*MLP_ARGS)
    with pytest.raises(sf.ShardingError, match="sf.AUTO is an in_specs leaf"):
        sf.parallelize(mlp_grad, out_specs=(sf.AUTO, None), passes=sf.passes.SOLVER, **kw).explain(*MLP_ARGS)


def test_a_memory_budget_on_the_inputs_is_kept_at_the_least_cost():
    """sf.AUTO weights whose gradients are wanted replicated: unconstrained, the solver keeps
    them split over one axis (1,536 input bytes per device); under a budget of 1,500 bytes the
    optimum is the best of the fixed-layout solves that fit, and an impossible budget, or the
    greedy planner, is refused."""
    m = mesh("2x4")
    batch, outs = (Split(0), B), ((B, B), (B, B))
    base = inlined(mlp_grad, MLP_ARGS, m, (None, None, batch), outs)
    prop = Propagation(base).seeded()
    w1, w2, x = base.jaxpr.jaxpr.invars
    free = solve.assemble.choose(prop, base.jaxpr.jaxpr, base.out_sbp)
    assert sum(local_bytes(v.aval, s, m) for v, s in free[1].items()) + 512 == 1536

    budget = 1500
    program = base.replace(memory_budget=budget)
    _, chosen, optimum, _ = solve.assemble.choose(Propagation(program).seeded(), program.jaxpr.jaxpr, program.out_sbp)
    assert sum(local_bytes(v.aval, s, m) for v, s in chosen.items()) + 512 <= budget
    fits = [
        p
        for a in solve.build.layouts(prop, w1.aval)
        for b in solve.build.layouts(prop, w2.aval)
        if local_bytes(w1.aval, a, m) + local_bytes(w2.aval, b, m) + 512 <= budget
        for p in [inlined(mlp_grad, MLP_ARGS, m, (a, b, batch), outs)]
    ]
    best = min(solve.assemble.choose(Propagation(p).seeded(), p.jaxpr.jaxpr, p.out_sbp)[2] for p in fits)
    assert optimum == pytest.approx(best, rel=1e-6) and optimum > free[2]

    kw = dict(mesh=m, in_specs=(sf.AUTO, sf.AUTO, jax.P("data")), out_specs=(jax.P(), jax.P()))
    step = sf.parallelize(mlp_grad, passes=sf.passes.SOLVER, memory_budget=budget, **kw)
    for a, e in zip(step(*MLP_ARGS), jax.jit(mlp_grad)(*MLP_ARGS)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-5)
    with pytest.raises(sf.ShardingError, match=r"infeasible.*memory_budget=900 bytes per device.*take 512"):
        sf.parallelize(mlp_grad, passes=sf.passes.SOLVER, memory_budget=900, **kw).explain(*MLP_ARGS)
    with pytest.raises(sf.ShardingError, match="greedy planner does not keep to a memory budget"):
        sf.parallelize(mlp_grad, memory_budget=budget, mesh=m, in_specs=(jax.P(), jax.P(), jax.P("data"))).explain(
            *MLP_ARGS
        )


def test_plan_solves_every_factoring_of_the_devices_and_ranks_them():
    """sf.plan over {data, model} on 8 devices with sf.AUTO weights: each of the four meshes
    solved, ranked by modelled time, each rank its program's own explain; the best runs and
    equals one device; under a memory budget only the meshes whose plans keep to it rank."""
    ranked = sf.plan(mlp_grad, *MLP_ARGS, in_specs=(sf.AUTO, sf.AUTO, jax.P("data")))
    assert sorted(tuple(c.mesh_shape.values()) for c in ranked) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert [c.seconds for c in ranked] == sorted(c.seconds for c in ranked)
    for c in ranked:
        assert not c.refused and c.seconds == c.step.explain(*MLP_ARGS).modelled_seconds
        assert "sf.AUTO chose 2 input layouts" in c.explain.planner
    for a, e in zip(ranked[0].step(*MLP_ARGS), jax.jit(mlp_grad)(*MLP_ARGS)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-5)
    # a mesh whose data axis does not divide the batch is refused, ranked last, and says why
    ranked = sf.plan(mlp_grad, *MLP_ARGS[:2], MLP_ARGS[2][:12], in_specs=(sf.AUTO, sf.AUTO, jax.P("data")))
    assert ranked[-1].mesh_shape == {"data": 8, "model": 1} and ranked[-1].step is None
    assert ranked[-1].seconds == float("inf") and "12" in ranked[-1].refused, ranked[-1].refused
    assert all(c.step is not None for c in ranked[:-1])
    # a memory budget bounds each mesh's plan (explain's memory_bytes); a mesh with none that
    # keeps to it is refused as infeasible
    fits = sf.plan(mlp_grad, *MLP_ARGS, in_specs=(sf.AUTO, sf.AUTO, jax.P("data")), memory_budget=800)
    assert [c.mesh_shape for c in fits[:2]] == [{"data": 4, "model": 2}, {"data": 8, "model": 1}]
    assert all(c.explain.memory_bytes <= 800 for c in fits[:2])
    assert all(c.step is None and "infeasible" in c.refused for c in fits[2:])


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


def test_other_control_flow_is_laid_out_by_greedy_and_the_rest_solved_around_it():
    """A while loop's layout is greedy's (its body propagated from its operands); the equations
    around it are solved, and explain says so. With sf.AUTO inputs greedy cannot lay the loop
    out: the solver refuses, naming the loop."""

    def f(w, x):
        h = jnp.tanh(x @ w)
        c = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] + h[1])), (0, h[0]))[1]
        return c @ w.T

    r = np.random.default_rng(0)
    w, x = r.standard_normal((16, 16)).astype(np.float32) / 4, r.standard_normal((4, 8, 16)).astype(np.float32)
    step = sf.parallelize(
        f, mesh=mesh("2x4"), in_specs=(jax.P(None, "model"), jax.P(None, "data")), passes=sf.passes.SOLVER
    )
    np.testing.assert_allclose(np.asarray(step(w, x)), np.asarray(jax.jit(f)(w, x)), rtol=1e-5, atol=1e-6)
    plan = step.explain(w, x)
    assert plan.planner.startswith("solver (optimal") and "1 control-flow equation laid out by greedy" in plan.planner
    greedy = sf.parallelize(f, mesh=mesh("2x4"), in_specs=(jax.P(None, "model"), jax.P(None, "data"))).explain(w, x)
    assert plan.modelled_seconds <= greedy.modelled_seconds * (1 + 1e-9)
    with pytest.raises(sf.ShardingError, match=r"sf.AUTO for args\[0\]: the solver did not run \(while at"):
        sf.parallelize(f, mesh=mesh("2x4"), in_specs=(sf.AUTO, jax.P(None, "data")), passes=sf.passes.SOLVER).explain(
            w, x
        )


def test_pins_hold():
    """sf.constrain fixes a value's NdSbp, whatever it costs."""

    def f(x):
        return jnp.tanh(sf.constrain(x * 2, (S(1), B))) + 1

    x = np.ones((8, 16), np.float32)
    step = sf.parallelize(f, mesh=mesh("2x4"), in_specs=((S(0), B),), out_specs=(S(0), B), passes=sf.passes.SOLVER)
    np.testing.assert_allclose(np.asarray(step(x)), np.tanh(2 * x) + 1, rtol=1e-6)
    assert [c.kind for c in step.explain(x).collectives] == ["all_to_all", "all_to_all"]


@pytest.mark.parametrize(
    "case,strategy",
    [(case, strategy) for case in ("mlp", "vocab_ce") for strategy in ("dp", "fsdp", "tp", "sp", "2d")]
    + [("attention", "fsdp"), ("attention", "2d")],
)
def test_the_equivalence_programs_solved(case, strategy):
    """The oracle suite's straight-line programs (tests/programs.py) under each strategy: the
    solver runs, equals one device, and its plan costs no more than greedy's. The attention
    block's gradient (~110 equations of 4-D values, ~120k columns) takes 3-4 s of HiGHS: its
    LP relaxation comes out integral, where branch and bound alone did not finish within a
    minute under fsdp."""
    from programs import CASES
    from test_equivalence import assert_trees_close

    m = mesh("2x4")
    fn, args, in_specs, out_specs = CASES[case](strategy, m)
    solved = sf.parallelize(fn, mesh=m, in_specs=in_specs, out_specs=out_specs, passes=sf.passes.SOLVER)
    assert_trees_close(solved(*args), jax.jit(fn)(*args))
    plan = solved.explain(*args)
    greedy = sf.parallelize(fn, mesh=m, in_specs=in_specs, out_specs=out_specs).explain(*args)
    assert plan.planner.startswith("solver (optimal"), plan.planner
    assert not plan.fallbacks
    assert plan.modelled_seconds <= greedy.modelled_seconds * (1 + 1e-9), (str(plan), str(greedy))


def test_the_iteration_limit_hands_the_program_to_greedy_whatever_the_clock(monkeypatch):
    """A relaxation stops at a count of simplex iterations, not at a clock (the same plan on a
    loaded machine as on an idle one); out of them, the program goes to greedy."""
    from programs import CASES
    from test_equivalence import assert_trees_close

    monkeypatch.setattr(solve.highs, "ITERATION_LIMIT", 1)
    m = mesh("2x4")
    fn, args, in_specs, out_specs = CASES["mlp"]("tp", m)
    step = sf.parallelize(fn, mesh=m, in_specs=in_specs, out_specs=out_specs, passes=sf.passes.SOLVER)
    assert_trees_close(step(*args), jax.jit(fn)(*args))
    planner = step.explain(*args).planner
    assert planner.startswith(
        "greedy (the solver did not run: the LP relaxation stopped: Iteration limit reached after 1 iterations"
    ), planner


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
        _layers_grad,
        mesh=mesh("2x4"),
        in_specs=(jax.P(), jax.P(("data", "model"))),
        out_specs=jax.P(),
        passes=sf.passes.SOLVER,
    )
    planner = step.explain(ws, x).planner
    assert planner.startswith("solver (optimal"), planner
    assert "the loops among them: solving them ran out of time, and the optimum leaves out" in planner, planner
    assert_trees_close(step(ws, x), jax.jit(_layers_grad)(ws, x))


def _layers_grad(ws, x):
    def loss(ws):
        h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
        return jnp.sum(h * h)

    return jax.grad(loss)(ws)


def test_a_memory_budget_bounds_what_the_layer_loops_hold():
    """explain's memory_bytes (the inputs, and what the loops not in a loop stack: the layer
    loop's residuals and its per-layer gradients) is what a budget bounds. Data parallel, the
    optimum holds each layer's gradient all-reduced (whole); a budget one byte below that
    plan's makes the solver hold them split and gather after the loop — slower by the model,
    equal to one device — and a budget below every plan is refused as infeasible, without
    falling back to a plan that breaks it."""
    r = np.random.default_rng(0)
    ws, x = r.standard_normal((4, 64, 64)).astype(np.float32) / 8, r.standard_normal((64, 64)).astype(np.float32)
    kw = dict(
        mesh=mesh("2x4"), in_specs=(jax.P(), jax.P(("data", "model"))), out_specs=jax.P(), passes=sf.passes.SOLVER
    )
    free = sf.parallelize(_layers_grad, **kw).explain(ws, x)
    assert free.input_bytes == ws.nbytes + x.nbytes // 8
    assert free.loop_bytes >= ws.nbytes  # the stacked gradients, whole
    assert "held by loops" in str(free)
    step = sf.parallelize(_layers_grad, memory_budget=free.memory_bytes - 1, **kw)
    tight = step.explain(ws, x)
    assert tight.planner.startswith("solver (optimal")
    assert tight.memory_bytes < free.memory_bytes and tight.loop_bytes < ws.nbytes
    assert tight.modelled_seconds > free.modelled_seconds
    assert_trees_close(step(ws, x), jax.jit(_layers_grad)(ws, x))
    with pytest.raises(
        sf.ShardingError,
        match=r"memory_budget=70,000 bytes: the solver did not run \(the LP "
        r"relaxation is infeasible.*of which the inputs with specs take 67,584",
    ):
        sf.parallelize(_layers_grad, memory_budget=70_000, **kw).explain(ws, x)


def test_a_loop_hides_its_gradient_reductions_behind_its_matmuls():
    """The overlap model: under data parallelism a layer loop's per-layer weight gradients are
    all-reduced inside the backward loop, behind the other layers' matmuls; explain counts
    what hides (at most the collectives, at most the matmuls' time) and the solver's optimum
    is the plan's modelled time with it. With free matmuls nothing hides."""
    r = np.random.default_rng(0)
    ws, x = r.standard_normal((4, 64, 64)).astype(np.float32) / 8, r.standard_normal((64, 64)).astype(np.float32)
    kw = dict(mesh=mesh("2x4"), in_specs=(jax.P(), jax.P(("data", "model"))), out_specs=jax.P())
    slow = sf.LinkModel(flops=1e9)  # matmuls slow enough to hide every reduction
    step = sf.parallelize(_layers_grad, passes=sf.passes.SOLVER, links=slow, **kw)
    assert_trees_close(step(ws, x), jax.jit(_layers_grad)(ws, x))
    plan = step.explain(ws, x)
    in_loop = sum(c.seconds * c.count for c in plan.collectives if c.count == 4)
    assert in_loop > 0 and plan.hidden_seconds == pytest.approx(in_loop)
    assert plan.modelled_seconds == pytest.approx(plan.total_seconds + plan.work_seconds - plan.hidden_seconds)
    assert "solver (optimal" in plan.planner
    free = sf.parallelize(_layers_grad, passes=sf.passes.SOLVER, links=sf.LinkModel(flops=math.inf), **kw)
    assert free.explain(ws, x).hidden_seconds == 0.0


def train_config(strategy="tp", mesh=None, batch_size=16, preset="tiny", seq=128):
    """The trainer's config of a preset (tiny unless said) under the solver, ``batch_size`` x
    ``seq`` tokens, tensor-parallel on {data: 2, model: 4} unless said."""
    from shardflow.train import config

    mesh = {"data": 2, "model": 4} if mesh is None else mesh
    cfg = config.Config(engine="shardflow", strategy=strategy, mesh=mesh, planner="solver", batch_size=batch_size)
    cfg.model = {"preset": preset}
    cfg.data.seq_len = seq
    return cfg


def train_step_shapes(strategy="tp", mesh=None, batch_size=16, preset="tiny", seq=128):
    """(config, run, state shapes, batch shapes) of ``train_config``'s train step."""
    from shardflow import train

    cfg = train_config(strategy, mesh, batch_size, preset, seq)
    run = train.setup(cfg)
    state = jax.eval_shape(lambda: train.init_state(run))
    tokens = jax.ShapeDtypeStruct((1, batch_size, seq), np.int32)
    return cfg, run, state, {"inputs": tokens, "targets": tokens}


@functools.cache
def tiny_tp_plan():
    """The solver's explain plan of ``train_step_shapes`` (one solve per test process)."""
    _, run, state, batch = train_step_shapes()
    return run.train_step().explain(*state, batch)


def test_tensor_parallel_llama_layers_run_megatrons_forward_where_weights_outweigh_activations():
    """Megatron's collectives for tp, as far as the cost model bears it out. With one 128-token
    sequence per data replica of the tiny preset (a layer's weights larger than its
    activations) the solved layer is Megatron's: per layer one all-reduce after attention and
    one after the MLP in the forward, in the activations' bf16, and the same two for the input
    gradients in the backward. Here they run over (data, model): the weights, whole over data,
    are sliced there for free, so the layers run 8-way tensor parallel on the whole batch and
    the backward needs no residual gathered per layer (before the router took a collective over
    several axes as one hop, the forward ran 4-way over model on each replica's sequence and
    gathered two residual stacks for the backward: 0.6 µs dearer by the model). The weight
    gradients are all-reduced over 'data' once, stacked, after the loop. No layer weight
    gathered, no all_to_all."""
    _, run, state, batch = train_step_shapes(batch_size=2)
    plan = run.train_step().explain(*state, batch)
    assert plan.planner.startswith("solver (optimal"), plan.planner
    layer = [c for c in plan.collectives if c.count == 4]
    activations = [(c.kind, c.axes, c.source.split(":")[0]) for c in layer if c.shape == (2, 128, 256)]
    assert activations == [("all_reduce", ("data", "model"), "llama.py")] * 4, str(plan)
    assert all(c.axes == ("data",) and c.kind == "all_reduce" for c in layer if c.shape != (2, 128, 256)), str(plan)
    assert not [c for c in plan.collectives if c.kind == "all_to_all"], str(plan)
    assert not plan.gathered, plan.gathered


def test_tensor_parallel_attention_runs_batch_split_where_its_weights_are_cheaper_to_gather():
    """At 16 x 128 tokens the tiny preset's activations outweigh attention's weights: the solver
    gathers wq, wk, wv and wo whole over 'model' once, before the layer loops, and runs attention
    on the batch split over 'model' (data parallel there), the MLP as Megatron does; explain
    names each weight gathered and says that the solver chose it. (On 4 H200s the 1b preset
    under fsdp ran at 1.47x the tokens/s of Megatron tp: benchmarks/results/scaling.md.)"""
    plan = tiny_tp_plan()
    assert plan.planner.startswith("solver (optimal"), plan.planner
    layers = sorted(name.split("'")[-2] for name, *_ in plan.gathered if "['layers']" in name)
    assert layers == ["wk", "wo", "wq", "wv"], plan.gathered
    assert "(the solver planner's choice)" in str(plan)
    assert not [c for c in plan.collectives if c.kind == "all_to_all"], str(plan)


@functools.cache
def llama_1b_plan(strategy, mesh=(("data", 2), ("model", 4)), batch=2):
    """(plan, layers, state) of the 1b preset's train step under the solver, ``batch`` sequences
    of 2048 tokens on ``mesh``. By default one sequence per data replica on {data: 2, model: 4}:
    a layer's weights (100 MB in bf16) outweigh its activations (8 MB), the size tensor
    parallelism is for."""
    _, run, state, tokens = train_step_shapes(strategy, dict(mesh), batch, preset="1b", seq=2048)
    plan = run.train_step().explain(*state, tokens)
    return plan, len(state[0]["layers"]["attn"]["wq"]), state


def _per_layer(plan, layers, shape):
    """The per-layer collectives of ``plan`` on values of ``shape`` and on everything else."""
    layer = [c for c in plan.collectives if c.count == layers]
    return [c for c in layer if c.shape == shape], [c for c in layer if c.shape != shape]


def test_sequence_parallel_llama_layers_run_megatron_sp_at_the_1b_preset():
    """Megatron-SP's collectives for tp_sp on the Llama 1b preset (explain on 8 simulated devices):
    per layer, Megatron-SP's collectives over 'model' on the [B, S, D] activations, in program
    order — forward all-gather before attention, reduce-scatter after it, the same around the
    MLP; backward the same four. Everything else per layer is data parallelism's gradient
    all-reduce over 'data', and the RMSNorm scales' (replicated, as in Megatron-SP) over both
    axes. No all_to_all, no layer weight gathered."""
    plan, layers, state = llama_1b_plan("tp_sp")
    assert plan.planner.startswith("solver (optimal"), plan.planner
    activations, rest = _per_layer(plan, layers, (2, 2048, 2048))
    assert [(c.kind, c.axes) for c in activations] == 4 * [
        ("all_gather", ("model",)),
        ("reduce_scatter", ("model",)),
    ], str(plan)
    weights = {leaf.shape[1:] for block in state[0]["layers"].values() for leaf in block.values()}
    for c in rest:  # a norm scale's gradient is reduced as [D] or as its [1, 1, D] broadcast
        assert c.kind == "all_reduce" and (c.shape in weights or c.shape == (1, 1, 2048)), str(c)
        assert c.axes == (("data", "model") if np.prod(c.shape) == 2048 else ("data",)), str(c)
    assert not [c for c in plan.collectives if c.kind == "all_to_all"], str(plan)
    assert not plan.gathered, plan.gathered


def test_tensor_parallel_llama_layers_move_megatrons_bytes_at_the_1b_preset():
    """Megatron's bytes for tp on the 1b preset, as far as the cost model bears it out.
    Per layer the [B, S, D] activations move exactly Megatron's bytes over 'model' — four
    all-reduces' worth, two in the forward and two in the backward — but not all as
    all-reduces: after attention the solver reduce-scatters the residual, runs the MLP's RMSNorm
    on a quarter of the tokens and all-gathers its output (and the norm's [B, S, 1] scale),
    which the model prices 10 µs dearer in collectives and cheaper in local work. No all_to_all,
    no layer weight gathered: at four sequences per replica the solver gathers weights instead
    (the tiny preset's test below)."""
    plan, layers, _ = llama_1b_plan("tp")
    assert plan.planner.startswith("solver (optimal"), plan.planner
    activations, rest = _per_layer(plan, layers, (2, 2048, 2048))
    assert {c.axes for c in activations} == {("model",)}, str(plan)
    all_reduce = 2048 * 2048 * 2 * 2 * 3 // 4  # a replica's [S, D] in bf16, a ring's 2 (n-1)/n on 4 devices
    assert sum(c.bytes for c in activations) == 4 * all_reduce, str(plan)
    assert not [c for c in rest if "model" in c.axes and c.shape not in {(2, 2048, 1), (2048,), (1, 1, 2048)}], str(
        plan
    )
    assert not [c for c in plan.collectives if c.kind == "all_to_all"], str(plan)
    assert not plan.gathered, plan.gathered


def test_fully_sharded_llama_layers_run_fsdps_collectives_at_the_1b_preset():
    """FSDP's collectives on the 1b preset (8 x 2048 tokens on {data: 8}): per
    layer, each of its seven weights all-gathered once in the forward and once in the
    backward, in bf16, and each gradient reduce-scattered once; the two RMSNorm scales
    (replicated) all-reduced. No all_to_all in the layers, no layer weight gathered ahead of
    them. Outside the layers: lm_head gathered once, for the forward and the backward, its
    gradient reduce-scattered; and the embedding looked up where its table lies, split along D,
    on all the tokens (their ids gathered, 57 KB), the [B, S, D] result then taken to the batch
    split by one all_to_all (7 MB) and its gradient back by another, where gathering the table
    would send 115 MB."""
    plan, layers, state = llama_1b_plan("fsdp", (("data", 8),), 8)
    assert plan.planner.startswith("solver (optimal"), plan.planner
    weights = sorted(
        leaf.shape[1:] for block in state[0]["layers"].values() for leaf in block.values() if leaf.ndim > 2
    )
    per_layer = [c for c in plan.collectives if c.count == layers]
    assert all(c.axes == ("data",) for c in per_layer), str(plan)
    assert sorted(c.shape for c in per_layer if c.kind == "all_gather") == sorted(2 * weights), str(plan)
    assert all(c.dtype == "bfloat16" for c in per_layer if c.kind == "all_gather"), str(plan)
    assert sorted(c.shape for c in per_layer if c.kind == "reduce_scatter") == weights, str(plan)
    assert [c.shape for c in per_layer if c.kind == "all_reduce"] == [(2048,)] * 2, str(plan)
    a2a = [c for c in plan.collectives if c.kind == "all_to_all"]
    assert [(c.shape, c.count) for c in a2a] == [((8, 2048, 2048), 1)] * 2, str(plan)
    assert [name for name, *_ in plan.gathered if not name.endswith("[layer]")] == ["args[0]['lm_head']"], plan.gathered


def test_fsdp_gathers_each_layer_weight_per_layer_where_the_whole_weights_do_not_fit():
    """FSDP's collectives (the tiny preset's train step on {data: 8}). With no
    budget the solver gathers each stacked weight once, before the layer loops, for the forward
    and the backward, and reduce-scatters each stacked gradient once, after them: one collective
    where FSDP has one per layer, the whole weights and the partial gradients held across the
    step, which explain counts in memory_bytes (and names the weights gathered). Under a budget of greedy's
    plan's memory the whole weights do not fit, and the solved plan is FSDP's: per layer weight
    one all-gather in the forward and one in the backward, one reduce-scatter per gradient, no
    all-to-all."""
    cfg, run, state, batch = train_step_shapes("fsdp", {"data": 8})
    n_layers, weights = 4, ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    free = run.train_step().explain(*state, batch)
    hoisted = [name for name, *_ in free.gathered if "['layers']" in name]
    assert sorted(name.split("'")[-2] for name in hoisted) == sorted(weights), free.gathered
    from shardflow import train

    cfg.planner = "greedy"
    greedy = train.setup(cfg).train_step().explain(*state, batch)
    cfg.planner = "solver"
    whole = sum(np.prod(leaf.shape) * 2 for name, leaf in _layer_weights(state) if name in weights)  # bf16
    assert free.loop_bytes - greedy.loop_bytes == pytest.approx(2 * whole * 7 / 8)
    assert sorted({(c.kind, c.count) for c in free.collectives if c.shape[:1] == (n_layers,)}) == [
        ("all_gather", 1),
        ("reduce_scatter", 1),
    ], str(free)
    step = run.train_step()
    step.memory_budget = greedy.memory_bytes
    plan = step.explain(*state, batch)
    assert plan.planner.startswith("solver (optimal"), plan.planner
    assert plan.memory_bytes <= greedy.memory_bytes
    per_layer = [c for c in plan.collectives if c.count == n_layers and c.kind != "all_reduce"]
    assert sorted(c.kind for c in per_layer) == ["all_gather"] * 14 + ["reduce_scatter"] * 7, str(plan)
    assert not [c for c in plan.collectives if c.kind == "all_to_all"], str(plan)
    gathered = sorted((c.shape, c.dtype) for c in per_layer if c.kind == "all_gather")
    assert gathered == sorted(
        2 * [(leaf.shape[1:], "bfloat16") for name, leaf in _layer_weights(state) if name in weights]
    )
    assert not [name for name, *_ in plan.gathered if "[layer]" not in name and "['layers']" in name]


def _layer_weights(state):
    params = state[0]
    return [(name, leaf) for block in params["layers"].values() for name, leaf in block.items()]


def test_a_plan_leaning_on_hiding_is_solved_again_at_its_own_overlap_shares():
    """The tiny preset's tensor-parallel train step: priced at the overlap shares of greedy's
    plan the solver's first optimum hides more of its loops' gradient reductions than its
    matmuls can (295 µs modelled, 826 µs as boxed, against greedy's 644); solved again at the
    shares its own plan leaves exposed, the kept plan is the solver's, its model optimum within
    2 % of its cost as boxed, and cheaper than greedy's."""
    from shardflow import train

    cfg, run, state, batch = train_step_shapes()
    plan = tiny_tp_plan()
    assert plan.planner.startswith("solver (optimal"), plan.planner
    modelled = float(plan.planner.split("optimal: ")[1].split(" us")[0]) * 1e-6
    assert modelled == pytest.approx(plan.modelled_seconds, rel=0.02)
    cfg.planner = "greedy"
    greedy = train.setup(cfg).train_step().explain(*state, batch)
    assert plan.modelled_seconds < greedy.modelled_seconds


def test_the_solves_of_one_program_price_each_conversion_once_and_the_second_starts_warm(monkeypatch):
    """The tiny tensor-parallel train step is solved twice (at greedy's overlap shares, then at
    its own plan's): the second solve reuses the first's conversion prices, and plans none again;
    its LP relaxation, of the same constraints, starts from the first's optimal basis (the same
    HiGHS instance). (Not always in fewer simplex iterations: 37,073 against 40,718 cold here,
    36,716 against 35,988 before a loop's stacked outputs could be partial.)"""
    from shardflow import conversion

    priced, solves, inside, lps = [], [], [False], []
    seconds, choose, relaxation = conversion.Pricer._seconds, solve.assemble.choose, solve.highs.relaxation

    def counted_seconds(pricer, src, dst):
        if inside[0]:
            priced.append((pricer.shape, pricer.dtype, src, dst))
        return seconds(pricer, src, dst)

    def counted_choose(*args, **kwargs):
        solves.append(1)
        inside[0] = True
        try:
            return choose(*args, **kwargs)
        finally:
            inside[0] = False

    def counted_relaxation(*args):
        warm = args[-1]
        before = warm.get("highs")
        result = relaxation(*args)
        lps.append((before, warm["highs"], warm["highs"].getInfo().simplex_iteration_count))
        return result

    monkeypatch.setattr(conversion.Pricer, "_seconds", counted_seconds)
    monkeypatch.setattr(solve.assemble, "choose", counted_choose)
    monkeypatch.setattr(solve.highs, "relaxation", counted_relaxation)
    _, run, state, batch = train_step_shapes()
    assert run.train_step().explain(*state, batch).planner.startswith("solver (optimal")
    assert len(solves) == 2
    assert priced and len(set(priced)) == len(priced)
    (first, h1, cold), (reused, h2, warm) = lps
    assert first is None and reused is h1 and h2 is h1
    assert cold > 0 and warm > 0


def _odd_cycle() -> "solve.model.Model":
    """max x1 + x2 + x3 with x_i + x_j <= 1 for each pair: the LP's optimum is x = 1/2 each
    (1.5), the integer program's 1 — a relaxation that is fractional everywhere."""
    m = solve.model.Model()
    xs = [m.var(-1e-6, integral=True) for _ in range(3)]
    for i, j in itertools.combinations(xs, 2):
        m.row([(i, 1.0), (j, 1.0)], -math.inf, 1.0)
    return m


def test_a_fractional_relaxation_is_branched_to_the_integer_optimum_and_says_it_is_proven():
    result = _odd_cycle().solve(time_limit=30)
    assert result.status == 0
    assert np.allclose(np.round(result.x), result.x) and round(result.x.sum()) == 1
    assert result.fun == pytest.approx(-1.0) and result.bound == pytest.approx(result.fun)


def test_a_time_limit_in_branch_and_bound_keeps_the_relax_and_fix_plan_with_the_lp_bound(monkeypatch):
    real = optimize.milp

    def milp(cost, bounds, **kwargs):  # the whole program's branch and bound runs out of time
        if np.all(bounds.lb == 0) and np.all(bounds.ub == 1):
            return optimize.OptimizeResult(x=None, status=1, message="Time limit reached")
        return real(cost, bounds=bounds, **kwargs)

    monkeypatch.setattr(optimize, "milp", milp)
    m = _odd_cycle()
    y = m.var(1e-6, integral=True)  # a column the relaxation settles (0): fixed there
    m.row([(y, 1.0)], 0.0, 1.0)
    result = m.solve(time_limit=30)
    assert result.status == 0 and result.x[y] == 0
    assert result.fun == pytest.approx(-1.0)
    assert result.bound == pytest.approx(-1.5)  # the relaxation's: not proven optimal


def test_a_relax_and_fix_plan_as_cheap_as_the_relaxation_ends_the_solve(monkeypatch):
    """Relax and fix reaching the relaxation's cost is optimal: the whole program's branch and
    bound (13 s on the 1b tensor-parallel step, 36 s under a GPU's memory budget) does not run.
    The odd cycle's relaxation (1.5) is reported at the integer optimum (1.0) here, so that the
    fixed plan meets it."""
    real, calls = solve.highs.relaxation, []

    def relaxation(*args, **kwargs):
        result = real(*args, **kwargs)
        result.fun = -1.0  # in the solver's units (cost x 1e6)
        return result

    def milp(cost, bounds, **kwargs):
        calls.append(np.all(bounds.lb == 0) and np.all(bounds.ub == 1))
        return optimize_milp(cost, bounds=bounds, **kwargs)

    optimize_milp = optimize.milp
    monkeypatch.setattr(solve.highs, "relaxation", relaxation)
    monkeypatch.setattr(optimize, "milp", milp)
    m = _odd_cycle()
    y = m.var(1e-6, integral=True)  # a column the relaxation settles (0): fixed there
    m.row([(y, 1.0)], 0.0, 1.0)
    result = m.solve(time_limit=30)
    assert calls == [False]  # the fixed problem only, not the whole one
    assert result.status == 0 and result.x[y] == 0 and round(result.x.sum()) == 1
    assert result.fun == pytest.approx(-1.0) and result.bound == pytest.approx(-1.0)


def _adamw_step():
    """An MLP's AdamW step (optax) with its parameters and moments split over both axes of a
    2 x 4 mesh (fsdp): (program, the jaxpr's invars' names)."""
    import optax

    r = np.random.default_rng(0)
    params = {
        "w1": r.standard_normal((64, 128)).astype(np.float32) / 8,
        "w2": r.standard_normal((128, 64)).astype(np.float32) / 8,
    }
    opt = optax.adamw(1e-3)
    state = opt.init(params)
    x = r.standard_normal((32, 64)).astype(np.float32)

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    args = (params, state, x)
    split = (Split(0), Split(0))  # dim 0 over (data, model)
    in_sbp = [split if np.ndim(leaf) == 2 else (B, B) for leaf in jax.tree.leaves((params, state))]
    in_sbp.append((Split(0), B))
    out_sbp = in_sbp[:-1]
    return inlined(step, args, mesh("2x4"), in_sbp, out_sbp)


def test_an_optimizers_pinned_tail_is_coarsened_to_the_same_optimum(monkeypatch):
    """AdamW's update of each parameter goes only to outputs pinned at the parameter's spec:
    coarsened, its elementwise equations (``pinned_tail``) run there, each gradient converted
    once where it enters — an integer program of less than half the columns, with the same
    optimum. A program this small is solved exactly unless told otherwise (``COARSEN``)."""
    program = _adamw_step()
    jaxpr = program.jaxpr.jaxpr
    tail = solve.coarsen.pinned_tail(jaxpr, program.in_sbp, program.out_sbp)
    assert len(tail) == 36
    assert all("optax" in source_line(eqn) for eqn in tail)
    assert set(tail.values()) == {(Split(0), Split(0))}

    def solved(coarsen):
        monkeypatch.setattr(solve.coarsen, "COARSEN", coarsen)
        prop = Propagation(program).seeded()
        model, _, _ = solve.build.build(prop, jaxpr, program.out_sbp)
        return len(model.cost), solve.assemble.choose(Propagation(program).seeded(), jaxpr, program.out_sbp)[2]

    default = solved(solve.coarsen.COARSEN)
    coarse_columns, coarse = solved(0)
    exact_columns, exact = solved(math.inf)
    assert default == (exact_columns, exact)
    assert coarse_columns < exact_columns / 2
    assert coarse == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("strategy", ["tp", "tp_sp"])
def test_the_solved_train_step_with_attention_equals_jits(strategy):
    """The tiny preset's train step in float32, solved — attention among the equations the
    solver lays out, the layers' weight gradients partial out of the loop and all-reduced once,
    stacked — runs on 8 devices to the new parameters, optimizer state and metrics of jax.jit's
    step with the same specs."""
    from shardflow import train

    outs = {}
    for engine in ("jit", "shardflow"):
        cfg = train_config(strategy, batch_size=8)
        cfg.engine, cfg.compute_dtype = engine, "float32"
        run = train.setup(cfg)
        tokens = np.random.default_rng(0).integers(0, 256, (1, 8, 128)).astype(np.int32)
        batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=2)}
        step = run.train_step()
        if engine == "shardflow":
            planner = step.explain(*jax.eval_shape(lambda: train.init_state(run)), batch).planner
            assert planner.startswith("solver") and "laid out by greedy" not in planner, planner
        outs[engine] = jax.tree.leaves(jax.device_get(step(*train.init_state(run), batch)))
    for a, e in zip(outs["shardflow"], outs["jit"], strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=2e-4, atol=2e-5)


def test_every_process_solves_a_program_to_the_same_plan():
    """Deterministic across processes, whose str hashes are salted and objects placed at other
    addresses (the SBP atoms hash by identity): the solved tiny train step under 2d, planned in
    two processes of different hash seeds, is the same plan, collective for collective."""
    import subprocess
    import sys

    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_solve; "
        "_, run, state, batch = test_solve.train_step_shapes('2d'); "
        "plan = run.train_step().explain(*state, batch); "
        "import re; print(re.sub(r'solved in [0-9.]+ s', '', plan.planner)); print(plan.modelled_seconds); "
        "print(*[(c.kind, c.axes, c.shape, c.count, c.source) for c in plan.collectives], sep='\\n')"
    )
    plans = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu")
        done = subprocess.run(
            [sys.executable, "-c", script, os.path.dirname(__file__)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        plans.append(done.stdout)
    assert plans[0].startswith("solver (optimal"), plans[0][:300]
    assert plans[0] == plans[1]


def test_one_alternatives_call_starts_each_relaxation_from_the_last_optimal_basis(monkeypatch):
    """Within one sf.alternatives call (``solve.shared_solves``) a candidate's LP relaxation
    starts from the optimal basis of the last one of its shape: fewer dual simplex iterations,
    and every figure the same as each annotation planned on its own, from the slack basis."""
    iterations = []
    relaxation = solve.highs.relaxation

    def counted(cost, a, lb, ub, warm=None):
        result = relaxation(cost, a, lb, ub, warm)
        iterations.append(warm["highs"].getInfo().simplex_iteration_count)
        return result

    monkeypatch.setattr(solve.highs, "relaxation", counted)
    step = sf.parallelize(
        mlp_grad,
        mesh=sf.make_mesh({"data": 2, "model": 4}),
        passes=sf.passes.SOLVER,
        in_specs=(jax.P(), jax.P(), jax.P("data")),
        out_specs=(jax.P(), jax.P()),
    )
    step.explain(*MLP_ARGS)

    def figures():
        iterations.clear()
        found = sf.alternatives(step, *MLP_ARGS, only=r"args\[[01]\]", top=None)
        return [(a.argument, str(a.spec), a.seconds) for a in found], sum(iterations)

    shared, warm = figures()
    monkeypatch.setattr(solve, "shared_solves", contextlib.nullcontext)  # sf.alternatives imports it per call
    alone, cold = figures()
    assert len(shared) > 10 and shared == alone
    assert warm < cold / 2, (warm, cold)
