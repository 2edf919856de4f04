"""Blockwise attention in plain XLA: the portable reference path.

A `lax.scan` over kv blocks with an online softmax, so the largest intermediate is
``[batch, heads_q, seq_q, block_k]`` rather than ``seq_q x seq_kv``. The backward pass scans the
same blocks, recomputing probabilities from the saved lse (flash-attention style): dq is carried,
dk/dv come out per block. GQA is computed on a ``[.., heads_kv, group, ..]`` view of q, so K/V are
never repeated. Conventions: see attention_common.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import attention_common as common

DEFAULT_BLOCK_K = 512


def _precision(dtype):
    # Keep fp32 attention fp32 on GPUs, whose default fp32 matmul is tf32.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _kv_blocks(x, block_k):
    """[B, S, H, D] -> [num_blocks, B, block_k, H, D], zero padded."""
    batch, seq, heads, dim = x.shape
    padded = common.round_up(seq, block_k)
    x = jnp.pad(x, ((0, 0), (0, padded - seq), (0, 0), (0, 0)))
    return x.reshape(batch, padded // block_k, block_k, heads, dim).swapaxes(0, 1)


def _block_mask(kv_block_index, *, q_len, kv_len, block_k, causal, offset_delta, segment_ids, kv_segment_blocks):
    """[B or 1, q_len, block_k] visibility of this kv block, or None."""
    q_index = jnp.arange(q_len)
    kv_index = kv_block_index * block_k + jnp.arange(block_k)
    needs_len_mask = kv_len % block_k != 0
    mask = common.element_mask(
        q_index, kv_index, causal=causal, kv_len=kv_len if needs_len_mask else None, offset_delta=offset_delta
    )
    mask = None if mask is None else mask[None]
    if segment_ids is not None:
        same = common.segment_pair(segment_ids)[0][:, :, None] == kv_segment_blocks[kv_block_index][:, None, :]
        mask = same if mask is None else jnp.logical_and(mask, same)
    return mask


def _setup(q, k, segment_ids, block_k):
    batch, q_len, heads_q, dim = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    block_k = min(block_k, common.round_up(kv_len, 8))
    kv_segment_blocks = None
    if segment_ids is not None:
        padded = common.round_up(kv_len, block_k)
        kv_segment_blocks = jnp.pad(
            common.segment_pair(segment_ids)[1], ((0, 0), (0, padded - kv_len)), constant_values=-1
        )
        kv_segment_blocks = kv_segment_blocks.reshape(batch, -1, block_k).swapaxes(0, 1)
    group = heads_q // heads_kv
    return block_k, kv_segment_blocks, group


def forward(q, k, v, segment_ids, offset_delta, *, causal: bool, scale: float, block_k: int = DEFAULT_BLOCK_K):
    """Returns (out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] float32)."""
    batch, q_len, heads_q, dim = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    block_k, kv_segment_blocks, group = _setup(q, k, segment_ids, block_k)
    precision = _precision(q.dtype)
    qg = q.reshape(batch, q_len, heads_kv, group, dim)
    k_blocks, v_blocks = _kv_blocks(k, block_k), _kv_blocks(v, block_k)
    num_blocks = k_blocks.shape[0]

    def step(carry, inputs):
        acc, row_max, row_sum = carry  # acc [B,Hkv,G,Sq,D]; stats [B,Hkv,G,Sq]
        block_index, k_blk, v_blk = inputs
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_blk, precision=precision, preferred_element_type=jnp.float32) * scale
        mask = _block_mask(
            block_index,
            q_len=q_len,
            kv_len=kv_len,
            block_k=block_k,
            causal=causal,
            offset_delta=offset_delta,
            segment_ids=segment_ids,
            kv_segment_blocks=kv_segment_blocks,
        )
        if mask is not None:
            s = jnp.where(mask[:, None, None], s, -jnp.inf)
        new_max = jnp.maximum(row_max, s.max(-1))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # fully masked so far
        correction = jnp.exp(row_max - safe_max)
        p = jnp.exp(s - safe_max[..., None])
        row_sum = row_sum * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "bhgqk,bkhd->bhgqd", p.astype(v.dtype), v_blk, precision=precision, preferred_element_type=jnp.float32
        )
        return (acc, new_max, row_sum), None

    stats_shape = (batch, heads_kv, group, q_len)
    init = (
        jnp.zeros(stats_shape + (dim,), jnp.float32),
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
    )
    (acc, row_max, row_sum), _ = lax.scan(step, init, (jnp.arange(num_blocks), k_blocks, v_blocks))
    empty = row_sum == 0.0
    out = acc / jnp.where(empty, 1.0, row_sum)[..., None]
    lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, heads_q, dim).astype(q.dtype)
    return out, lse.reshape(batch, heads_q, q_len)


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
    block_k: int = DEFAULT_BLOCK_K,
    dlse=None,
):
    """Returns (dq, dk, dv) in the dtypes of q, k, v."""
    batch, q_len, heads_q, dim = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    block_k, kv_segment_blocks, group = _setup(q, k, segment_ids, block_k)
    precision = _precision(q.dtype)
    qg = q.reshape(batch, q_len, heads_kv, group, dim)
    doutg = dout.reshape(batch, q_len, heads_kv, group, dim)
    delta = common.softmax_delta(out, dout, dlse)
    delta = delta.reshape(batch, heads_kv, group, q_len)
    lse = lse.reshape(batch, heads_kv, group, q_len)
    k_blocks, v_blocks = _kv_blocks(k, block_k), _kv_blocks(v, block_k)
    num_blocks = k_blocks.shape[0]

    def step(dq, inputs):
        block_index, k_blk, v_blk = inputs
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_blk, precision=precision, preferred_element_type=jnp.float32) * scale
        p = jnp.exp(s - lse[..., None])
        mask = _block_mask(
            block_index,
            q_len=q_len,
            kv_len=kv_len,
            block_k=block_k,
            causal=causal,
            offset_delta=offset_delta,
            segment_ids=segment_ids,
            kv_segment_blocks=kv_segment_blocks,
        )
        if mask is not None:
            # Also turns exp(s + inf) of fully masked rows (lse = -inf) into 0.
            p = jnp.where(mask[:, None, None], p, 0.0)
        dv_blk = jnp.einsum(
            "bhgqk,bqhgd->bkhd", p.astype(dout.dtype), doutg, precision=precision, preferred_element_type=jnp.float32
        )
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", doutg, v_blk, precision=precision, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., None])).astype(q.dtype)
        dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_blk, precision=precision, preferred_element_type=jnp.float32)
        dk_blk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, precision=precision, preferred_element_type=jnp.float32)
        return dq, (dk_blk, dv_blk)

    dq0 = jnp.zeros((batch, q_len, heads_kv, group, dim), jnp.float32)
    dq, (dk_blocks, dv_blocks) = lax.scan(step, dq0, (jnp.arange(num_blocks), k_blocks, v_blocks))

    def unblock(x):
        return x.swapaxes(0, 1).reshape(batch, -1, heads_kv, dim)[:, :kv_len]

    dq = (dq * scale).reshape(batch, q_len, heads_q, dim).astype(q.dtype)
    dk = (unblock(dk_blocks) * scale).astype(k.dtype)
    dv = unblock(dv_blocks).astype(v.dtype)
    return dq, dk, dv
