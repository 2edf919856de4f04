# Adapted from jax/experimental/pallas/ops/gpu/attention_mgpu.py (jax 0.11.2),
# Copyright 2024 The JAX Authors, Licensed under the Apache License, Version 2.0.
"""FlashAttention-3-style forward and a fused backward for Hopper, in Pallas with the Mosaic
GPU lowering.

`forward` is the fast path of `flash_attention_gpu.forward`. Each CTA has three warpgroups: two
compute warpgroups, each owning 64 query rows (wgmma into register accumulators, with a schedule
barrier that lets one warpgroup's softmax overlap the other's matmuls), and one memory
warpgroup that streams K/V blocks through shared memory with TMA, `MAX_CONCURRENT_STEPS` deep.
The step pipeline is JAX's; ours: the CTAs are persistent (`ForwardWork`), the logit scale
(JAX's applies none), shared-memory buffers in the input dtype (JAX's are float16 only, so
bfloat16 failed), lse in natural log, and a `supports` predicate.

`backward` is ours (JAX's Mosaic backward is two kernels, non-causal and float16 only): the
fast path of `flash_attention_gpu.backward`, one kernel, see its docstring.

Both take only what they were built for: bfloat16/float16, head_dim 64 or 128, segment ids or
none (one array, or a pair for queries and keys of different lengths; with them, every step is
masked), non-causal, or causal with any static q_offset - kv_offset (query i sees key j where j
<= i + offset_delta: 0 is the plain diagonal, -1 a striped ring's later blocks, kv_len - q_len
queries aligned to the end of the keys), query lengths that are multiples of 128 and key lengths
that are multiples of 128, at least 256. A query that sees no key gets output 0 and lse -inf.
`why_unsupported` dispatches only what has run on a GPU to them (``GPU_TESTED_CAUSAL_SHIFTS``);
everything else goes elsewhere (`flash_attention_gpu`). Mosaic GPU has no interpret mode:
benchmarks/attention.py --check tests these kernels on the GPU; on CPU the tests lower them
for CUDA.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import attention_common as common
from . import on_hopper
from .attention_common import LN_2, LOG2_E

BLOCK_Q = 64  # rows per compute warpgroup; a CTA covers 2 * BLOCK_Q rows
BLOCK_KV = 128
MAX_CONCURRENT_STEPS = 2
# The kernels take any static causal shift, keys longer or shorter than the queries, and segment
# ids apart for queries and keys: those lower for CUDA and their block ranges match brute force
# (tests/test_attention.py), but only the plain diagonal and a striped ring's (-1, q_len ==
# kv_len, one array of ids) have run on a GPU; `why_unsupported` sends the others to the XLA
# attention until the GPU tests of the rest (test_gpu_mosaic_kernels_*) pass.
GPU_TESTED_CAUSAL_SHIFTS = (0, -1)


def why_unsupported(q, k, segment_ids, offset_delta, *, causal: bool, scale: float, backward: bool = False):
    """None where the kernels (with ``backward``, the backward too: its q blocks of BWD_BLOCK_Q
    rows, kv blocks of 2 * BWD_BLOCK_KV) take these operands at exactly head_dim 64 or 128
    (`attend` pads others: `widened`), else what they do not take."""
    batch, q_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    if not on_hopper():
        return "the Mosaic GPU kernels need a Hopper GPU"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"{q.dtype} (the Mosaic GPU kernels take bfloat16 and float16)"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (the Mosaic GPU kernels take up to 128)"
    if scale <= 0:
        return f"scale {scale} (the Mosaic GPU kernels take a positive one)"
    if segment_ids is not None:
        if isinstance(segment_ids, tuple) or q_len != kv_len:
            return "segment ids of queries and keys apart (not yet run on a GPU)"
        if segment_ids.shape != (batch, q_len):
            return f"segment ids {segment_ids.shape} for q {q.shape}"
    if q_len % (2 * BLOCK_Q) or kv_len % BLOCK_KV or kv_len < MAX_CONCURRENT_STEPS * BLOCK_KV:
        return (
            f"q_len {q_len}, kv_len {kv_len} (the Mosaic GPU kernels take multiples of {2 * BLOCK_Q}, "
            f"kv_len at least {MAX_CONCURRENT_STEPS * BLOCK_KV})"
        )
    if causal and (not isinstance(offset_delta, int) or isinstance(offset_delta, bool)):
        return "a traced causal offset (the Mosaic GPU kernels take a static one)"
    if causal and (offset_delta not in GPU_TESTED_CAUSAL_SHIFTS or q_len != kv_len):
        return f"a causal shift of {offset_delta} with q_len {q_len}, kv_len {kv_len} (not yet run on a GPU)"
    if backward and (q_len % BWD_BLOCK_Q[head_dim] or kv_len % (2 * BWD_BLOCK_KV)):
        return f"q_len {q_len}, kv_len {kv_len} (the Mosaic GPU backward's tiles do not divide them)"
    return None


def supports(q, k, segment_ids, offset_delta, *, causal: bool, scale: float) -> bool:
    return why_unsupported(q, k, segment_ids, offset_delta, causal=causal, scale=scale) is None


def supports_backward(q, k, segment_ids, offset_delta, *, causal: bool, scale: float) -> bool:
    return why_unsupported(q, k, segment_ids, offset_delta, causal=causal, scale=scale, backward=True) is None


def _wide(head_dim: int) -> int:
    """The head dim `attend` runs ``head_dim`` at: below 128, zero-padded to 64 or 128 (zeros change
    neither q.k nor the output's real columns, and their gradients are sliced off); a head of 80
    or 96 runs at 128, as the Triton kernels pad it too, one of 16 or 32 at 64."""
    return head_dim if head_dim > 128 else 64 if head_dim <= 64 else 128


def widened(*xs):
    """The shapes of ``xs`` at the head dim `attend` pads them to, for `why_unsupported`."""
    return tuple(jax.ShapeDtypeStruct((*x.shape[:-1], _wide(x.shape[-1])), x.dtype) for x in xs)


def pad_head_dim(*xs):
    """``xs`` [..., head_dim] zero-padded to `_wide`'s head dim."""
    pad = _wide(xs[0].shape[-1]) - xs[0].shape[-1]
    return xs if not pad else tuple(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) for x in xs)


def attend(q, k, v, segment_ids, offset_delta, *, causal: bool, scale: float):
    """`forward` with attention_common's conventions, the head zero-padded to 64 or 128; None
    where the kernels do not take these operands."""
    if not supports(*widened(q, k), segment_ids, offset_delta, causal=causal, scale=scale):
        return None
    out, lse = forward(
        *pad_head_dim(q, k, v), causal=causal, scale=scale, offset_delta=offset_delta, segment_ids=segment_ids
    )
    return out[..., : q.shape[-1]], lse


def attend_backward(q, k, v, segment_ids, offset_delta, out, lse, dout, *, causal: bool, scale: float, dlse=None):
    """`backward` with attention_common's conventions, the head zero-padded; None where the
    kernel does not take these operands."""
    if not supports_backward(*widened(q, k), segment_ids, offset_delta, causal=causal, scale=scale):
        return None
    qw, kw, vw, ow, dw = pad_head_dim(q, k, v, out, dout)
    grads = backward(
        qw,
        kw,
        vw,
        ow,
        lse,
        dw,
        causal=causal,
        scale=scale,
        dlse=dlse,
        offset_delta=offset_delta,
        segment_ids=segment_ids,
    )
    return tuple(g[..., : q.shape[-1]] for g in grads)


class ForwardWork(NamedTuple):
    """Which work tiles (2 * BLOCK_Q query rows of one batch and head) each forward CTA attends.

    One CTA per SM, looping over its tiles, so that a tile's start (q load, pipeline fill) and
    end (output store) overlap its neighbours' steps. A (batch, head)'s tiles are contiguous in
    the work order, so the CTAs running together read few heads' K/V, from L2. Causal tile j has
    j + 1 steps: a CTA takes tiles in pairs (q_tiles - 1 - j, j) of q_tiles + 1 steps each, so
    the CTAs stay balanced (with an odd tile count, one by one, longest first: balance is lost,
    not correctness).
    """

    batch_size: int
    heads: int
    q_tiles: int
    kv_blocks: int
    causal: bool
    offset_delta: int  # causal: query i sees key j where j <= i + offset_delta
    tiles_per_unit: int
    num_ctas: int

    @classmethod
    def plan(cls, batch_size, heads, q_tiles, kv_blocks, causal, sm_count, offset_delta=0) -> ForwardWork:
        num_tiles = batch_size * heads * q_tiles
        tiles_per_unit = 2 if causal and num_tiles % 2 == 0 else 1
        num_ctas = min(num_tiles // tiles_per_unit, sm_count)
        return cls(batch_size, heads, q_tiles, kv_blocks, causal, offset_delta, tiles_per_unit, num_ctas)

    @property
    def one_masked_step(self) -> bool:
        """Causal: whether a tile's diagonal crosses at most one K/V block, its last (offsets 0
        and -1 modulo the block: the plain diagonal and a striped ring's)."""
        return (self.offset_delta + 1) % BLOCK_KV <= 1

    def tiles_of(self, cta):
        """How many tiles CTA `cta` (an int32 array) attends."""
        num_units = self.batch_size * self.heads * self.q_tiles // self.tiles_per_unit
        return (_div(num_units - 1 - cta, self.num_ctas) + 1) * self.tiles_per_unit

    def tile(self, cta, i):
        """(batch, head, q tile, unmasked K/V blocks, K/V blocks) of CTA `cta`'s i-th tile (int32
        arrays; the block counts Python ints when not causal). Causal, the unmasked blocks are
        those every query of the tile sees whole, the rest (one or two) carry the diagonal; a
        tile that sees no key still attends one block, masked whole, so that every tile takes a
        step of the K/V stream (its rows get output 0 and lse -inf)."""
        if self.tiles_per_unit == 2:
            work = 2 * (cta + _div(i, 2) * self.num_ctas) + _mod(i, 2)
        else:
            work = cta + i * self.num_ctas
        group, rank = _div(work, self.q_tiles), _mod(work, self.q_tiles)
        batch, head = _mod(group, self.batch_size), _div(group, self.batch_size)
        if not self.causal:
            return batch, head, rank, self.kv_blocks, self.kv_blocks
        if self.tiles_per_unit == 2:
            half, odd = _div(rank, 2), _mod(rank, 2)
            q_tile = self.q_tiles - 1 - half - odd * (self.q_tiles - 1 - 2 * half)
        else:
            q_tile = self.q_tiles - 1 - rank
        unmasked, blocks = common.kv_block_range(
            q_tile * (2 * BLOCK_Q),
            block_q=2 * BLOCK_Q,
            block_k=BLOCK_KV,
            num_kv_blocks=self.kv_blocks,
            kv_len=self.kv_blocks * BLOCK_KV,
            causal=True,
            has_segment_ids=False,  # segments mask every step, apart from this
            offset_delta=self.offset_delta,
        )
        blocks = jnp.maximum(blocks, 1)
        return batch, head, q_tile, jnp.minimum(unmasked, blocks), blocks


def _mod(x, n):
    return lax.rem(x, jnp.array(n, x.dtype))


def _div(x, n):
    return lax.div(x, jnp.array(n, x.dtype))


def forward(q, k, v, *, causal: bool, scale: float, offset_delta: int = 0, segment_ids=None):
    """Returns (out [B, S, Hq, D] in q's dtype, lse [B, Hq, S] float32, natural log).
    Causal: query i sees key j where i + offset_delta >= j (a static int); with
    ``segment_ids`` ([B, S] int32, or a pair [B, Sq], [B, Skv]), only keys of its own segment.

    Each CTA attends the tiles `ForwardWork` gives it, one after the other: the K/V stream runs
    on across its tiles, the next tile's q loads during this one and the output store is not
    waited for.
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu  # needs a CUDA build of jaxlib

    batch_size, q_seq_len, num_q_heads, head_dim = q.shape
    kv_seq_len, num_kv_heads = k.shape[1], k.shape[2]
    q_heads_per_kv_head = num_q_heads // num_kv_heads
    dtype = q.dtype
    block_q, block_kv = BLOCK_Q, BLOCK_KV
    assert 2 * block_q == block_kv  # so both compute warpgroups of a CTA visit the same blocks
    stages = min(MAX_CONCURRENT_STEPS, kv_seq_len // block_kv)
    logit_scale = scale * LOG2_E  # m_i is kept in this scaled base-2 domain

    work = ForwardWork.plan(
        batch_size,
        num_q_heads,
        q_seq_len // (2 * block_q),
        kv_seq_len // block_kv,
        causal,
        multiprocessor_count(),
        offset_delta=offset_delta if causal else 0,
    )

    segments = segment_ids is not None
    # A row may see no key in a step (another segment's keys) or at all (a diagonal shifted
    # below the first key): its running max stays -inf, and p and alpha are taken against 0 there.
    empty_rows = segments or (causal and offset_delta < 0)

    def kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, out_ref, lse_ref, scoped):
        smem_buffers, buffer_barriers, consumed_barriers, schedule_barrier = scoped
        wg_idx = lax.axis_index("wg")
        q_smem, k_smem, v_smem, lse_smem2, *seg_smem = smem_buffers
        q_seg_smem, kv_seg_smem = seg_smem if segments else (None, None)
        kv_barriers, q_barriers = buffer_barriers
        k_consumed_barriers, v_consumed_barriers = consumed_barriers
        cta = lax.axis_index("cta")
        my_tiles = work.tiles_of(cta)
        zero = cta * 0  # a traced 0: jax 0.11's Mosaic GPU lowering takes no array constants here

        def perform_schedule_barrier():
            plgpu.barrier_arrive(schedule_barrier)
            plgpu.barrier_wait(schedule_barrier)

        @pl.when(wg_idx < 2)
        def _compute_wg():
            plgpu.set_max_registers(232, action="increase")
            lse_smem = lse_smem2.at[wg_idx]

            def load_q(i):
                """Starts the copy of this warpgroup's q rows of the CTA's i-th tile."""
                batch, q_head, q_tile, _, _ = work.tile(cta, i)
                rows = pl.ds(q_tile * (2 * block_q) + wg_idx * block_q, block_q)
                q_slot = _mod(i, 2)
                barrier = q_barriers.at[q_slot * 2 + wg_idx]
                plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, q_head], q_smem.at[q_slot, wg_idx], barrier)
                if segments:
                    plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, rows], q_seg_smem.at[q_slot, wg_idx], barrier)

            load_q(zero)
            plgpu.barrier_wait(kv_barriers.at[0])
            pl.when(wg_idx == 1)(perform_schedule_barrier)

            def tile(i, first_step):
                batch, q_head, q_tile, unmasked_steps, kv_steps = work.tile(cta, i)
                q_seq_base = q_tile * (2 * block_q) + wg_idx * block_q
                q_slot = _mod(i, 2)
                qo_smem = q_smem.at[q_slot, wg_idx]
                plgpu.barrier_wait(q_barriers.at[q_slot * 2 + wg_idx])
                if segments:  # this warpgroup's rows' segments, for every step of the tile
                    q_seg = _load_whole(plgpu, q_seg_smem.at[q_slot, wg_idx], plgpu.Layout.WGMMA.reduce(1))

                m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, dtype=jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((block_q,), 0, dtype=jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0, dtype=jnp.float32), plgpu.Layout.WGMMA)

                def kv_loop(kv_step, carry, masked: bool = False):
                    acc, m_i, l_i = carry
                    step = first_step + kv_step  # in the CTA's K/V stream: slots and barrier phases
                    slot = _mod(step, stages)

                    def compute_qk(acc_ref):
                        plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                        perform_schedule_barrier()
                        return acc_ref[...]

                    qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                    if segments:  # read before the slot is released: its K/V and segments reload
                        kv_seg = _load_whole(plgpu, kv_seg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                    plgpu.barrier_arrive(k_consumed_barriers.at[slot])

                    mask = None
                    if masked:
                        q_ids = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                        kv_ids = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                        mask = (q_ids + (q_seq_base + offset_delta)) >= (kv_ids + kv_step * block_kv)
                    if segments:
                        same = lax.broadcast_in_dim(q_seg, qk.shape, [0]) == lax.broadcast_in_dim(kv_seg, qk.shape, [1])
                        mask = same if mask is None else mask & same
                    if mask is not None:
                        qk = jnp.where(mask, qk, -jnp.inf)

                    # m is kept scaled by logit_scale so that p is one FMA and an exp2.
                    m_ij = jnp.maximum(m_i, qk.max(axis=1) * logit_scale)
                    # A row that has seen no key yet (only under a shifted diagonal, only in the
                    # masked step) keeps m = -inf; its p and alpha are taken against 0, not NaN.
                    m_shift = jnp.where(m_ij == -jnp.inf, 0.0, m_ij) if mask is not None and empty_rows else m_ij
                    alpha = jnp.exp2(m_i - m_shift)
                    m_i = m_ij
                    p = jnp.exp2(qk * logit_scale - lax.broadcast_in_dim(m_shift, qk.shape, [0]))
                    acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_i *= alpha
                    p16 = p.astype(dtype)

                    def end_softmax_barriers():
                        plgpu.barrier_arrive(schedule_barrier)  # done with softmax
                        plgpu.barrier_wait(schedule_barrier)  # wait until the tensor cores are free

                    # JAX's kernel: this ordering measured fastest for head_dim <= 128.
                    l_i += p.sum(axis=1)
                    acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
                    end_softmax_barriers()

                    def compute_pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                        @pl.when((kv_step + 1 < kv_steps) | (i + 1 < my_tiles))
                        def _wait():  # for the next step's K/V blocks, while the tensor cores run p v
                            # (one barrier for both: a separate wait for V measured 1-2 % slower, results v11)
                            plgpu.barrier_wait(kv_barriers.at[_mod(step + 1, stages)])

                        @pl.when(kv_step == 0)
                        def _prefetch():
                            # The previous tile's out and lse stores had a step's time to read shared
                            # memory: the other q slot and lse_smem are free; the next tile's q loads.
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            pl.when(i + 1 < my_tiles)(lambda: load_q(i + 1))

                    acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_consumed_barriers.at[slot])
                    return acc, m_i, l_i

                carry = (acc, m_i, l_i)
                if causal and work.one_masked_step:  # the last block is the diagonal one
                    carry = lax.fori_loop(0, kv_steps - 1, kv_loop, carry)
                    acc, m_i, l_i = kv_loop(kv_steps - 1, carry, masked=True)
                elif causal:  # the diagonal crosses the last one or two blocks
                    carry = lax.fori_loop(0, unmasked_steps, kv_loop, carry)
                    masked_loop = functools.partial(kv_loop, masked=True)
                    acc, m_i, l_i = lax.fori_loop(unmasked_steps, kv_steps, masked_loop, carry)
                else:
                    acc, m_i, l_i = lax.fori_loop(0, kv_steps, kv_loop, carry)

                # Every row sees at least the first key (causal) or all keys, so l_i > 0; under a
                # diagonal shifted below the first key (or a segment whose keys are all hidden) a
                # row may see none: its output is 0 and its lse -inf.
                divisor = jnp.where(l_i == 0.0, 1.0, l_i) if empty_rows else l_i
                acc /= lax.broadcast_in_dim(divisor, (block_q, head_dim), [0])
                qo_smem[...] = acc.astype(dtype)  # q's slot: this tile's last q k^T has read it
                lse_smem[...] = m_i * LN_2 + jnp.log(l_i)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_seq_base, block_q), q_head])
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(q_seq_base, block_q)])
                return first_step + kv_steps

            lax.fori_loop(0, my_tiles, tile, zero)
            pl.when(wg_idx == 0)(perform_schedule_barrier)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg_idx == 2)
        def _memory_wg():
            plgpu.set_max_registers(40, action="decrease")

            def load_tile(i, first_step):
                batch, q_head, _, _, kv_steps = work.tile(cta, i)
                kv_head = _div(q_head, q_heads_per_kv_head)

                @pl.loop(0, kv_steps)
                def _load_step(kv_step):
                    step = first_step + kv_step
                    slot = _mod(step, stages)
                    s = (batch, pl.ds(kv_step * block_kv, block_kv), kv_head)
                    pl.when(step >= stages)(lambda: plgpu.barrier_wait(k_consumed_barriers.at[slot]))
                    plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[slot], kv_barriers.at[slot])
                    if segments:
                        plgpu.copy_gmem_to_smem(kv_seg_ref.at[s[:2]], kv_seg_smem.at[slot], kv_barriers.at[slot])
                    pl.when(step >= stages)(lambda: plgpu.barrier_wait(v_consumed_barriers.at[slot]))
                    plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[slot], kv_barriers.at[slot])

                return first_step + kv_steps

            lax.fori_loop(0, my_tiles, load_tile, zero)

    def entry(q_ref, k_ref, v_ref, *refs):
        q_seg_ref, kv_seg_ref, out_ref, lse_ref = refs if segments else (None, None, *refs)
        compute_wgs = 2
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        scratch = [
            plgpu.SMEM((2, compute_wgs, block_q, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((compute_wgs, block_q), jnp.float32),
        ]
        if segments:
            scratch += [
                plgpu.SMEM((2, compute_wgs, block_q), jnp.int32),  # q's segments, by q slot
                plgpu.SMEM((stages, block_kv), jnp.int32),  # the keys' segments, by K/V slot
            ]
        copies = 1 + segments  # TMA copies a q load and a K load arrive on
        pl.run_scoped(
            lambda *args: kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, out_ref, lse_ref, args),
            scratch,
            (
                plgpu.Barrier(num_arrivals=1 + copies, num_barriers=stages),  # K (and segments) and V
                plgpu.Barrier(num_arrivals=copies, num_barriers=2 * compute_wgs),
            ),
            (plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=compute_wgs),
            collective_axes="wg",
        )

    out, lse = pl.kernel(
        entry,
        out_type=[q, jax.ShapeDtypeStruct((batch_size, num_q_heads, q_seq_len), jnp.float32)],
        mesh=plgpu.Mesh(grid=(work.num_ctas,), grid_names=("cta",), num_threads=3, thread_name="wg"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        name="sf_flash_attention_fwd_mgpu",
    )(q, k, v, *_segment_operands(segment_ids))
    return out, lse


def _segment_operands(segment_ids):
    """() or (the queries' ids, the keys' ids), int32, of ids given as one array or a pair."""
    if segment_ids is None:
        return ()
    return tuple(ids.astype(jnp.int32) for ids in common.segment_pair(segment_ids))


def multiprocessor_count() -> int:
    """SMs of the GPU (132 on H100 and H200 SXM): the persistent forward's CTA count."""
    try:
        return getattr(jax.devices()[0], "core_count", None) or 132
    except RuntimeError:
        return 132


# ------------------------------------------------------------------------------------------
# Backward.

# q rows per pipeline step, by head_dim: what fits 240 registers and 227 KB of shared memory
# (head_dim 64 with 128 rows measured 5-7 % faster than with 64).
BWD_BLOCK_Q = {64: 128, 128: 64}
BWD_BLOCK_KV = 64  # kv rows per compute warpgroup; a CTA covers 2 * BWD_BLOCK_KV
BWD_STAGES = 2  # q/dout pipeline depth
DQ_COLUMNS = 64  # dq columns per wgmma: one 128-byte swizzle atom of k


def _load_whole(plgpu, ref, layout):
    """All of ``ref`` loaded at ``layout``: jax 0.11 takes the ref alone (an index beside it is
    deprecated there); 0.10 requires the index, ``()``."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def backward_grid(batch, kv_len, heads_q, heads_kv, head_dim, *, causal: bool, sm_count: int):
    """(per_q_head, the plgpu.Mesh grid arguments) of the backward: a CTA per (head, 2 *
    BWD_BLOCK_KV kv rows, batch).

    A head is a kv head, whose CTA streams the q blocks of every q head of its group, so that GQA
    never re-reads K/V or writes per-q-head dk/dv; or, per_q_head, one q head, whose CTA adds its
    dk, dv into float32 sums shared by the group. Per q head where per kv head would leave fewer
    than two CTAs per SM — group-times longer CTAs, and causal ones of unequal length, leave SMs
    idle (4,2048,16/2 causal: 0.73 -> 0.49 ms at head_dim 128, 0.37 -> 0.26 at 64) — and for
    causal GQA of groups above 2 at head_dim 128, whose group-long CTAs stream group-times the q,
    dout and dq rows and miss L2 (2,4096,32/8 causal 1.70 -> 1.54 ms); at head_dim 64 there per
    kv head measured faster (0.72 vs 0.79 ms), and for groups of 2 at head_dim 128 too (the 1b
    model's 4,4096,16/8 causal: 1.42 -> 1.33 ms, 8,4096: 2.83 -> 2.60, heads outermost).

    Pallas launches the last grid axis fastest. CTAs of one head run together, so that the q, dout
    and dq rows they stream stay in L2 (kv blocks outermost measured 14-27 % slower on the
    non-GQA rows); but causal per-kv-head CTAs of groups above 2 are long and unequal, so there
    the kv blocks go outermost: the longest start first instead of the last head's ending the
    kernel (3-6 % on 2,4096,32/8,128 causal when that ran per kv head). Groups of 2 keep heads
    outermost (8,4096,16/8,128 causal: 2.60 ms against 2.79 with kv blocks outermost)."""
    group = heads_q // heads_kv
    kv_blocks = kv_len // (2 * BWD_BLOCK_KV)
    few_ctas = batch * heads_kv * kv_blocks < 2 * sm_count
    per_q_head = group > 1 and (few_ctas or (causal and head_dim == 128 and group > 2))
    heads = heads_q if per_q_head else heads_kv
    if causal and group > 2 and not per_q_head:  # longest first
        return per_q_head, dict(grid=(kv_blocks, heads, batch), grid_names=("kv_seq", "heads", "batch"))
    return per_q_head, dict(grid=(heads, kv_blocks, batch), grid_names=("heads", "kv_seq", "batch"))


def backward(
    q, k, v, out, lse, dout, *, causal: bool, scale: float, dlse=None, offset_delta: int = 0, segment_ids=None
):
    """FlashAttention-2/3-style fused backward: returns (dq, dk, dv) in q's dtype.

    One CTA per (head, 128 kv rows, batch), a head being a kv head or a q head (`backward_grid`):
    two compute warpgroups own 64 kv rows each and keep their dk, dv in registers; a memory
    warpgroup streams (q, dout, lse, delta) blocks of BWD_BLOCK_Q rows for the CTA's q heads.
    Per step each compute warpgroup runs four wgmmas in transposed form, ordered so that its
    elementwise work runs under its own matmuls: s^T = k q^T and dp^T = v dout^T back to back
    (p^T under dp^T), then dv += p^T dout (ds^T under dv), then it publishes its ds^T tile in
    shared memory and issues dk += ds^T q; the step's dq = ds k over all 128 kv rows is then
    computed in 64-column tiles shared out between the warpgroups — five matmuls per tile pair,
    not the split backward's seven — and added to an fp32 dq in global memory with a TMA
    reduce-add (per-q-head CTAs add their dk, dv so at the end). Causal: a CTA starts at the
    first q block that can see its keys; only the q blocks over its own rows carry the element
    mask (``offset_delta`` -1 shifts it by one: those blocks stay the only masked ones, and a row
    that sees no key has lse -inf, so its p is 0). With ``segment_ids`` every step is masked by
    them too.
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu  # needs a CUDA build of jaxlib

    batch_size, q_len, heads_q, head_dim = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    dtype = q.dtype
    segments = segment_ids is not None
    # With segment ids the head-64 kernel's 128-row q blocks leave no shared memory for the
    # segments' buffers: 64 rows there, as at head 128.
    bq, bkv, stages = 64 if segments else BWD_BLOCK_Q[head_dim], BWD_BLOCK_KV, BWD_STAGES
    column_tiles = head_dim // DQ_COLUMNS
    num_q_blocks = q_len // bq
    logit_scale = scale * LOG2_E
    delta = common.softmax_delta(out, dout, dlse)
    lse2 = lse * LOG2_E
    dq_accumulator = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
    per_q_head, grid = backward_grid(
        batch_size, kv_len, heads_q, heads_kv, head_dim, causal=causal, sm_count=multiprocessor_count()
    )
    members = 1 if per_q_head else group  # q heads per CTA
    # Per q head, dk's and dv's float32 sums are one buffer [2, *k.shape]: as two refs of equal
    # zeros, XLA merges their initial values into one operand aliased by both outputs, and where
    # it fuses the slicing of q, k, v into the kernel call (dynamic-slice fusion: `k = x[0]`, or a
    # layer of a stacked model) the two sums share that buffer — dk, dv off by 56-179 %, measured
    # on an H100 with jax 0.11.2.
    dkv_sum = (jax.new_ref(jnp.zeros((2, *k.shape), jnp.float32)),) if per_q_head else ()

    def acc_zeros(shape):
        return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_refs, dq_ref, dkv_refs, smem, barriers):
        q_seg_ref, kv_seg_ref = seg_refs
        k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, *seg_smem = smem
        q_seg_smem, kv_seg_smem = seg_smem if segments else (None, None)
        (k_bar, v_bar, in_bar, consumed, ds_ready, cta_sync) = barriers
        b = lax.axis_index("batch")
        cta_head = lax.axis_index("heads")
        kv_head = _div(cta_head, group) if per_q_head else cta_head
        first_q_head = cta_head if per_q_head else kv_head * group
        wg = lax.axis_index("wg")
        kv_start = lax.axis_index("kv_seq") * (2 * bkv)
        if causal:
            first_q_block, unmasked_from = common.q_block_range(
                kv_start,
                block_q=bq,
                block_k=2 * bkv,
                num_q_blocks=num_q_blocks,
                causal=True,
                has_segment_ids=False,  # segments mask every step, apart from this
                offset_delta=offset_delta,
            )

        def for_each_step(body, carry):
            """Runs body(step, q_block, q_head, carry, masked) over the CTA's (q head, q block)s in
            flat loops: a loop nest over heads costs the step registers (spills, measured).
            Causal: first every head's masked blocks — those the diagonal crosses, the only ones
            that see some of the CTA's keys and not others — then every head's unmasked ones."""

            def run(start, blocks, first_block, masked, carry):
                def one(i, carry):
                    member, j = (0, i) if members == 1 else (lax.div(i, blocks), lax.rem(i, blocks))
                    return body(start + i, first_block + j, first_q_head + member, carry, masked)

                return lax.fori_loop(0, members * blocks, one, carry)

            if not causal:
                return run(0, num_q_blocks, 0, False, carry)
            masked_blocks = unmasked_from - first_q_block
            carry = run(0, masked_blocks, first_q_block, True, carry)
            return run(members * masked_blocks, num_q_blocks - unmasked_from, unmasked_from, False, carry)

        @pl.when(wg < 2)
        def _compute_wg():
            plgpu.set_max_registers(240, action="increase")
            kv_rows = kv_start + wg * bkv
            k_w, v_w = k_smem.at[wg], v_smem.at[wg]
            kv_slice = (b, pl.ds(kv_rows, bkv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[kv_slice], k_w, k_bar.at[wg])
            if segments:
                plgpu.copy_gmem_to_smem(kv_seg_ref.at[kv_slice[:2]], kv_seg_smem.at[wg], k_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[kv_slice], v_w, v_bar.at[wg])
            plgpu.barrier_wait(k_bar.at[wg])
            plgpu.barrier_wait(v_bar.at[wg])

            def step(s, q_block, q_head, carry, masked):
                dk, dv = carry
                # K and V are addressed through a zero the compiler cannot see through, so their wgmma
                # descriptors are rebuilt each step: hoisted out of the loop they outnumbered the free
                # registers and ptxas spilled them, reloading them every step.
                zero = lax.optimization_barrier(jnp.int32(0))
                k_w, v_w = k_smem.at[wg + zero], v_smem.at[wg + zero]
                slot = lax.rem(s, jnp.int32(stages))
                q_s, do_s = q_smem.at[slot], do_smem.at[slot]
                # One barrier for the step's q, dout, lse and delta: a wait on each of four measured
                # 2-6 % slower (results v11).
                plgpu.barrier_wait(in_bar.at[slot])

                def compute_pt_dpt(st_ref, dpt_ref):
                    # s^T and dp^T back to back: the softmax runs while the tensor cores do dp^T.
                    plgpu.wgmma(st_ref, k_w, q_s.transpose((1, 0)))
                    plgpu.wgmma(dpt_ref, v_w, do_s.transpose((1, 0)))
                    st = plgpu.wgmma_accumulator_load(st_ref, wait_n=1)
                    lse = _load_whole(plgpu, lse_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                    logits = st * logit_scale - lax.broadcast_in_dim(lse, (bkv, bq), [1])
                    visible = None
                    if masked:
                        kv_ids = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 0, layout=plgpu.Layout.WGMMA)
                        q_ids = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 1, layout=plgpu.Layout.WGMMA)
                        visible = q_ids + (q_block * bq + offset_delta) >= kv_ids + kv_rows
                    if segments:  # loaded each step: held across the loop they cost registers
                        kv_seg = _load_whole(plgpu, kv_seg_smem.at[wg], plgpu.Layout.WGMMA.reduce(1))
                        q_seg = _load_whole(plgpu, q_seg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                        same = lax.broadcast_in_dim(kv_seg, (bkv, bq), [0]) == lax.broadcast_in_dim(
                            q_seg, (bkv, bq), [1]
                        )
                        visible = same if visible is None else visible & same
                    if visible is not None:
                        logits = jnp.where(visible, logits, -jnp.inf)
                    return jnp.exp2(logits), dpt_ref[...]

                acc = plgpu.ACC((bkv, bq), jnp.float32)
                pt, dpt = pl.run_scoped(compute_pt_dpt, acc, acc)
                delta = _load_whole(plgpu, delta_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))

                # dq for this q block, in 64-column tiles: both warpgroups publish their ds^T tile,
                # then column tile c of dq = ds k (over all 2 * bkv kv rows) is computed by warpgroup
                # (s + c) % 2 — with head_dim 128 both work every step, with 64 they alternate.
                # ds^T is double-buffered by step parity: a warpgroup that computed a tile at step
                # s + 1 waited for the other's arrival there, i.e. for the end of its step-s reads.
                ds_slot = lax.rem(s, jnp.int32(2))
                column = lax.rem(wg + s, jnp.int32(2))

                def add_dq_tile(c):
                    """dq[:, c-th 64 columns] += ds k, over both warpgroups' ds^T tiles."""

                    def compute_dq(dq_acc):
                        for h in range(2):
                            plgpu.wgmma(
                                dq_acc,
                                ds_smem.at[ds_slot, h].transpose((1, 0)),
                                k_smem.at[h + zero, :, pl.ds(c * DQ_COLUMNS, DQ_COLUMNS)],
                            )
                        return dq_acc[...]

                    plgpu.barrier_wait(ds_ready.at[ds_slot])
                    dq = pl.run_scoped(compute_dq, plgpu.ACC((bq, DQ_COLUMNS), jnp.float32))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous add has read dq_smem
                    dq_smem.at[wg][...] = dq
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        dq_smem.at[wg],
                        dq_ref.at[b, pl.ds(q_block * bq, bq), q_head, pl.ds(c * DQ_COLUMNS, DQ_COLUMNS)],
                        reduction_op="add",
                    )

                def compute_dv_dk_dq(refs):
                    dv_ref, dk_ref = refs
                    plgpu.wgmma(dv_ref, pt.astype(dtype), do_s)
                    # ds^T while the tensor cores run dv.
                    dst = (pt * (dpt - lax.broadcast_in_dim(delta, (bkv, bq), [1]))).astype(dtype)
                    # Publish ds^T before issuing dk: the other warpgroup waits less for it.
                    ds_smem.at[ds_slot, wg][...] = dst
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ds_ready.at[ds_slot])
                    plgpu.wgmma(dk_ref, dst, q_s)
                    for c in range(column_tiles):
                        pl.when(column == c)(functools.partial(add_dq_tile, c))

                dv, dk = pl.run_state(compute_dv_dk_dq)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                plgpu.barrier_arrive(consumed.at[slot])
                return dk, dv

            dk, dv = for_each_step(step, (acc_zeros((bkv, head_dim)), acc_zeros((bkv, head_dim))))
            if per_q_head:  # into the group's float32 sums, through this warpgroup's dq tile
                staging = dq_smem.at[wg, pl.ds(0, bkv)]
                (dkv_sum_ref,) = dkv_refs
                for i, total in enumerate((dk * scale, dv)):
                    for c in range(column_tiles):
                        columns = slice(c * DQ_COLUMNS, (c + 1) * DQ_COLUMNS)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        staging[...] = total[:, columns]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            staging,
                            dkv_sum_ref.at[(i, *kv_slice, pl.ds(columns.start, DQ_COLUMNS))],
                            reduction_op="add",
                        )
                plgpu.wait_smem_to_gmem(0)
                return
            # The other warpgroup's last dq may still read this warpgroup's K tile.
            plgpu.barrier_arrive(cta_sync)
            plgpu.barrier_wait(cta_sync)
            dk_ref, dv_ref = dkv_refs
            k_w[...] = (dk * scale).astype(dtype)
            v_w[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_w, dk_ref.at[kv_slice], commit_group=False)
            plgpu.copy_smem_to_gmem(v_w, dv_ref.at[kv_slice], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory_wg():
            plgpu.set_max_registers(24, action="decrease")

            def load(s, q_block, q_head, carry, masked):
                del masked
                slot = lax.rem(s, jnp.int32(stages))

                @pl.when(s >= stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                rows = pl.ds(q_block * bq, bq)
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, q_head], q_smem.at[slot], in_bar.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, q_head], do_smem.at[slot], in_bar.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[b, q_head, rows], lse_smem.at[slot], in_bar.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[b, q_head, rows], delta_smem.at[slot], in_bar.at[slot])
                if segments:
                    plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], q_seg_smem.at[slot], in_bar.at[slot])
                return carry

            for_each_step(load, ())

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
        *seg_refs, dq_ref = refs[: 3 if segments else 1]
        dkv_refs = refs[len(seg_refs) + 1 :]
        seg_refs = seg_refs or (None, None)
        tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        tiled_f32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
        smem = [
            plgpu.SMEM((2, bkv, head_dim), dtype, transforms=tiled),  # k, then dk
            plgpu.SMEM((2, bkv, head_dim), dtype, transforms=tiled),  # v, then dv
            plgpu.SMEM((stages, bq, head_dim), dtype, transforms=tiled),  # q
            plgpu.SMEM((stages, bq, head_dim), dtype, transforms=tiled),  # dout
            plgpu.SMEM((stages, bq), jnp.float32),  # lse (base 2)
            plgpu.SMEM((stages, bq), jnp.float32),  # delta
            plgpu.SMEM((2, 2, bkv, bq), dtype, transforms=tiled),  # ds^T [slot, wg]
            plgpu.SMEM((2, bq, DQ_COLUMNS), jnp.float32, transforms=tiled_f32),  # dq tile [wg]
        ]
        if segments:
            smem += [plgpu.SMEM((stages, bq), jnp.int32), plgpu.SMEM((2, bkv), jnp.int32)]  # q's, the keys' [wg]
        barriers = (
            plgpu.Barrier(num_arrivals=1 + segments, num_barriers=2),  # K (and its segments)
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=4 + segments, num_barriers=stages),  # q, dout, lse, delta (, segments)
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # q slot consumed
            plgpu.Barrier(num_arrivals=2, num_barriers=2),  # ds^T slot written by both
            plgpu.Barrier(num_arrivals=2),  # both compute warpgroups done
        )
        pl.run_scoped(
            lambda *scoped: kernel(
                q_ref,
                k_ref,
                v_ref,
                do_ref,
                lse_ref,
                delta_ref,
                seg_refs,
                dq_ref,
                dkv_refs,
                scoped[: len(smem)],
                scoped[len(smem) :],
            ),
            *smem,
            *barriers,
            collective_axes="wg",
        )

    kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
    dkv = pl.kernel(
        entry,
        out_type=() if per_q_head else (kv_type, kv_type),
        mesh=plgpu.Mesh(**grid, num_threads=3, thread_name="wg"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        name="sf_flash_attention_bwd_mgpu",
    )(q, k, v, dout, lse2, delta, *_segment_operands(segment_ids), dq_accumulator, *dkv_sum)
    dk, dv = dkv_sum[0][...].astype(dtype) if per_q_head else dkv
    dq = (dq_accumulator[...] * scale).astype(dtype)
    return dq, dk, dv
