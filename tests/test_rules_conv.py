"""Convolutions, pooling and their gradients, and dynamic_slice / dynamic_update_slice / pad on
a split dim (shardflow/rules/conv.py, shardflow/rules/indexing.py): each against one device, with
no fallback for these primitives and bytes in line with what the strategy needs."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow import hlo

MESHES = {"8": {"data": 8}, "2x4": {"data": 2, "model": 4}}
OURS = ("conv_general_dilated", "reduce_window", "select_and", "pad", "dynamic_slice", "dynamic_update_slice")


def rand(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def close(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        e = np.asarray(e)
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        np.testing.assert_allclose(np.asarray(a), e, rtol=1e-4, atol=2e-5 * scale)


def check(fn, args, in_specs, mesh, out_specs=None, more=()):
    """Runs ``fn`` parallelized on ``args`` (and each of ``more``, same shapes); asserts it equals
    one device and ran none of ours whole; returns the plan."""
    f = sf.parallelize(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    for a in (args,) + tuple(more):
        close(f(*a), jax.jit(fn)(*a))
    plan = f.explain(*args)
    ours = [(p, s) for p, s in plan.fallbacks if p.startswith(OURS)]
    assert not ours, ours
    return plan


def axes(mesh):
    """(batch axes, channel axis): channel-parallel work takes the last axis, the batch the rest."""
    names = tuple(mesh.axis_names)
    return (names[:-1] or None), names[-1]


def value_and_grads(fn, argnums):
    def loss(*args):
        out = fn(*args)
        return jnp.sum(out * jnp.cos(out))

    return jax.value_and_grad(loss, argnums=argnums)


# ------------------------------------------------------------------------------ convolutions


def case_linen_conv_2d(mesh):
    """flax.linen.Conv NHWC, stride 2, SAME; data parallel: weight gradient P, one all-reduce."""
    conv = nn.Conv(8, (3, 3), strides=2, padding="SAME")
    x = rand(0, 8, 8, 8, 4)
    params = conv.init(jax.random.key(0), x)
    fn = value_and_grads(conv.apply, (0, 1))
    return fn, (params, x), (PS(), PS(mesh.axis_names))


def case_nnx_conv_1d_grouped(mesh, argnums=0):
    """nnx.Conv 1-D, feature_group_count=4, VALID; channel parallel: x on C, kernel on O. The
    weight gradient is a conv with batch_group_count=4."""
    model = nnx.Conv(8, 16, (3,), feature_group_count=4, padding="VALID", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    batch, ch = axes(mesh)

    def fn(state, x):
        return nnx.merge(graphdef, state)(x)

    specs = jax.tree.map(lambda v: PS(None, None, ch) if v.ndim == 3 else PS(ch), state)
    return value_and_grads(fn, argnums), (state, rand(1, 8, 12, 8)), (specs, PS(batch, None, ch))


def case_nnx_conv_2d_dp(mesh, argnums=0):
    """nnx.Conv 2-D with stride and feature groups, batch split over every axis."""
    model = nnx.Conv(4, 8, (3, 3), strides=(2, 1), feature_group_count=2, padding="SAME", rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)

    def fn(state, x):
        return nnx.merge(graphdef, state)(x)

    return value_and_grads(fn, argnums), (state, rand(2, 8, 6, 6, 4)), (PS(), PS(mesh.axis_names))


def case_depthwise_nch(mesh):
    """Depthwise conv (NCH / OIH), channel parallel: the weight gradient is batch_group_count=C."""
    x, w = rand(3, 4, 16, 10), rand(4, 16, 1, 3)

    def fn(x, w):
        return lax.conv_general_dilated(
            x, w, (1,), ((1, 1),), dimension_numbers=("NCH", "OIH", "NCH"), feature_group_count=16
        )

    batch, ch = axes(mesh)
    return value_and_grads(fn, (0, 1)), (x, w), (PS(batch, ch), PS(ch))


def case_input_feature_nchw(mesh):
    """NCHW / OIHW with rhs dilation, lhs split on C and the kernel on I: the result is P."""
    x, w = rand(4, 2, 16, 7, 7), rand(5, 8, 16, 2, 2)

    def fn(x, w):
        return lax.conv_general_dilated(
            x, w, (1, 1), "VALID", rhs_dilation=(2, 1), dimension_numbers=("NCHW", "OIHW", "NCHW")
        )

    names = mesh.axis_names
    return value_and_grads(fn, (0, 1)), (x, w), (PS(None, names), PS(None, names))


def case_batch_group(mesh):
    """A conv with batch_group_count=4 itself: lhs batch groups split with the kernel's O."""
    x, w = rand(5, 16, 6, 3), rand(5, 3, 3, 8)  # N=16 (4 groups), C=3 ; O=8

    def fn(x, w):
        return lax.conv_general_dilated(
            x, w, (1,), "SAME", dimension_numbers=("NHC", "HIO", "NHC"), batch_group_count=4
        )

    _, ch = axes(mesh)
    return fn, (x, w), (PS(ch), PS(None, None, ch))


def case_patchify(mesh):
    """A patch embedding (kernel == stride) split on the image height: no halo, no gather."""
    x, w = rand(6, 2, 32, 4, 3), rand(7, 4, 4, 3, 8)

    def fn(x, w):
        return lax.conv_general_dilated(x, w, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    return value_and_grads(fn, (0, 1)), (x, w), (PS(None, mesh.axis_names), PS())


CONV_CASES = {
    f.__name__[5:]: f
    for f in (
        case_linen_conv_2d,
        case_nnx_conv_1d_grouped,
        case_nnx_conv_2d_dp,
        case_depthwise_nch,
        case_input_feature_nchw,
        case_batch_group,
        case_patchify,
    )
}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv(case, mesh_name):
    mesh = sf.make_mesh(MESHES[mesh_name])
    fn, args, in_specs = CONV_CASES[case](mesh)
    plan = check(fn, args, in_specs, mesh)
    if case == "patchify":  # the image is split on H end to end: only the weight gradient moves
        w_bytes = 4 * 4 * 3 * 8 * 4
        assert plan.total_bytes <= 2 * w_bytes + 64, str(plan)
    if case == "linen_conv_2d":  # dp: the gradients' all-reduce and the loss, nothing else
        assert all(c.kind == "all_reduce" for c in plan.collectives), str(plan)


def test_grouped_conv_rejects_split_groups():
    """2 groups on 8 devices: the groups signature would split a group, so propagation chooses
    again without it; it runs correctly anyway."""
    x, w = rand(7, 4, 6, 16), rand(8, 3, 8, 16)

    def fn(x, w):
        return lax.conv_general_dilated(
            x, w, (1,), "SAME", dimension_numbers=("NHC", "HIO", "NHC"), feature_group_count=2
        )

    mesh = sf.make_mesh({"data": 8})
    check(value_and_grads(fn, 1), (x, w), (PS(None, None, "data"), PS(None, None, "data")), mesh)


@pytest.mark.parametrize("case", ("nnx_conv_1d_grouped", "nnx_conv_2d_dp"))
def test_grouped_conv_input_gradient(case):
    mesh = sf.make_mesh(MESHES["2x4"])
    fn, args, in_specs = CONV_CASES[case](mesh, argnums=(0, 1))
    check(fn, args, in_specs, mesh)


# ------------------------------------------------------------------------------ pooling


def case_max_pool(mesh):
    batch, ch = axes(mesh)
    fn = value_and_grads(lambda x: nnx.max_pool(x, (2, 2), strides=(2, 2)), 0)
    return fn, (rand(8, 4, 8, 8, 8),), (PS(batch, None, None, ch),)


def case_max_pool_same_overlapping(mesh):
    fn = value_and_grads(lambda x: nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME"), 0)
    return fn, (rand(9, 8, 7, 7, 4),), (PS(mesh.axis_names),)


def case_max_pool_height(mesh):
    """Non-overlapping windows split on the pooled dim itself."""
    fn = value_and_grads(lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)), 0)
    return fn, (rand(10, 2, 16, 6, 3),), (PS(None, mesh.axis_names),)


def case_avg_pool(mesh):
    batch, ch = axes(mesh)
    fn = value_and_grads(lambda x: nnx.avg_pool(x, (2, 2), strides=(2, 2)), 0)
    return fn, (rand(11, 4, 6, 6, 8),), (PS(batch, None, None, ch),)


def case_avg_pool_1d_same(mesh):
    fn = value_and_grads(lambda x: nn.avg_pool(x, (3,), strides=(1,), padding="SAME"), 0)
    return fn, (rand(12, 8, 9, 2),), (PS(mesh.axis_names),)


def case_reduce_window_generic(mesh):
    def fn(x):
        return lax.reduce_window(x, 1.0, lax.mul, (1, 2, 1), (1, 2, 1), "VALID")

    return fn, (rand(13, 8, 6, 4),), (PS(mesh.axis_names),)


def case_reduce_window_min(mesh):
    def fn(x):
        return lax.reduce_window(x, jnp.inf, lax.min, (1, 3, 1), (1, 1, 1), "SAME")

    return fn, (rand(14, 8, 6, 4),), (PS(mesh.axis_names),)


POOL_CASES = {
    f.__name__[5:]: f
    for f in (
        case_max_pool,
        case_max_pool_same_overlapping,
        case_max_pool_height,
        case_avg_pool,
        case_avg_pool_1d_same,
        case_reduce_window_generic,
        case_reduce_window_min,
    )
}


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_pool(case, mesh_name):
    mesh = sf.make_mesh(MESHES[mesh_name])
    fn, args, in_specs = POOL_CASES[case](mesh)
    plan = check(fn, args, in_specs, mesh)
    # batch / channels (and the non-overlapping height) stay split: only the loss is reduced
    assert all(c.kind == "all_reduce" and not c.shape for c in plan.collectives), str(plan)


# ------------------------------------------------------------------------------ slicing a split dim


def test_dynamic_slice_offset():
    """A small dynamic slice of a dim split 8 ways: each device contributes its part (P, reduced)
    instead of gathering the table or moving it whole to another split (all_to_all)."""
    mesh = sf.make_mesh({"data": 8})
    table = rand(15, 256, 16)

    def fn(table, i):
        return jnp.sin(lax.dynamic_slice_in_dim(table, i, 4, axis=0))

    starts = [(table, jnp.int32(i)) for i in (-3, 0, 30, 32, 60, 254, 300)]  # block edges, clamped
    plan = check(fn, (table, jnp.int32(29)), (PS("data"), PS()), mesh, more=starts)
    all_to_all = 7 / 8 * table.size * 4 / 8
    assert plan.total_bytes < all_to_all / 2, str(plan)


def test_dynamic_slice_offset_2d():
    mesh = sf.make_mesh({"data": 2, "model": 4})
    x = rand(16, 8, 32, 16)

    def fn(x, i, j):
        return lax.dynamic_slice(x, (0, i, j), (8, 5, 3)) * 2.0

    more = [(x, jnp.int32(i), jnp.int32(j)) for i, j in ((0, 0), (30, 15), (-1, 4))]
    plan = check(fn, (x, jnp.int32(7), jnp.int32(13)), (PS("data", "model", None), PS(), PS()), mesh, more=more)
    assert plan.total_bytes < 3 / 4 * x.size * 4 / 2 / 4, str(plan)


def test_dynamic_update_slice_offset():
    """Writing a small update into a dim split 8 ways: each device writes the part in its block."""
    mesh = sf.make_mesh({"data": 8})
    cache, upd = rand(17, 64, 16), rand(18, 5, 16)

    def fn(cache, upd, i):
        return lax.dynamic_update_slice_in_dim(cache, upd, i, axis=0) + 1.0

    more = [(cache, upd, jnp.int32(i)) for i in (-2, 0, 6, 8, 62)]
    plan = check(fn, (cache, upd, jnp.int32(29)), (PS("data"), PS(), PS()), mesh, out_specs=PS("data"), more=more)
    assert plan.total_bytes == 0, str(plan)


def test_pad_interior_split():
    """Interior padding with lo + hi == interior keeps every block in place: no gather."""
    mesh = sf.make_mesh({"data": 2, "model": 4})
    x = rand(19, 16, 8)

    def fn(x):
        return lax.pad(x, 0.5, ((1, 1, 2), (0, 0, 0))) * 3.0

    plan = check(fn, (x,), (PS(("data", "model")),), mesh, out_specs=PS(("data", "model")))
    assert plan.total_bytes == 0, str(plan)


def test_dynamic_slice_of_partial():
    """dynamic_slice is linear in its operand: a partial product is sliced, then the slice reduced."""
    mesh = sf.make_mesh({"data": 8})
    x, z = rand(20, 256, 32), rand(21, 256, 64)

    def fn(x, z, i):
        return lax.dynamic_slice_in_dim(x.T @ z, i, 4, axis=0)

    plan = check(fn, (x, z, jnp.int32(9)), (PS("data"), PS("data"), PS()), mesh)
    assert plan.total_bytes <= 2 * 7 / 8 * 4 * 64 * 4, str(plan)


# ------------------------------------------------------------------------------ a CNN train step


class CNN(nn.Module):
    c1: int = 8
    c2: int = 16

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(self.c1, (3, 3), padding="SAME")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(self.c2, (3, 3), padding="SAME")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(8)(x)


def cnn_step(batch=16, hw=8, c1=8, c2=16):
    model, tx = CNN(c1, c2), optax.sgd(0.1, momentum=0.9)
    x, y = rand(22, batch, hw, hw, 3), jnp.asarray(np.arange(batch) % 8)
    params = model.init(jax.random.key(0), x)
    opt = tx.init(params)

    def step(params, opt, x, y):
        def loss(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    return step, (params, opt, x, y)


def cnn_specs(strategy, mesh, args):
    params, opt, x, y = args
    names = tuple(mesh.axis_names)
    n = mesh.devices.size
    batch, ch = axes(mesh)

    def param_spec(leaf):
        if strategy == "fsdp":  # each parameter split on its last dim that divides
            dims = [d for d in reversed(range(leaf.ndim)) if leaf.shape[d] % n == 0]
            return PS(*([None] * dims[0] + [names])) if dims else PS()
        if strategy == "tp" and leaf.ndim == 4:  # conv kernels: output channels
            return PS(None, None, None, ch)
        return PS()

    batch_axes = names if strategy in ("dp", "fsdp") else batch
    p_specs, o_specs = jax.tree.map(param_spec, params), jax.tree.map(param_spec, opt)
    return (p_specs, o_specs, PS(batch_axes), PS(batch_axes)), (p_specs, o_specs, PS())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ("dp", "fsdp", "tp"))
def test_cnn_train_step(strategy, capsys):
    """A conv / max-pool / conv / avg-pool / dense step with optax SGD + momentum. dp: the
    gradients' all-reduce and nothing else. fsdp and tp are compared to GSPMD in a print only
    (fsdp is about 2x GSPMD here: propagation charges an operand already at its demand for the
    demand of the converted copy, and picks gathering activations over gathering a kernel)."""
    mesh = sf.make_mesh(MESHES["2x4"])
    step, args = cnn_step()
    in_specs, out_specs = cnn_specs(strategy, mesh, args)
    plan = check(step, args, in_specs, mesh, out_specs=out_specs)
    param_bytes = sum(p.size * 4 for p in jax.tree.leaves(args[0]))
    n = mesh.devices.size
    shardings = functools.partial(jax.tree.map, lambda s: NamedSharding(mesh, s), is_leaf=lambda s: isinstance(s, PS))
    gspmd = jax.jit(step, in_shardings=shardings(in_specs), out_shardings=shardings(out_specs))
    gspmd_bytes = hlo.total_bytes(gspmd.lower(*args).compile().as_text(), weighted=True)
    with capsys.disabled():
        print(
            f"\nCNN step {strategy} on {dict(MESHES['2x4'])}: shardflow {plan.total_bytes:,} bytes, "
            f"GSPMD {gspmd_bytes:,} bytes, param bytes {param_bytes:,}"
        )
    if strategy == "dp":
        assert plan.total_bytes <= 2 * (n - 1) / n * param_bytes + 256, str(plan)
