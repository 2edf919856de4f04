"""passes.solve's integer programming: branch and bound, relax and fix, time and iteration
limits, the optimizer-tail coarsening, and the conversion-price and optimal-basis caches that
later solves of one program (or of one sf.alternatives call) start from."""

import contextlib
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize
from solve_cases import MLP_ARGS, inlined, mesh, mlp_grad, train_step_shapes

import shardflow as sf
import shardflow.attention  # noqa: F401  (sf.attention: the attention primitive)
from shardflow.passes import solve
from shardflow.passes.propagate import Propagation
from shardflow.program import source_line
from shardflow.specs import B, Split


@pytest.mark.slow
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


@pytest.mark.slow
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
