"""The grouped-GEMM kernels (kernels/grouped_matmul_mgpu.py): their tile-aligned layout, on CPU
with a reference per-tile matmul standing in for the kernels, equals jax.lax.ragged_dot
through the routed experts' SwiGLU and its gradients; the kernels lower for CUDA; on a Hopper
GPU (-m gpu) they equal ragged_dot."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_tier import examples
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardflow import experts_primitives
from shardflow.experts import routed_experts
from shardflow.kernels import grouped_matmul_mgpu as mgpu


def per_tile_matmul(lhs, rhs, tile_groups, group_tiles):
    """What gmm computes: each BLOCK_M-row tile of lhs by its group's matrix."""
    tiles = lhs.reshape(-1, mgpu.BLOCK_M, lhs.shape[1])
    return jnp.einsum("tmk,tkn->tmn", tiles, rhs[tile_groups]).reshape(lhs.shape[0], -1)


def per_tile_grads(lhs, rhs, dout, tile_groups, group_tiles):
    return jax.vjp(lambda lhs, rhs: per_tile_matmul(lhs, rhs, tile_groups, group_tiles), lhs, rhs)[1](dout)


def routed(rows, ids, repeats, weights, kernels: bool, keep: bool = False):
    """sorted_ffn, and its gradients by sorted_ffn_grads (the primitives' backward: from the
    forward's activations where ``keep``, else recomputing them), by our kernels' path (its
    GEMMs the per-tile reference on CPU) or by ragged_dot: the loss sum(out ** 2) / 2 and its
    gradients."""
    with pytest.MonkeyPatch.context() as patch:
        if not mgpu.on_hopper():
            patch.setattr(mgpu, "gmm", per_tile_matmul)
            patch.setattr(mgpu, "gmm_grads", per_tile_grads)
        patch.setattr(mgpu, "supports", lambda *_: kernels)

        def loss_and_grads(rows, *weights):
            out = experts_primitives.sorted_ffn(rows, ids, *weights, repeats=repeats, keep_activations=keep)
            out, activations = out if keep else (out, None)
            grads = experts_primitives.sorted_ffn_grads(rows, ids, *weights, out, activations, repeats)
            return jnp.sum(out.astype(jnp.float32) ** 2) / 2, grads

        return jax.jit(loss_and_grads)(rows, *weights)


def per_choice(rows, ids, repeats, weights):
    """The same computed choice by choice: row i // repeats through expert ids[i]'s own
    matrices (zeros for an id of no expert)."""

    def loss(rows, w_gate, w_up, w_down):
        n_experts = w_gate.shape[0]
        mine = ids < n_experts
        pick = [w[jnp.minimum(ids, n_experts - 1)] for w in (w_gate, w_up, w_down)]
        x = jnp.repeat(rows, repeats, axis=0)
        h = jax.nn.silu(jnp.einsum("md,mdf->mf", x, pick[0])) * jnp.einsum("md,mdf->mf", x, pick[1])
        out = jnp.einsum("mf,mfd->md", h, pick[2]) * mine[:, None]
        return jnp.sum(out**2) / 2  # a sum of squares: no cancellation to magnify float32 order

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(rows, *weights)


def choices(seed, sizes, extra, repeats):
    """Expert ids for the given group sizes plus at least ``extra`` out-of-range ones (as many
    as make the count a multiple of ``repeats``), shuffled."""
    r = np.random.default_rng(seed)
    n = sum(sizes) + extra
    ids = np.concatenate([np.repeat(np.arange(len(sizes)), sizes), np.full(extra - n % -repeats, len(sizes))])
    return jnp.asarray(r.permutation(ids), jnp.int32)


@settings(max_examples=examples(10), deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=5),
    extra=st.integers(0, 3),
    repeats=st.integers(1, 3),
    seed=st.integers(0, 99),
)
@example(sizes=[0, 300], extra=0, repeats=1, seed=3)
def test_tile_aligned_layout_computes_what_ragged_dot_computes(sizes, extra, repeats, seed):
    """Groups of any size (empty ones, one row, several tiles), choices of no local expert, each
    row read by ``repeats`` choices: the layout puts each group from a tile boundary and brings
    every choice's result home, forward and backward (from the forward's activations or
    recomputing them), as ragged_dot does and as computing each choice on its own does."""
    r = np.random.default_rng(seed)
    ids = choices(seed, sizes, extra, repeats)
    rows = jnp.asarray(r.normal(size=(max(1, ids.shape[0] // repeats), 8)), jnp.float32)
    ids = ids if ids.shape[0] else jnp.full(repeats, len(sizes), jnp.int32)
    weights = [jnp.asarray(r.normal(size=s), jnp.float32) for s in ((len(sizes), 8, 4),) * 2 + ((len(sizes), 4, 8),)]
    want = per_choice(rows, ids, repeats, weights)
    for kernels, keep in itertools.product((True, False), (True, False)):
        got = routed(rows, ids, repeats, weights, kernels, keep)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # float32 sums in another order
            assert np.linalg.norm(np.asarray(a) - b) <= 1e-5 * (1 + np.linalg.norm(b))


@pytest.fixture(params=list(mgpu.VARIANTS))
def variant(request, monkeypatch):
    preferred, block_k = mgpu.VARIANTS[request.param]
    monkeypatch.setattr(mgpu, "PREFERRED", preferred)
    monkeypatch.setattr(mgpu, "WEIGHT_GRAD_BLOCK_K", block_k)
    return request.param


def test_kernels_lower_for_cuda(variant):
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    m, k, n, groups = 1024, 256, 512, 4
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16)
    dout = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    tile_groups = jax.ShapeDtypeStruct((m // mgpu.BLOCK_M,), jnp.int32)
    group_tiles = jax.ShapeDtypeStruct((groups + 1,), jnp.int32)
    for fn, args in (
        (mgpu.grouped_matmul, (lhs, rhs, tile_groups)),
        (functools.partial(mgpu.grouped_matmul, transpose_rhs=True), (dout, rhs, tile_groups)),
        (mgpu.grouped_weight_grad, (lhs, dout, group_tiles)),
    ):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[512, 512, 512, 512], [0, 1000, 37, 1011]])
def test_kernels_equal_ragged_dot_on_hopper(sizes, variant):
    if not mgpu.on_hopper():
        pytest.skip("the Mosaic GPU grouped GEMMs need a Hopper GPU")
    r = np.random.default_rng(0)
    ids = choices(0, sizes, 5, repeats=2)
    rows = jnp.asarray(r.normal(size=(ids.shape[0] // 2, 256)), jnp.bfloat16)
    shapes = ((4, 256, 512), (4, 256, 512), (4, 512, 256))
    weights = [jnp.asarray(r.normal(size=s) * 0.05, jnp.bfloat16) for s in shapes]
    assert all(mgpu.supports(rows, w) for w in weights)
    for keep in (True, False):
        got, want = (routed(rows, ids, 2, weights, kernels, keep) for kernels in (True, False))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


@pytest.mark.gpu
def test_the_compiled_kernels_hold_no_dense_experts_by_rows_buffer():
    """Forward and backward of the routed experts by our kernels on Hopper: no buffer of
    n_experts x rows x ffn elements (what a grouped GEMM expanded into masked dense GEMMs holds)."""
    if not mgpu.on_hopper():
        pytest.skip("the Mosaic GPU grouped GEMMs need a Hopper GPU")
    import re

    rows, d, f, n_experts = 4096, 256, 512, 8
    ids = jnp.arange(rows, dtype=jnp.int32) % n_experts
    args = [jax.ShapeDtypeStruct((rows, d), jnp.bfloat16)]
    args += [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((n_experts, d, f),) * 2 + ((n_experts, f, d),)]

    def loss(rows, *weights):
        h = routed_experts(rows, ids[:, None], *weights, keep_activations=True)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(*args).compile().as_text()
    sizes = [np.prod([int(n) for n in dims.split(",")]) for dims in re.findall(r"\[([0-9,]+)\]", text) if dims]
    assert max(sizes) < n_experts * rows * f, max(sizes)
