"""A loop-like primitive shardflow has never seen, registered by its region alone: greedy, the
solver, explain and lowering handle it through ``Rule.region`` without knowing it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.core import ShapedArray
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow import registry
from shardflow.registry import Loop

TIMES = 3

# ``repeat``: a scan under another name and other params — consts and carries first, then the
# stacked inputs; runs ``body`` ``times`` times, returns the carries and the stacked outputs.
repeat_p = Primitive("toy_repeat")
repeat_p.multiple_results = True


def _repeat_impl(*args, body: ClosedJaxpr, n_consts: int, n_carries: int, times: int):
    consts, init, xs = args[:n_consts], args[n_consts : n_consts + n_carries], args[n_consts + n_carries :]

    def trip(carry, x):
        out = jaxpr_as_fun(body)(*consts, *carry, *x)
        return tuple(out[:n_carries]), tuple(out[n_carries:])

    carry, ys = jax.lax.scan(trip, tuple(init), tuple(xs), length=times)
    return [*carry, *ys]


def _repeat_abstract_eval(*avals, body: ClosedJaxpr, n_consts: int, n_carries: int, times: int):
    outs = body.out_avals
    return [*outs[:n_carries], *(ShapedArray((times, *a.shape), a.dtype) for a in outs[n_carries:])]


repeat_p.def_impl(_repeat_impl)
repeat_p.def_abstract_eval(_repeat_abstract_eval)
mlir.register_lowering(repeat_p, mlir.lower_fun(_repeat_impl, multiple_results=True))

# The whole registration: which operands are consts, carries and stacked inputs, and the trips.
registry.defrule(
    repeat_p, region=lambda eqn: Loop(eqn.params["n_consts"], eqn.params["n_carries"], eqn.params["times"], "body")
)


def repeat(fn, consts, init, xs):
    """``fn(consts, carry, x) -> (carry, y)`` over the leading dim of ``xs``, as ``toy_repeat``."""
    avals = [jax.typeof(a) for a in (*consts, *init)] + [ShapedArray(x.shape[1:], x.dtype) for x in xs]
    nc, nk = len(consts), len(init)

    def flat(*args):
        carry, y = fn(args[:nc], args[nc : nc + nk], args[nc + nk :])
        return [*carry, *y]

    body = jax.make_jaxpr(flat)(*avals)
    out = repeat_p.bind(*consts, *init, *xs, body=body, n_consts=nc, n_carries=nk, times=xs[0].shape[0])
    return out[:nk], out[nk:]


def layers(ws, x, scale):
    """Each layer: h <- tanh(h @ w) * scale; the outputs: the last h and every layer's h."""
    (h,), (hs,) = repeat(lambda c, k, w: ((jnp.tanh(k[0] @ w[0]) * c[0],), (k[0] @ w[0],)), (scale,), (x,), (ws,))
    return h, hs


ARGS = (
    np.random.default_rng(0).standard_normal((TIMES, 16, 16), np.float32) / 4,
    np.random.default_rng(1).standard_normal((8, 16), np.float32),
    np.float32(0.5),
)
SPECS = (PS(None, None, "model"), PS("data"), PS())


@pytest.fixture(scope="module")
def mesh():
    return sf.make_mesh({"data": 2, "model": 4})


def _run(mesh, passes):
    step = sf.parallelize(layers, mesh=mesh, in_specs=SPECS, passes=passes)
    h, hs = step(*ARGS)
    want_h, want_hs = jax.jit(layers)(*ARGS)
    np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(hs), np.asarray(want_hs), rtol=1e-5, atol=1e-6)
    plan = step.explain(*ARGS)
    assert not plan.fallbacks
    assert plan.loop_bytes > 0  # what the loop holds across the step: its stacked outputs
    return plan


def test_greedy_plans_a_loop_registered_by_its_region_and_explain_counts_its_trips(mesh):
    plan = _run(mesh, sf.passes.DEFAULT)
    assert plan.planner == "greedy"
    # the weights split by columns, the carry wanted whole: gathered inside the body, once a trip
    assert any(c.count == TIMES for c in plan.collectives), str(plan)


def test_the_solver_plans_a_loop_registered_by_its_region_with_its_body(mesh):
    plan = _run(mesh, sf.passes.SOLVER)
    assert plan.planner.startswith("solver (optimal") and "greedy" not in plan.planner, plan.planner
    assert plan.modelled_seconds <= _run(mesh, sf.passes.DEFAULT).modelled_seconds
