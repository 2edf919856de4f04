"""Flash attention forward and backward for TPUs, in Pallas with the Mosaic TPU lowering.

TPU Pallas pipelines blocks through VMEM along the grid, so the kv loop is the innermost grid
axis (a reduction, "arbitrary") and the running softmax statistics live in VMEM scratch:

* forward, grid (batch, heads_q, q blocks, kv blocks);
* dq, grid (batch, heads_q, q blocks, kv blocks);
* dk/dv, grid (batch, heads_kv, kv blocks, group * q blocks): the innermost axis walks the q
  heads of the kv head's group and their q blocks, so GQA never repeats K/V.

Fully masked blocks are skipped twice: `pl.when` skips their compute, and the index maps clamp
the block index (with the offsets prefetched as a scalar) so that the pipeline issues no copy
for them. Inputs are transposed to [batch, heads, seq, head_dim] so each block's two minor
dimensions are (seq block, head_dim), and sequences are padded to the blocks (multiples of
128); lse and the softmax statistics travel as [.., seq, 1] columns.

Only interpret mode has been run (on CPU, by the tests), and the kernels are lowered for a TPU
(v5e sizes) on CPU, which runs Pallas' Mosaic TPU checks; no TPU was available to compile
or run them.
Conventions: see attention_common.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import attention_common as common

BLOCK = 128  # q and kv block; a multiple of the 128 lanes of a vreg


def _dot(a, b, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _to_heads_major(x, seq_padded):
    x = jnp.pad(x, ((0, 0), (0, seq_padded - x.shape[1]), (0, 0), (0, 0)))
    return x.transpose(0, 2, 1, 3)


def _from_heads_major(x, seq):
    return x.transpose(0, 2, 1, 3)[:, :seq]


# The last grid axis is the reduction (kv blocks, or q blocks for dk/dv).
_COMPILER_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _interpret(interpret: bool):
    # Pallas' generic interpreter: it has no effects (pltpu.InterpretParams' TPU simulator runs
    # through io_callback), so the kernels can sit under any transformation or custom lowering.
    return interpret


def _segment_operands(segment_ids, seq_padded):
    """(q ids [B, S, 1], kv ids [B, 1, S]); padding gets ids that match nothing."""
    q_ids, kv_ids = common.segment_pair(segment_ids)
    q_ids = jnp.pad(q_ids, ((0, 0), (0, seq_padded - q_ids.shape[1])), constant_values=-1)[:, :, None]
    kv_ids = jnp.pad(kv_ids, ((0, 0), (0, seq_padded - kv_ids.shape[1])), constant_values=-2)[:, None, :]
    return q_ids, kv_ids


def _last_visible_kv_block(q_block, delta, num_kv_blocks):
    """Index of the last kv block that q_block can see (clamped to a valid block)."""
    end = lax.div(jnp.maximum(q_block * BLOCK + BLOCK + delta + BLOCK - 1, 0), BLOCK)
    return jnp.clip(end - 1, 0, num_kv_blocks - 1)


def _first_visible_q_block(kv_block, delta, num_q_blocks):
    begin = lax.div(jnp.maximum(kv_block * BLOCK - delta, 0), BLOCK)
    return jnp.clip(begin, 0, num_q_blocks - 1)


def _mask(q_block, kv_block, *, causal, kv_len, num_kv_blocks, delta, q_seg_ref, kv_seg_ref):
    q_index = q_block * BLOCK + lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
    kv_index = kv_block * BLOCK + lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
    mask = None
    if causal:
        mask = q_index + delta >= kv_index
    if kv_len % BLOCK:
        in_range = kv_index < kv_len
        mask = in_range if mask is None else jnp.logical_and(mask, in_range)
    if q_seg_ref is not None:
        same = q_seg_ref[...] == kv_seg_ref[...]  # [bq, 1] == [1, bk]
        mask = same if mask is None else jnp.logical_and(mask, same)
    return mask


def _update_visible(update, q_block, kv_block, *, causal, kv_len, num_kv_blocks, delta, q_seg_ref, kv_seg_ref):
    """update(None) on a (q block, kv block) pair visible in full, update(mask) with the pair's
    element mask on a partly visible one, nothing on a hidden one. Where no element can be
    masked (not causal, no segment ids, kv a whole number of blocks) the masked update is not
    traced."""
    has_segment_ids = q_seg_ref is not None
    num_full, end = common.kv_block_range(
        q_block * BLOCK,
        block_q=BLOCK,
        block_k=BLOCK,
        num_kv_blocks=num_kv_blocks,
        kv_len=kv_len,
        causal=causal,
        has_segment_ids=has_segment_ids,
        offset_delta=delta,
    )
    pl.when(kv_block < num_full)(lambda: update(None))
    if causal or has_segment_ids or kv_len % BLOCK:
        pl.when(jnp.logical_and(kv_block >= num_full, kv_block < end))(
            lambda: update(
                _mask(
                    q_block,
                    kv_block,
                    causal=causal,
                    kv_len=kv_len,
                    num_kv_blocks=num_kv_blocks,
                    delta=delta,
                    q_seg_ref=q_seg_ref,
                    kv_seg_ref=kv_seg_ref,
                )
            )
        )


# --------------------------------------------------------------------------------------------
# Forward


def _forward_kernel(delta_ref, q_ref, k_ref, v_ref, *refs, causal, has_segment_ids, scale, kv_len, num_kv_blocks):
    if has_segment_ids:
        q_seg_ref, kv_seg_ref, out_ref, lse_ref, acc_ref, max_ref, sum_ref = refs
    else:
        q_seg_ref = kv_seg_ref = None
        out_ref, lse_ref, acc_ref, max_ref, sum_ref = refs
    q_block, kv_block = pl.program_id(2), pl.program_id(3)
    delta = delta_ref[0]

    @pl.when(kv_block == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        max_ref[...] = jnp.full_like(max_ref, -jnp.inf)
        sum_ref[...] = jnp.zeros_like(sum_ref)

    def update(mask):
        s = _dot(q_ref[...], k_ref[...], ((1,), (1,))) * scale
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        row_max = max_ref[...]
        new_max = jnp.maximum(row_max, s.max(axis=1, keepdims=True))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        correction = jnp.exp(row_max - safe_max)
        p = jnp.exp(s - safe_max)
        sum_ref[...] = sum_ref[...] * correction + p.sum(axis=1, keepdims=True)
        acc_ref[...] = acc_ref[...] * correction + _dot(p.astype(v_ref.dtype), v_ref[...])
        max_ref[...] = new_max

    _update_visible(
        update,
        q_block,
        kv_block,
        causal=causal,
        kv_len=kv_len,
        num_kv_blocks=num_kv_blocks,
        delta=delta,
        q_seg_ref=q_seg_ref,
        kv_seg_ref=kv_seg_ref,
    )

    @pl.when(kv_block == num_kv_blocks - 1)
    def _finish():
        row_sum = sum_ref[...]
        empty = row_sum == 0.0
        safe_sum = jnp.where(empty, 1.0, row_sum)
        out_ref[...] = (acc_ref[...] / safe_sum).astype(out_ref.dtype)
        lse_ref[...] = jnp.where(empty, -jnp.inf, max_ref[...] + jnp.log(safe_sum))


def forward(q, k, v, segment_ids, offset_delta, *, causal: bool, scale: float, interpret: bool = False):
    """Returns (out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] float32)."""
    batch, q_len, heads_q, dim = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    q_padded, kv_padded = common.round_up(q_len, BLOCK), common.round_up(kv_len, BLOCK)
    num_q_blocks, num_kv_blocks = q_padded // BLOCK, kv_padded // BLOCK
    qt = _to_heads_major(q, q_padded)
    kt, vt = _to_heads_major(k, kv_padded), _to_heads_major(v, kv_padded)

    def kv_map(b, h, i, j, delta_ref):
        if causal:
            j = jnp.minimum(j, _last_visible_kv_block(i, delta_ref[0], num_kv_blocks))
        return b, h // group, j, 0

    in_specs = [
        pl.BlockSpec((None, None, BLOCK, dim), lambda b, h, i, j, d: (b, h, i, 0)),
        pl.BlockSpec((None, None, BLOCK, dim), kv_map),
        pl.BlockSpec((None, None, BLOCK, dim), kv_map),
    ]
    operands = [qt, kt, vt]
    if segment_ids is not None:
        in_specs += [
            pl.BlockSpec((None, BLOCK, 1), lambda b, h, i, j, d: (b, i, 0)),
            pl.BlockSpec((None, 1, BLOCK), lambda b, h, i, j, d: (b, 0, kv_map(b, h, i, j, d)[2])),
        ]
        operands += list(_segment_operands(segment_ids, q_padded))
    kernel = functools.partial(
        _forward_kernel,
        causal=causal,
        has_segment_ids=segment_ids is not None,
        scale=scale,
        kv_len=kv_len,
        num_kv_blocks=num_kv_blocks,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, heads_q, num_q_blocks, num_kv_blocks),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, None, BLOCK, dim), lambda b, h, i, j, d: (b, h, i, 0)),
                pl.BlockSpec((None, None, BLOCK, 1), lambda b, h, i, j, d: (b, h, i, 0)),
            ],
            scratch_shapes=[
                pltpu.VMEM((BLOCK, dim), jnp.float32),
                pltpu.VMEM((BLOCK, 1), jnp.float32),
                pltpu.VMEM((BLOCK, 1), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(qt.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads_q, q_padded, 1), jnp.float32),
        ],
        compiler_params=_COMPILER_PARAMS,
        interpret=_interpret(interpret),
        name="sf_flash_attention_fwd_tpu",
    )(jnp.asarray(offset_delta, jnp.int32).reshape(1), *operands)
    return _from_heads_major(out, q_len), lse[:, :, :q_len, 0]


# --------------------------------------------------------------------------------------------
# Backward


def _probabilities(q, k, lse, scale, mask=None):
    """The softmax probabilities [bq, bk] of a block, recomputed from lse; ``mask``: the block's
    element mask, None for a block visible in full."""
    p = jnp.exp(_dot(q, k, ((1,), (1,))) * scale - lse)
    return p if mask is None else jnp.where(mask, p, 0.0)


def _dq_kernel(
    delta_ref,
    q_ref,
    k_ref,
    v_ref,
    dout_ref,
    lse_ref,
    di_ref,
    *refs,
    causal,
    has_segment_ids,
    scale,
    kv_len,
    num_kv_blocks,
):
    if has_segment_ids:
        q_seg_ref, kv_seg_ref, dq_ref, acc_ref = refs
    else:
        q_seg_ref = kv_seg_ref = None
        dq_ref, acc_ref = refs
    q_block, kv_block = pl.program_id(2), pl.program_id(3)
    delta = delta_ref[0]

    @pl.when(kv_block == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def update(mask):
        k = k_ref[...]
        p = _probabilities(q_ref[...], k, lse_ref[...], scale, mask)
        dp = _dot(dout_ref[...], v_ref[...], ((1,), (1,)))
        ds = p * (dp - di_ref[...])
        acc_ref[...] += _dot(ds.astype(k.dtype), k)

    _update_visible(
        update,
        q_block,
        kv_block,
        causal=causal,
        kv_len=kv_len,
        num_kv_blocks=num_kv_blocks,
        delta=delta,
        q_seg_ref=q_seg_ref,
        kv_seg_ref=kv_seg_ref,
    )

    @pl.when(kv_block == num_kv_blocks - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    delta_ref,
    q_ref,
    k_ref,
    v_ref,
    dout_ref,
    lse_ref,
    di_ref,
    *refs,
    causal,
    has_segment_ids,
    scale,
    kv_len,
    num_q_blocks,
    num_kv_blocks,
):
    if has_segment_ids:
        q_seg_ref, kv_seg_ref, dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = refs
    else:
        q_seg_ref = kv_seg_ref = None
        dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = refs
    kv_block, step = pl.program_id(2), pl.program_id(3)
    q_block = step % num_q_blocks
    delta = delta_ref[0]

    @pl.when(step == 0)
    def _init():
        dk_acc_ref[...] = jnp.zeros_like(dk_acc_ref)
        dv_acc_ref[...] = jnp.zeros_like(dv_acc_ref)

    def update(mask):
        q, dout = q_ref[...], dout_ref[...]
        p = _probabilities(q, k_ref[...], lse_ref[...], scale, mask)
        dv_acc_ref[...] += _dot(p.astype(dout.dtype), dout, ((0,), (0,)))
        dp = _dot(dout, v_ref[...], ((1,), (1,)))
        ds = p * (dp - di_ref[...])
        dk_acc_ref[...] += _dot(ds.astype(q.dtype), q, ((0,), (0,)))

    _update_visible(
        update,
        q_block,
        kv_block,
        causal=causal,
        kv_len=kv_len,
        num_kv_blocks=num_kv_blocks,
        delta=delta,
        q_seg_ref=q_seg_ref,
        kv_seg_ref=kv_seg_ref,
    )

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


def backward(
    q,
    k,
    v,
    segment_ids,
    offset_delta,
    out,
    lse,
    dout,
    *,
    causal: bool,
    scale: float,
    interpret: bool = False,
    dlse=None,
):
    """Returns (dq, dk, dv) in the dtypes of q, k, v."""
    batch, q_len, heads_q, dim = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    q_padded, kv_padded = common.round_up(q_len, BLOCK), common.round_up(kv_len, BLOCK)
    num_q_blocks, num_kv_blocks = q_padded // BLOCK, kv_padded // BLOCK
    qt, doutt = _to_heads_major(q, q_padded), _to_heads_major(dout, q_padded)
    kt, vt = _to_heads_major(k, kv_padded), _to_heads_major(v, kv_padded)
    di = common.softmax_delta(out, dout, dlse)
    pad = ((0, 0), (0, 0), (0, q_padded - q_len))
    di = jnp.pad(di, pad)[..., None]
    # Fully masked rows (lse = -inf) are zeroed by the mask; padded rows by lse = +inf.
    lse = jnp.pad(lse, pad, constant_values=jnp.inf)[..., None]
    has_segment_ids = segment_ids is not None
    segments = _segment_operands(segment_ids, q_padded) if has_segment_ids else ()
    offsets = jnp.asarray(offset_delta, jnp.int32).reshape(1)
    row_block = pl.BlockSpec((None, None, BLOCK, dim), lambda b, h, i, j, d: (b, h, i, 0))
    column_block = pl.BlockSpec((None, None, BLOCK, 1), lambda b, h, i, j, d: (b, h, i, 0))

    def kv_map(b, h, i, j, delta_ref):
        if causal:
            j = jnp.minimum(j, _last_visible_kv_block(i, delta_ref[0], num_kv_blocks))
        return b, h // group, j, 0

    in_specs = [
        row_block,
        pl.BlockSpec((None, None, BLOCK, dim), kv_map),
        pl.BlockSpec((None, None, BLOCK, dim), kv_map),
        row_block,
        column_block,
        column_block,
    ]
    if has_segment_ids:
        in_specs += [
            pl.BlockSpec((None, BLOCK, 1), lambda b, h, i, j, d: (b, i, 0)),
            pl.BlockSpec((None, 1, BLOCK), lambda b, h, i, j, d: (b, 0, kv_map(b, h, i, j, d)[2])),
        ]
    dq = pl.pallas_call(
        functools.partial(
            _dq_kernel,
            causal=causal,
            has_segment_ids=has_segment_ids,
            scale=scale,
            kv_len=kv_len,
            num_kv_blocks=num_kv_blocks,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, heads_q, num_q_blocks, num_kv_blocks),
            in_specs=in_specs,
            out_specs=row_block,
            scratch_shapes=[pltpu.VMEM((BLOCK, dim), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=_COMPILER_PARAMS,
        interpret=_interpret(interpret),
        name="sf_flash_attention_dq_tpu",
    )(offsets, qt, kt, vt, doutt, lse, di, *segments)

    # dk/dv: step t of the innermost axis is q head h * group + t // nq, q block t % nq.
    def q_map(b, h, j, t, delta_ref):
        i = t % num_q_blocks
        if causal:
            i = jnp.maximum(i, _first_visible_q_block(j, delta_ref[0], num_q_blocks))
        return b, h * group + t // num_q_blocks, i, 0

    def q_column_map(b, h, j, t, delta_ref):
        return q_map(b, h, j, t, delta_ref)[:3] + (0,)

    kv_block = pl.BlockSpec((None, None, BLOCK, dim), lambda b, h, j, t, d: (b, h, j, 0))
    in_specs = [
        pl.BlockSpec((None, None, BLOCK, dim), q_map),
        kv_block,
        kv_block,
        pl.BlockSpec((None, None, BLOCK, dim), q_map),
        pl.BlockSpec((None, None, BLOCK, 1), q_column_map),
        pl.BlockSpec((None, None, BLOCK, 1), q_column_map),
    ]
    if has_segment_ids:
        in_specs += [
            pl.BlockSpec((None, BLOCK, 1), lambda b, h, j, t, d: (b, q_map(b, h, j, t, d)[2], 0)),
            pl.BlockSpec((None, 1, BLOCK), lambda b, h, j, t, d: (b, 0, j)),
        ]
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkv_kernel,
            causal=causal,
            has_segment_ids=has_segment_ids,
            scale=scale,
            kv_len=kv_len,
            num_q_blocks=num_q_blocks,
            num_kv_blocks=num_kv_blocks,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, heads_kv, num_kv_blocks, group * num_q_blocks),
            in_specs=in_specs,
            out_specs=[kv_block, kv_block],
            scratch_shapes=[pltpu.VMEM((BLOCK, dim), jnp.float32), pltpu.VMEM((BLOCK, dim), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(kt.shape, k.dtype), jax.ShapeDtypeStruct(vt.shape, v.dtype)],
        compiler_params=_COMPILER_PARAMS,
        interpret=_interpret(interpret),
        name="sf_flash_attention_dkv_tpu",
    )(offsets, qt, kt, vt, doutt, lse, di, *segments)
    return _from_heads_major(dq, q_len), _from_heads_major(dk, kv_len), _from_heads_major(dv, kv_len)
