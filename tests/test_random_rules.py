"""Random numbers under parallelize: each device generates its own slice of the bits
(threefry is counter based with jax_threefry_partitionable), bit-identical to one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow.rules import random as random_rules

MESH_2D = {"data": 2, "model": 4}
MESH_1D = {"x": 8}


def mesh(sizes):
    return sf.make_mesh(sizes)


def same(a, b):
    """Bit-identical leaves (key arrays compared by their data)."""

    def data(x):
        return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(data(x)), np.asarray(data(y))
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(
            x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" else x,
            y.view(f"u{y.dtype.itemsize}") if y.dtype.kind == "f" else y,
        )


def threefry_sizes(lowered_text):
    """Elements hashed by each threefry2x32 call of a lowered program (StableHLO)."""
    sizes = []
    for line in lowered_text.splitlines():
        m = re.search(r"call @threefry2x32\w*\(.*\) -> \(tensor<([0-9x]*?)x?ui32>", line)
        if m:
            sizes.append(int(np.prod([int(d) for d in m.group(1).split("x") if d] or [1])))
    return sizes


def dropout(key, x):
    keep = jax.random.bernoulli(key, 0.9, x.shape)
    return jnp.where(keep, x / 0.9, 0.0)


X_SPECS = [
    PS("data", "model"),
    PS("model", "data"),
    PS(None, ("data", "model")),
    PS(("model", "data"), None),
    PS("data", None),
    PS(None, "model"),
    PS(),
]


@pytest.mark.parametrize("spec", X_SPECS, ids=str)
def test_dropout_mask_equals_one_device(spec):
    key, x = jax.random.key(0), jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) + 1
    par = sf.parallelize(dropout, mesh=mesh(MESH_2D), in_specs=(PS(), spec), out_specs=spec)
    same(par(key, x), jax.jit(dropout)(key, x))
    assert par.explain(key, x).fallbacks == []


def test_dropout_mask_meets_its_activations_without_collectives():
    """The bits take the split of the value the mask is applied to (no all_to_all of the mask)."""
    key, x = jax.random.key(0), jnp.ones((8, 16))
    par = sf.parallelize(
        dropout, mesh=mesh(MESH_2D), in_specs=(PS(), PS("data", "model")), out_specs=PS("data", "model")
    )
    plan = par.explain(key, x)
    assert "0 collectives" in str(plan), plan


SAMPLERS = {
    "normal_f32": lambda k: jax.random.normal(k, (8, 4, 16)),
    "normal_bf16": lambda k: jax.random.normal(k, (8, 4, 16), jnp.bfloat16),  # 8-bit random bits
    "uniform_f16": lambda k: jax.random.uniform(k, (8, 4, 16), jnp.float16),  # 16-bit
    "randint": lambda k: jax.random.randint(k, (8, 4, 16), -5, 1000),
    "bits_u8": lambda k: jax.random.bits(k, (8, 4, 16), jnp.uint8),
    "bits_u32": lambda k: jax.random.bits(k, (8, 4, 16), jnp.uint32),
    "gumbel": lambda k: jax.random.gumbel(k, (8, 4, 16)),
    "vmapped_keys": lambda k: jax.vmap(lambda kk: jax.random.normal(kk, (4, 16)))(jax.random.split(k, 8)),
    "raw_uint32_key": lambda k: jax.random.normal(jax.random.key_data(k), (8, 4, 16)),
}
OUT_SPECS = [
    PS("data", None, "model"),
    PS("model", "data"),
    PS(None, None, ("data", "model")),
    PS(("data", "model")),
    PS(None, "data"),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", OUT_SPECS, ids=str)
@pytest.mark.parametrize("name", SAMPLERS)
def test_samples_equal_one_device(name, spec):
    fn, key = SAMPLERS[name], jax.random.key(7)
    par = sf.parallelize(fn, mesh=mesh(MESH_2D), in_specs=(PS(),), out_specs=spec)
    same(par(key), jax.jit(fn)(key))
    assert par.explain(key).fallbacks == []


def test_samples_on_one_axis_mesh_and_split_keys():
    """Keys split along their own dim (an argument), and bits split along a dim of the bits."""

    def fn(keys):
        return jax.vmap(lambda k: jax.random.uniform(k, (3, 16)))(keys)

    keys = jax.random.split(jax.random.key(3), 8)
    for in_spec, out_spec in [(PS("x"), PS("x")), (PS(), PS(None, None, "x")), (PS("x"), PS(None, None, "x"))]:
        par = sf.parallelize(fn, mesh=mesh(MESH_1D), in_specs=(in_spec,), out_specs=out_spec)
        same(par(keys), jax.jit(fn)(keys))


@pytest.mark.parametrize("sizes", [MESH_1D, MESH_2D], ids=["1d", "2d"])
def test_each_device_hashes_its_share(sizes):
    """The flop check: every threefry2x32 call of the local program hashes 1/n of the bits."""
    shape = (16, 64)
    n = int(np.prod(list(sizes.values())))
    axes = tuple(sizes)
    spec = PS(*axes) if len(axes) == 2 else PS(None, axes[0])
    fn = lambda k: jax.random.normal(k, shape)
    par = sf.parallelize(fn, mesh=mesh(sizes), in_specs=(PS(),), out_specs=spec)
    text = par.lower(jax.random.key(0)).as_text()
    assert threefry_sizes(text) == [16 * 64 // n], threefry_sizes(text)
    whole = threefry_sizes(jax.jit(fn).lower(jax.random.key(0)).as_text())
    assert whole == [16 * 64], whole


def test_not_partitionable_stays_whole_and_equal():
    """With jax_threefry_partitionable off (and for rbg keys) the bits come from a sequence that
    does not partition: every device generates them whole and keeps its block."""
    fn = lambda k: jax.random.normal(k, (8, 16))
    with jax.threefry_partitionable(False):
        key = jax.random.key(1)
        par = sf.parallelize(fn, mesh=mesh(MESH_2D), in_specs=(PS(),), out_specs=PS("data", "model"))
        same(par(key), jax.jit(fn)(key))
        whole = threefry_sizes(jax.jit(fn).lower(key).as_text())
        assert threefry_sizes(par.lower(key).as_text()) == whole and whole  # whole on every device
    key = jax.random.key(1, impl="rbg")
    par = sf.parallelize(fn, mesh=mesh(MESH_2D), in_specs=(PS(),), out_specs=PS("data", "model"))
    same(par(key), jax.jit(fn)(key))


def test_global_counters_past_2_32():
    """The uint64 row-major index as (hi, lo) uint32 words, for a shape of more than 2**32
    elements (no device holds one here: the counters of one small block are checked)."""
    whole, block = (5, 2**30, 3), (2, 4, 3)
    starts = (3, 2**30 - 4, 0)
    hi, lo = jax.jit(lambda s: random_rules._global_counters(whole, block, s))(tuple(jnp.int32(s) for s in starts))
    idx = np.indices(block).astype(np.uint64) + np.array(starts, np.uint64).reshape(3, 1, 1, 1)
    flat = idx[0] * np.uint64(whole[1] * whole[2]) + idx[1] * np.uint64(whole[2]) + idx[2]
    np.testing.assert_array_equal(np.asarray(hi), (flat >> np.uint64(32)).astype(np.uint32))
    np.testing.assert_array_equal(np.asarray(lo), (flat & np.uint64(0xFFFFFFFF)).astype(np.uint32))


def test_64_bit_random_bits():
    with jax.enable_x64(True):
        fn = lambda k: jax.random.bits(k, (8, 16), jnp.uint64)
        key = jax.random.key(5)
        par = sf.parallelize(fn, mesh=mesh(MESH_2D), in_specs=(PS(),), out_specs=PS("model", "data"))
        same(par(key), jax.jit(fn)(key))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        hidden = self.drop(jax.nn.relu(self.up(x)))
        return self.down(hidden), hidden


TENSOR_PARALLEL = {"up/kernel": PS(None, "model"), "up/bias": PS("model"), "down/kernel": PS("model", None)}


def test_nnx_dropout_runs_split_with_no_fallbacks():
    """A flax nnx.Dropout between tensor-parallel linears: no random_bits / bitcast fallback, the
    mask generated on each device's (batch, hidden) block, equal to one device."""
    graphdef, state = nnx.split(MLP(nnx.Rngs(0, dropout=1)))

    def fwd(state, x):
        m = nnx.merge(graphdef, state)
        return m(x), nnx.state(m)

    def spec(path, _):
        name = "/".join(str(getattr(p, "key", p)) for p in path[:2])
        return TENSOR_PARALLEL.get(name, PS())

    specs = jax.tree_util.tree_map_with_path(spec, state)
    x = jax.random.normal(jax.random.key(2), (8, 4, 16))
    par = sf.parallelize(
        fwd,
        mesh=mesh(MESH_2D),
        in_specs=(specs, PS("data")),
        out_specs=((PS("data"), PS("data", None, "model")), specs),
    )
    plan = par.explain(state, x)
    assert plan.fallbacks == [], plan.fallbacks
    (y, hidden), new_state = par(state, x)
    (y1, hidden1), new_state1 = jax.jit(fwd)(state, x)
    same(new_state, new_state1)
    # The dropout mask bit for bit; the values as close as a matmul of other block shapes gets.
    np.testing.assert_array_equal(hidden == 0, hidden1 == 0)
    np.testing.assert_allclose(hidden, hidden1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, y1, rtol=1e-5, atol=1e-6)
    sizes = threefry_sizes(par.lower(state, x).as_text())
    assert max(sizes) == 8 * 4 * 32 // 8, sizes  # the mask: 1/8 of (8, 4, 32) on each device
    assert not any(kind == "all_to_all" for kind in re.findall(r"^(\w+)", str(plan), re.M))
