"""passes.cse: each computation once, what nothing reads dropped, the values unchanged."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow import passes
from shardflow.passes.cse import cse
from shardflow.passes.inline import inline
from shardflow.program import Program, all_eqns


@pytest.fixture
def mesh():
    return sf.make_mesh({"x": 2, "y": 4})


def _program(fn, *args) -> Program:
    closed = jax.make_jaxpr(fn)(*args)
    return inline(Program(jaxpr=closed, mesh=None, in_sbp=(), out_sbp=()))


def _counts(program: Program) -> collections.Counter:
    return collections.Counter(eqn.primitive.name for eqn in program.jaxpr.jaxpr.eqns)


def _same_values(before: Program, after: Program, *args):
    got = jax.core.eval_jaxpr(after.jaxpr.jaxpr, after.jaxpr.consts, *args)
    want = jax.core.eval_jaxpr(before.jaxpr.jaxpr, before.jaxpr.consts, *args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_two_norms_of_the_gradients_square_and_sum_each_once():
    """optax clips by the gradients' global norm and the step logs it again: each norm squares
    every gradient's real part and its imaginary part (a broadcast zero, made once per norm)
    and sums them. One square of each part and one sum per gradient are left. A zero and its
    square are made again where read, not shared: two gradients of one shape each add their
    own (one value, it would be laid out for the first gradient and converted for the other)."""
    grads = {
        "a": np.arange(12.0, dtype=np.float32).reshape(3, 4),
        "b": np.ones((5,), np.float32),
        "c": np.ones((3, 4), np.float32),
    }

    def fn(g):
        return optax.tree.norm(g), optax.tree.norm(g) * 2.0

    before = _program(fn, grads)
    after = cse(before)
    assert _counts(before)["reduce_sum"] == 6 and _counts(before)["square"] == 12
    assert _counts(after)["reduce_sum"] == 3 and _counts(after)["square"] == 6
    assert _counts(after)["broadcast_in_dim"] == 3
    zeros_squared = [
        eqn.invars[1]
        for eqn in after.jaxpr.jaxpr.eqns
        if eqn.primitive.name == "add" and len(eqn.outvars[0].aval.shape) > 0
    ]
    assert len(zeros_squared) == len(set(zeros_squared)) == 3
    _same_values(before, after, *jax.tree.leaves(grads))


def test_expansions_are_made_where_read_and_nothing_read_is_kept():
    """Two equal broadcasts both read stay two equations; a constant computed twice from the
    same operands (a RoPE table's cosine) is one; a value nothing reads goes, an effect stays."""

    def fn(x):
        unused = jnp.sin(x)  # noqa: F841 (dropped)
        jax.debug.callback(lambda: None)  # an effect: kept
        t = jnp.arange(6, dtype=jnp.float32)
        return x + jnp.zeros_like(x) + jnp.cos(t), x * jnp.zeros_like(x) * jnp.cos(t)

    x = np.arange(6.0, dtype=np.float32)
    before = _program(fn, x)
    after = cse(before)
    assert _counts(after)["broadcast_in_dim"] == 2
    assert (_counts(before)["cos"], _counts(after)["cos"]) == (2, 1)
    assert _counts(after)["sin"] == 0 and _counts(after)["debug_callback"] == 1
    _same_values(before, after, x)


def _count(program, name):
    return sum(e.primitive.name == name for e in all_eqns(program.jaxpr.jaxpr))


def test_a_computation_repeated_runs_once(mesh):
    """Two global norms of the same gradients (optax's clip and a logged norm): each gradient
    squared and summed once, the broadcasts of constants made again where used, and the
    program's values those of the program as written. Inside a loop body alike. Through
    sf.parallelize on a mesh, with the planner after it."""

    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        norm = jnp.sqrt(jnp.sum(g**2))
        clipped = g * jnp.minimum(1.0, 1.0 / norm)
        logged = jnp.sqrt(jnp.sum(g**2))
        ones = jnp.ones_like(w) + jnp.ones_like(w) * logged

        def body(c, _):
            return c + jnp.sin(c) * jnp.sin(c), None

        looped, _ = jax.lax.scan(body, clipped, None, length=3)
        return looped + ones, logged

    w = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    f = sf.parallelize(step, mesh=mesh, in_specs=(PS(None, "y"), PS("x")))
    jaxpr = jax.make_jaxpr(step)(w, x)
    program = f.program(w, x)
    # the loss's square and g's twice; left: g's once (the loss itself nothing reads: grad)
    written = sum(e.primitive.name == "integer_pow" for e in jaxpr.eqns)
    assert (written, _count(program, "integer_pow")) == (3, 1)
    assert _count(program, "sin") == 1
    assert _count(program, "broadcast_in_dim") >= 2  # the two ones_like: made where used
    for got, want in zip(f(w, x), jax.jit(step)(w, x)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_cse_is_in_both_pass_lists():
    for pass_list in (passes.DEFAULT, passes.SOLVER):
        assert [p.name for p in pass_list][:2] == ["inline", "cse"]
