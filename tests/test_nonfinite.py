"""NaN, ±inf and ±0 through every reduction and comparison on split dims: sharded
equals one device, NaN for NaN.

XLA's CPU all-reduce max drops NaN (pmax of [nan, 1] over two devices is 1), where jnp.max on
one device returns NaN; shardflow's cross-device max (``conversion._all_reduce``) carries it.
Hypothesis draws arrays from non-finite and signed-zero values (and -NaN, whose sign bit is
set), a mesh of one or two axes and a split of the array, per op. Finite values are small
binary fractions so that sums and products are exact in any order.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_tier import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax import lax
from jax.sharding import PartitionSpec as PS

import shardflow as sf

VALUES = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 3.0], np.float32)
assert np.signbit(VALUES[1])  # -NaN

SHAPE = (8, 8)
MESHES = {"1d": {"x": 8}, "2d": {"data": 2, "model": 4}}
SPECS = {
    "1d": [PS("x"), PS(None, "x")],
    "2d": [PS("data", "model"), PS("model", "data"), PS(("data", "model")), PS(None, ("data", "model"))],
}
CASES = [(m, s) for m in MESHES for s in SPECS[m]]

UNARY = {
    "max": jnp.max,
    "max0": lambda x: jnp.max(x, axis=0),
    "max1": lambda x: jnp.max(x, axis=1),
    "min": jnp.min,
    "min0": lambda x: jnp.min(x, axis=0),
    "max_of_neg1": lambda x: jnp.max(-x, axis=1),
    "nanmax0": lambda x: jnp.nanmax(x, axis=0),
    "argmax": jnp.argmax,
    "argmax0": lambda x: jnp.argmax(x, axis=0),
    "argmin1": lambda x: jnp.argmin(x, axis=1),
    "sum": jnp.sum,
    "sum0": lambda x: jnp.sum(x, axis=0),
    "prod1": lambda x: jnp.prod(x, axis=1),
    "cumsum0": lambda x: jnp.cumsum(x, axis=0),
    "cummax1": lambda x: lax.cummax(x, axis=1),
    "cummin0": lambda x: lax.cummin(x, axis=0),
    "sort0": lambda x: jnp.sort(x, axis=0),
    "sort1": lambda x: jnp.sort(x, axis=1),
    "top_k": lambda x: lax.top_k(x, 3),
    "max_gt": lambda x: jnp.max(x > 0.5, axis=0),
}
BINARY = {
    "eq": lambda x, y: x == y,
    "lt": lambda x, y: x < y,
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "where": lambda x, y: jnp.where(x < y, x, y),
    "max_of_maximum": lambda x, y: jnp.max(jnp.maximum(x, y), axis=0),
}
# bfloat16 too where the cross-device max/min or an ordering runs (sums stay float32: exact).
BF16 = {"max", "max0", "max1", "min", "max_of_neg1", "argmax0", "sort0", "maximum", "lt", "max_of_maximum"}

SETTINGS = settings(
    max_examples=examples(25),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@functools.cache
def parallelized(name, mesh_name, spec_index):
    fn = UNARY.get(name) or BINARY[name]
    spec = SPECS[mesh_name][spec_index]
    arity = 1 if name in UNARY else 2
    return sf.parallelize(fn, mesh=sf.make_mesh(MESHES[mesh_name]), in_specs=(spec,) * arity)


@functools.cache
def reference(name):
    return jax.jit(UNARY.get(name) or BINARY[name])


def arrays(n):
    """``n`` arrays of SHAPE drawn from VALUES (by index, keeping -NaN's sign)."""
    return st.tuples(*[hnp.arrays(np.int8, SHAPE, elements=st.integers(0, len(VALUES) - 1))] * n).map(
        lambda idx: tuple(VALUES[i] for i in idx)
    )


def check(name, dtype, case, xs):
    mesh_name, spec = case
    xs = tuple(jnp.asarray(x, dtype) for x in xs)
    got = parallelized(name, mesh_name, SPECS[mesh_name].index(spec))(*xs)
    want = reference(name)(*xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        if g.dtype == jnp.bfloat16:
            g, w = g.astype(np.float32), w.astype(np.float32)
        np.testing.assert_array_equal(
            g, w, err_msg=f"{name} {dtype.__name__} {mesh_name} {spec}\ninputs: {[np.asarray(x).tolist() for x in xs]}"
        )


def dtypes_of(name):
    return [jnp.float32, jnp.bfloat16] if name in BF16 else [jnp.float32]


@pytest.mark.parametrize("name", sorted(UNARY))
@SETTINGS
@given(data=st.data())
def test_reduction_on_split_dims_keeps_nonfinite(name, data):
    case = data.draw(st.sampled_from(CASES), label="mesh, spec")
    dtype = data.draw(st.sampled_from(dtypes_of(name)), label="dtype")
    check(name, dtype, case, data.draw(arrays(1), label="x"))


@pytest.mark.parametrize("name", sorted(BINARY))
@SETTINGS
@given(data=st.data())
def test_comparison_on_split_dims_keeps_nonfinite(name, data):
    case = data.draw(st.sampled_from(CASES), label="mesh, spec")
    dtype = data.draw(st.sampled_from(dtypes_of(name)), label="dtype")
    check(name, dtype, case, data.draw(arrays(2), label="x, y"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_max_over_devices_returns_nan(dtype):
    """One NaN on one device of a split dim; and ±0 / ±inf stay ordered."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    x[5, 1] = np.nan
    x[6, 2] = -np.nan
    x[:, 3] = -np.inf
    x[:, 4] = np.inf
    x[:, 5] = [-0.0, 0.0] * 4
    x[:, 6] = -0.0
    x = jnp.asarray(x, dtype)
    for fn in (jnp.max, lambda a: jnp.max(a, axis=0), lambda a: jnp.max(-a, axis=0)):
        par = sf.parallelize(fn, mesh=sf.make_mesh(MESHES["2d"]), in_specs=(PS("data", "model"),))
        got, want = np.asarray(par(x), np.float32), np.asarray(jax.jit(fn)(x), np.float32)
        np.testing.assert_array_equal(got, want)
        numbers = ~np.isnan(want)  # max(-0, +0) is +0 either way; a NaN's sign bit is not compared
        np.testing.assert_array_equal(np.signbit(got[numbers]), np.signbit(want[numbers]))
