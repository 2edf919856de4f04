"""passes.solve: the whole-program integer program. Its optimum is the brute-force minimum of
its model on small random programs; what it chooses runs equal to one device and costs, as
explain prices the plan, no more than greedy propagation; what it does not model goes to
greedy, and explain says which planner ran."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_tier import examples
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from solve_cases import (
    ATTENTION_ARGS,
    CHAIN_OPS,
    MLP_ARGS,
    attention_grad,
    chain,
    inlined,
    mesh,
    mlp_grad,
    model_cost,
    sf_attention_grad,
)
from test_random_programs import BINARY, UNARY, build, nd_sbp

import shardflow as sf
import shardflow.attention  # noqa: F401  (sf.attention: the attention primitive)
from shardflow import registry
from shardflow.conversion import local_bytes
from shardflow.passes import solve
from shardflow.passes.propagate import Propagation
from shardflow.specs import B, S, Split

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
EXAMPLES = int(os.environ.get("SHARDFLOW_HYPOTHESIS_EXAMPLES", "200"))
STRAIGHT = sorted(k for k in UNARY if not any(w in k for w in ("scan", "fori", "remat")))  # regions: greedy


def chosen_assignment(options, eqns) -> list:
    """The (Decision, own seconds) among each equation's ``options`` that the solver chose."""
    out = []
    for eqn, opts in zip(eqns, options):
        decision = registry.decision_of(eqn)
        out.append(next(o for o in opts if (o[0].ins, o[0].outs) == (decision.ins, decision.outs)))
    return out


@settings(max_examples=examples(50), **SETTINGS)
@given(
    ops=st.lists(st.sampled_from(CHAIN_OPS), min_size=1, max_size=3),
    specs=st.tuples(nd_sbp(), nd_sbp()),
    out=st.one_of(st.none(), nd_sbp()),
    mesh_name=st.sampled_from(["2x2", "2x4"]),
)
@example(ops=["matmul", "matmul"], specs=((S(1), S(1)), (S(1), S(0))), out=None, mesh_name="2x4")
@example(ops=["T", "matmul"], specs=((S(1), S(0)), (B, B)), out=None, mesh_name="2x4")
def test_the_optimum_is_the_brute_force_minimum(ops, specs, out, mesh_name):
    """Every assignment of one of the solver's own strategies (``build.strategies``) per
    equation, priced as the solver prices them (``model_cost``): the solver's optimum is their
    minimum, and the plan it assembles is an assignment that costs it. (The examples: programs
    whose LP relaxation is fractional, where branch and bound stopped within HiGHS's default
    relative gap, 1e-4, above the optimum.)"""
    r = np.random.default_rng(0)
    args = (r.standard_normal((8, 16)).astype(np.float32), r.standard_normal((16, 8)).astype(np.float32))
    fn = chain(ops)
    shape = jax.eval_shape(fn, *args).shape
    m = mesh(mesh_name)
    if out is not None and any(s.dim >= len(shape) for s in out if hasattr(s, "dim")):
        out = None
    if out is not None and not all(dim % m.size == 0 for dim in shape):
        out = None
    program = inlined(fn, args, m, specs, (out,))
    jaxpr = program.jaxpr.jaxpr
    prop = Propagation(program).seeded()
    options = [solve.build.strategies(prop, eqn) for eqn in jaxpr.eqns]
    assume(np.prod([len(o) for o in options]) <= 20_000)
    memo = {}
    best = min(model_cost(prop, jaxpr, program.out_sbp, a, memo) for a in itertools.product(*options))
    eqns, _, optimum, _ = solve.assemble.choose(Propagation(program).seeded(), jaxpr, program.out_sbp)
    assert optimum == pytest.approx(best, rel=1e-6, abs=1e-12)
    attained = model_cost(prop, jaxpr, program.out_sbp, chosen_assignment(options, eqns), memo)
    assert attained == pytest.approx(best, rel=1e-6, abs=1e-12)


# test_random_programs' programs, straight-line ops only (scans, loops and remat regions go to
# greedy), with pins
STEP = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(STRAIGHT), st.integers(0, 50)),
    st.tuples(st.just("binary"), st.sampled_from(sorted(BINARY)), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("matmul"), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("constrain"), st.integers(0, 50), nd_sbp()),
)


@settings(max_examples=examples(max(EXAMPLES // 4, 10)), **SETTINGS)
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


def test_a_data_parallel_gradient_divides_every_matmul_over_the_devices():
    """By the α-β model alone, a small data-parallel step is cheapest gathering its batch and
    running every matmul whole (one small all-gather instead of an all-reduce per gradient).
    The solver keeps only the strategies that divide a matmul's flops most, as GSPMD would:
    each device does an eighth of the one-device program's flops, no batch is gathered, and
    the gradients equal one device's."""

    def loss(w1, w2, x):
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)

    r = np.random.default_rng(0)
    args = (
        r.standard_normal((16, 32)).astype(np.float32) / 4,
        r.standard_normal((32, 16)).astype(np.float32) / 4,
        r.standard_normal((16, 16)).astype(np.float32),
    )
    grad = jax.grad(loss, argnums=(0, 1))
    kw = dict(in_specs=(jax.P(), jax.P(), jax.P("data")), out_specs=(jax.P(), jax.P()))
    step = sf.parallelize(grad, mesh=sf.make_mesh({"data": 8}), passes=sf.passes.SOLVER, **kw)
    plan = step.explain(*args)
    assert plan.planner.startswith("solver"), plan.planner
    one_device = sf.parallelize(grad, mesh=sf.make_mesh({"data": 1}), **kw).explain(*args)
    assert one_device.flops > 0 and plan.flops == pytest.approx(one_device.flops / 8), str(plan)
    assert not [c for c in plan.collectives if c.kind == "all_gather"], str(plan)
    for a, e in zip(step(*args), jax.jit(grad)(*args)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_memory_budget_on_the_inputs_is_kept_at_the_least_cost():
    """sf.AUTO weights whose gradients are wanted replicated, under a budget of 1,500 input bytes
    per device that the unconstrained optimum exceeds: the optimum is the best of the
    fixed-layout solves that fit, no better than the unconstrained one, and runs equal to one
    device; a budget below the fixed input's own bytes, or the greedy planner, is refused."""
    m = mesh("2x4")
    batch, outs = (Split(0), B), ((B, B), (B, B))
    base = inlined(mlp_grad, MLP_ARGS, m, (None, None, batch), outs)
    prop = Propagation(base).seeded()
    w1, w2, x = base.jaxpr.jaxpr.invars
    free = solve.assemble.choose(prop, base.jaxpr.jaxpr, base.out_sbp)
    budget = 1500
    assert local_bytes(x.aval, batch, m) == 512
    assert sum(local_bytes(v.aval, s, m) for v, s in free[1].items()) + 512 > budget  # the budget binds
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
    assert optimum == pytest.approx(best, rel=1e-6) and optimum >= free[2]

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
    kept = [c for c in fits if not c.refused]
    assert kept and len(kept) < len(fits)  # the budget binds on some meshes, not all
    assert fits[: len(kept)] == kept and [c.seconds for c in kept] == sorted(c.seconds for c in kept)
    assert all(c.explain.memory_bytes <= 800 for c in kept)
    assert all(c.step is None and "infeasible" in c.refused for c in fits[len(kept) :])


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
    pinned = [sbp for prim, _, _, sbp in step.explain(x).values if prim == "sf_constrain"]
    assert pinned == [(S(1), B)]


@pytest.mark.slow
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
