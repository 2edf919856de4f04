"""Grouped GEMMs for mixture-of-experts on Hopper, in Pallas with the Mosaic GPU lowering.

The rows come in a *tile-aligned* layout: sorted by group, each group's rows starting at a
multiple of ``BLOCK_M`` and the gap to the next group zero-filled (``tile_layout`` builds it;
MegaBlocks pads its blocks the same way). Then every ``BLOCK_M``-row tile belongs to one group,
and each kernel is a plain tiled GEMM that looks up its tile's group — no masked loads or
stores, no tile computed twice at a boundary; the zero rows cost at most ``BLOCK_M - 1`` rows
of work per group. Three kernels, the forward and both gradients of ``out = lhs @ rhs[group]``:

* ``grouped_matmul(lhs [M, K], rhs [G, K, N])``: out [M, N], K streamed through shared memory
  by TMA, wgmma into register accumulators. Two forms (``Tiling``): one CTA per (tile, N block),
  one warpgroup loading and computing; or persistent and warp-specialized, as Hopper GEMMs
  reach their peak: one CTA per SM walks the (tile, N block) grid in a snake (neighbouring CTAs
  share blocks of rhs in L2), a producer warpgroup issues the TMA loads and two consumer
  warpgroups each accumulate half of the CTA's tile (split along M or N), the output store
  overlapping the next tile's loads;
* ``grouped_matmul(dout, rhs, transpose_rhs=True)``: d lhs = dout @ rhs[group]^T, the same
  kernel reading rhs's blocks transposed;
* ``grouped_weight_grad(lhs [M, K], dout [M, N])``: d rhs [G, K, N], one CTA per (group, K
  block, N block) summing lhs^T dout over the group's tiles (an empty group's is zero).

Mosaic GPU has no interpret mode: ``benchmarks/moe.py --check`` tests the kernels on the GPU
against ``jax.lax.ragged_dot``; on CPU the tests lower them for CUDA.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import on_hopper

BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 64
MAX_CONCURRENT_STEPS = 4


class Tiling(NamedTuple):
    """How ``grouped_matmul`` runs. ``warp_specialized=False``: one CTA per (BLOCK_M tile,
    BLOCK_N block); the other fields are ignored. ``True``: persistent, two consumer
    warpgroups of ``tile_m`` x ``tile_n`` each, side by side along ``split`` ("m" or "n": a
    CTA covers BLOCK_M rows, so tile_m is BLOCK_M / 2 under "m" and BLOCK_M under "n"),
    ``steps`` blocks of K in flight, the grid walked in snake bands ``band`` tiles wide."""

    warp_specialized: bool = False
    tile_m: int = 64
    tile_n: int = 128
    split: str = "m"
    steps: int = 4
    band: int = 8

    def cta_n(self) -> int:
        return self.tile_n * (2 if self.split == "n" else 1) if self.warp_specialized else BLOCK_N


SIMPLE = Tiling()
WIDE = Tiling(True, tile_n=256, steps=3)
# Set from measurement (benchmarks/moe.py, one H100, moe-1b's shapes, benchmarks/results/moe.md):
# the tilings grouped_matmul takes, the first whose CTA width divides the output's columns, and
# the weight gradient's rows of K per CTA. Persistent and warp-specialized, 256 columns a CTA where
# they divide: forward + backward 0.84 of a dense GEMM's TFLOP/s, where one CTA per tile made 0.67.
PREFERRED: tuple[Tiling, ...] = (WIDE, Tiling(warp_specialized=True))
WEIGHT_GRAD_BLOCK_K = 128

# The candidates measured against each other (benchmarks/moe.py --variants; each checked on a
# GPU by tests/test_grouped_matmul.py): name -> (PREFERRED, WEIGHT_GRAD_BLOCK_K).
VARIANTS = {
    "simple": ((SIMPLE,), 64),
    "simple/wgrad128": ((SIMPLE,), 128),
    "ws": ((Tiling(warp_specialized=True),), 128),
    "ws-n": ((Tiling(True, tile_m=128, tile_n=64, split="n"),), 128),
    "ws-wide": ((WIDE, Tiling(warp_specialized=True)), 128),
}


def preferred_tiling(n: int) -> Tiling:
    return next((t for t in PREFERRED if n % t.cta_n() == 0), SIMPLE)


class TileLayout(NamedTuple):
    """Where a group-sorted row set lives in the tile-aligned layout."""

    rows: int  # rows of the layout: a multiple of BLOCK_M with room for every group's padding
    starts: jax.Array  # [G] int32, the first layout row of each group (a multiple of BLOCK_M)
    tile_groups: jax.Array  # [rows // BLOCK_M] int32, each tile's group (the last, past the end)
    group_tiles: jax.Array  # [G + 1] int32, the first tile of each group, then the end
    placed: jax.Array  # [n_rows] int32, the layout row of each sorted row (past ``rows``, each its own, if in no group)


def tile_layout(group_sizes, n_rows: int) -> TileLayout:
    """The layout of ``n_rows`` rows sorted by group (those past the groups belong to none) in
    ``len(group_sizes)`` groups of those sizes."""
    groups = group_sizes.shape[0]
    tiles = -(-group_sizes // BLOCK_M)
    group_tiles = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(tiles).astype(jnp.int32)])
    n_tiles = -(-n_rows // BLOCK_M) + groups
    tile_groups = jnp.searchsorted(group_tiles[1:], jnp.arange(n_tiles), side="right").astype(jnp.int32)
    starts = group_tiles[:-1] * BLOCK_M
    ends = jnp.cumsum(group_sizes)
    rank = jnp.arange(n_rows)
    group = jnp.searchsorted(ends, rank, side="right")  # groups for the rows past the groups
    shift = starts - (ends - group_sizes)  # each group's rows move down by its padding
    placed = jnp.where(group < groups, rank + shift[jnp.minimum(group, groups - 1)], n_tiles * BLOCK_M + rank)
    return TileLayout(
        n_tiles * BLOCK_M, starts, jnp.minimum(tile_groups, groups - 1), group_tiles, placed.astype(jnp.int32)
    )


def supports(lhs, rhs) -> bool:
    """Whether these kernels take a [M, K] by [G, K, N] grouped GEMM on this device."""
    _, k, n = rhs.shape
    return (
        on_hopper()
        and lhs.dtype == rhs.dtype
        and lhs.dtype in (jnp.bfloat16, jnp.float16)
        and k % BLOCK_K == 0
        and k % BLOCK_N == 0
        and n % BLOCK_N == 0
        and n % BLOCK_K == 0
    )


def _transforms(dtype, block_minor: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(block_minor * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _store(plgpu, acc, o_gmem, rows, cols, transforms):
    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM(acc.shape, o_gmem.dtype, transforms=transforms))
    def _(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(plgpu, body, out_shape, dtype, grid, grid_names):
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, dtype),
        grid=grid,
        grid_names=grid_names,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def _block(plgpu, shape, index_map, dtype):
    """A pipelined operand's block, swizzled for wgmma, released one step late (wgmma reads it
    asynchronously)."""
    return plgpu.BlockSpec(shape, index_map, transforms=_transforms(dtype, shape[1]), delay_release=1)


def grouped_matmul(lhs, rhs, tile_groups, *, transpose_rhs: bool = False, tiling: Tiling | None = None):
    """out[t] = lhs[t] @ rhs[tile_groups[t]] per BLOCK_M-row tile t of lhs [M, K]; rhs is
    [G, K, N], or with ``transpose_rhs`` [G, N, K] used as its transpose (the input gradient
    reads the forward's weights so, without a transposed copy)."""
    tiling = tiling or preferred_tiling(rhs.shape[1] if transpose_rhs else rhs.shape[2])
    if tiling.warp_specialized:
        return _warp_specialized_matmul(lhs, rhs, tile_groups, transpose_rhs, tiling)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]

    def body(tile_groups_gmem, lhs_gmem, rhs_gmem, o_gmem):
        mi, ni = lax.axis_index("m"), lax.axis_index("n")
        if transpose_rhs:
            rhs_block = _block(plgpu, (BLOCK_N, BLOCK_K), lambda ki: (ni, ki), rhs.dtype)
        else:
            rhs_block = _block(plgpu, (BLOCK_K, BLOCK_N), lambda ki: (ki, ni), rhs.dtype)

        def accumulate(acc_ref):
            def step(_, lhs_smem, rhs_smem):
                plgpu.wgmma(acc_ref, lhs_smem, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem)

            plgpu.emit_pipeline(
                step,
                grid=(k // BLOCK_K,),
                in_specs=[_block(plgpu, (BLOCK_M, BLOCK_K), lambda ki: (mi, ki), lhs.dtype), rhs_block],
                max_concurrent_steps=MAX_CONCURRENT_STEPS,
            )(lhs_gmem, rhs_gmem.at[tile_groups_gmem[mi]])
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((BLOCK_M, BLOCK_N)))
        rows, cols = pl.ds(mi * BLOCK_M, BLOCK_M), pl.ds(ni * BLOCK_N, BLOCK_N)
        _store(plgpu, acc, o_gmem, rows, cols, _transforms(lhs.dtype, BLOCK_N))

    grid = (m // BLOCK_M, n // BLOCK_N)
    return _kernel(plgpu, body, (m, n), lhs.dtype, grid, ("m", "n"))(tile_groups, lhs, rhs)


def _warp_specialized_matmul(lhs, rhs, tile_groups, transpose_rhs: bool, tiling: Tiling):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tile_m, tile_n, cta_n = tiling.tile_m, tiling.tile_n, tiling.cta_n()
    if tile_m * (2 if tiling.split == "m" else 1) != BLOCK_M or n % cta_n:
        raise ValueError(f"grouped_matmul: {tiling} does not tile {BLOCK_M}-row tiles by {n} columns")
    m_tiles, n_blocks = m // BLOCK_M, n // cta_n
    b_block = (cta_n, BLOCK_K) if transpose_rhs else (BLOCK_K, cta_n)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k // BLOCK_K,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (BLOCK_M, BLOCK_K),
                    lambda ki: (0, ki),
                    transforms=_transforms(lhs.dtype, BLOCK_K),
                    memory_space=plgpu.SMEM,
                ),
                plgpu.BlockSpec(
                    b_block,
                    (lambda ki: (0, ki)) if transpose_rhs else (lambda ki: (ki, 0)),
                    transforms=_transforms(rhs.dtype, b_block[1]),
                    memory_space=plgpu.SMEM,
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=tiling.steps,
            compute_context=context,
        )

    def rhs_block(rhs_gmem, group, ni):
        cols = pl.ds(ni * cta_n, cta_n)
        return rhs_gmem.at[group, cols, :] if transpose_rhs else rhs_gmem.at[group, :, cols]

    def body(tile_groups_gmem, lhs_gmem, rhs_gmem, o_gmem):
        def unused(*_, **__):
            return None

        @functools.partial(
            pl.run_scoped,
            allocations=pipeline(unused, unused).get_allocations(
                lhs_gmem.at[pl.ds(0, BLOCK_M), :], rhs_block(rhs_gmem, 0, 0)
            ),
            o_smem=plgpu.SMEM((2, tile_m, tile_n), o_gmem.dtype, transforms=_transforms(lhs.dtype, tile_n)),
            collective_axes="wg",
        )
        def _(allocations, o_smem):
            wg = lax.axis_index("wg")
            mine = (
                (pl.ds(wg * tile_m, tile_m), slice(None))
                if tiling.split == "m"
                else (slice(None), pl.ds(wg * tile_n, tile_n))
            )

            @plgpu.nd_loop((m_tiles * n_blocks,), collective_axes="sm")
            def _(loop):
                mi, ni = plgpu.planar_snake(loop.index[0], (m_tiles, n_blocks), 1, tiling.band)

                def store(run_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n)))
                    def _(acc_ref):
                        run_pipeline(acc_ref)
                        acc = acc_ref[...].astype(o_gmem.dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read o_smem
                        o_smem[wg] = acc
                        plgpu.commit_smem()
                        cta = o_gmem.at[pl.ds(mi * BLOCK_M, BLOCK_M), pl.ds(ni * cta_n, cta_n)]
                        plgpu.copy_smem_to_gmem(o_smem.at[wg], cta.at[mine])

                def step(_, lhs_smem, rhs_smem, acc_ref):
                    if transpose_rhs:
                        operand = plgpu.transpose_ref(rhs_smem.at[mine[1], :], (1, 0))
                    else:
                        operand = rhs_smem.at[:, mine[1]]
                    plgpu.wgmma(acc_ref, lhs_smem.at[mine[0]], operand)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                lhs_tile = lhs_gmem.at[pl.ds(mi * BLOCK_M, BLOCK_M), :]
                pipeline(step, store)(lhs_tile, rhs_block(rhs_gmem, tile_groups_gmem[mi], ni), allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid=(_sm_count(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(tile_groups, lhs, rhs)


def _sm_count() -> int:
    device = jax.devices()[0]
    return getattr(device, "core_count", None) or 132  # lowering on a host without the GPU: an H100's


def grouped_weight_grad(lhs, dout, group_tiles, *, block_k: int | None = None):
    """d rhs[g] = sum over group g's tiles t of lhs[t]^T @ dout[t]: [G, K, N], one CTA per
    (group, ``block_k`` rows of K, BLOCK_N columns of N)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (_, k), n, groups = lhs.shape, dout.shape[1], group_tiles.shape[0] - 1
    block_k = block_k or WEIGHT_GRAD_BLOCK_K
    steps = MAX_CONCURRENT_STEPS if block_k == BLOCK_K else 3  # 64 KiB a step at 128: three fit

    def body(group_tiles_gmem, lhs_gmem, dout_gmem, o_gmem):
        g, ki, ni = lax.axis_index("g"), lax.axis_index("k"), lax.axis_index("n")
        first = group_tiles_gmem[g]
        count = group_tiles_gmem[g + 1] - first

        def accumulate(acc_ref):
            def step(_, lhs_smem, dout_smem):
                plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), dout_smem)

            @pl.when(count > 0)
            def _():
                plgpu.emit_pipeline(
                    step,
                    grid=(count,),
                    in_specs=[
                        _block(plgpu, (BLOCK_M, block_k), lambda t: (first + t, ki), lhs.dtype),
                        _block(plgpu, (BLOCK_M, BLOCK_N), lambda t: (first + t, ni), dout.dtype),
                    ],
                    max_concurrent_steps=steps,
                )(lhs_gmem, dout_gmem)

            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((block_k, BLOCK_N)))
        rows, cols = pl.ds(ki * block_k, block_k), pl.ds(ni * BLOCK_N, BLOCK_N)
        _store(plgpu, acc, o_gmem.at[g], rows, cols, _transforms(lhs.dtype, BLOCK_N))

    grid = (groups, k // block_k, n // BLOCK_N)
    return _kernel(plgpu, body, (groups, k, n), lhs.dtype, grid, ("g", "k", "n"))(group_tiles, lhs, dout)


@jax.custom_vjp
def gmm(lhs, rhs, tile_groups, group_tiles):
    """lhs [M, K] (tile-aligned layout) by rhs [G, K, N], each tile by its group's matrix."""
    return grouped_matmul(lhs, rhs, tile_groups)


def _gmm_fwd(lhs, rhs, tile_groups, group_tiles):
    return gmm(lhs, rhs, tile_groups, group_tiles), (lhs, rhs, tile_groups, group_tiles)


def gmm_grads(lhs, rhs, dout, tile_groups, group_tiles):
    """(d lhs, d rhs) of ``gmm`` at output gradient ``dout``."""
    dout = dout.astype(lhs.dtype)
    return grouped_matmul(dout, rhs, tile_groups, transpose_rhs=True), grouped_weight_grad(lhs, dout, group_tiles)


def _gmm_bwd(residuals, dout):
    lhs, rhs, tile_groups, group_tiles = residuals
    return *gmm_grads(lhs, rhs, dout, tile_groups, group_tiles), None, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)
