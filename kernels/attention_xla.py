"""Blockwise attention in plain XLA: the portable reference path.

Loops over blocks with an online softmax, so the largest intermediate is ``[batch, heads_q,
block_q, block_k]`` rather than ``seq_q x seq_kv``. Causal, the queries go in blocks too, and a
pair of blocks wholly in the future is never computed (half the work of a square mask). The
backward scans the K/V blocks, each over the q blocks that see it, recomputing probabilities
from the saved lse (flash-attention style): dq accumulates per q block, dk/dv come out per K/V
block. GQA is computed on a ``[.., heads_kv, group, ..]`` view of q, so K/V are never repeated.
Conventions: see attention_common.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import attention_common as common

DEFAULT_BLOCK_K = 512
DEFAULT_BLOCK_Q = 512  # causal only: without a mask to skip by, all queries form one block


def _precision(dtype):
    # Keep fp32 attention fp32 on GPUs, whose default fp32 matmul is tf32.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _kv_blocks(x, block_k):
    """[B, S, H, D] -> [num_blocks, B, block_k, H, D], zero padded."""
    batch, seq, heads, dim = x.shape
    padded = common.round_up(seq, block_k)
    x = jnp.pad(x, ((0, 0), (0, padded - seq), (0, 0), (0, 0)))
    return x.reshape(batch, padded // block_k, block_k, heads, dim).swapaxes(0, 1)


def _q_blocks(x, block_q, fill=0.0):
    """[B, S, ...] -> [num_blocks, B, block_q, ...], padded with ``fill``."""
    padded = common.round_up(x.shape[1], block_q)
    x = jnp.pad(x, [(0, 0), (0, padded - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return x.reshape(x.shape[0], padded // block_q, block_q, *x.shape[2:]).swapaxes(0, 1)


class _Blocks:
    """The blocks both passes visit: q rows in blocks of ``block_q`` (causal: so that each q
    block skips the K/V blocks past its last query, and each K/V block the q blocks before its
    first; else one block of every row), keys in blocks of ``block_k``, and the mask of a pair."""

    def __init__(self, q, k, segment_ids, offset_delta, *, causal, block_q, block_k):
        batch, q_len = q.shape[:2]
        self.kv_len = k.shape[1]
        self.block_k = min(block_k, common.round_up(self.kv_len, 8))
        self.block_q = min(block_q, common.round_up(q_len, 8)) if causal else q_len
        self.num_q = -(-q_len // self.block_q)
        self.num_kv = -(-self.kv_len // self.block_k)
        self.causal, self.offset_delta = causal, offset_delta
        self.segments = None
        if segment_ids is not None:
            q_ids, kv_ids = common.segment_pair(segment_ids)
            kv_ids = jnp.pad(kv_ids, ((0, 0), (0, self.num_kv * self.block_k - self.kv_len)), constant_values=-1)
            self.segments = (
                _q_blocks(q_ids, self.block_q, fill=-1),
                kv_ids.reshape(batch, self.num_kv, -1).swapaxes(0, 1),
            )

    def ranges(self, **kw):
        return dict(causal=self.causal, has_segment_ids=self.segments is not None, offset_delta=self.offset_delta, **kw)

    def kv_end(self, i):
        """K/V blocks [0, end) hold a key q block ``i`` sees."""
        _, end = common.kv_block_range(
            i * self.block_q,
            **self.ranges(block_q=self.block_q, block_k=self.block_k, num_kv_blocks=self.num_kv, kv_len=self.kv_len),
        )
        return end

    def q_begin(self, j):
        """q blocks [begin, num_q) hold a query that sees a key of K/V block ``j``."""
        begin, _ = common.q_block_range(
            j * self.block_k, **self.ranges(block_q=self.block_q, block_k=self.block_k, num_q_blocks=self.num_q)
        )
        return begin

    def mask(self, i, j):
        """[B or 1, block_q, block_k] visibility of K/V block ``j`` to q block ``i``, or None."""
        q_index = i * self.block_q + jnp.arange(self.block_q)
        kv_index = j * self.block_k + jnp.arange(self.block_k)
        mask = common.element_mask(
            q_index,
            kv_index,
            causal=self.causal,
            kv_len=self.kv_len if self.kv_len % self.block_k else None,
            offset_delta=self.offset_delta,
        )
        mask = None if mask is None else mask[None]
        if self.segments is not None:
            q_ids, kv_ids = self.segments
            same = q_ids[i][:, :, None] == kv_ids[j][:, None, :]
            mask = same if mask is None else jnp.logical_and(mask, same)
        return mask


def forward(
    q,
    k,
    v,
    segment_ids,
    offset_delta,
    *,
    causal: bool,
    scale: float,
    block_k: int = DEFAULT_BLOCK_K,
    block_q: int = DEFAULT_BLOCK_Q,
):
    """Returns (out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] float32)."""
    batch, q_len, heads_q, dim = q.shape
    heads_kv = k.shape[2]
    group = heads_q // heads_kv
    blocks = _Blocks(q, k, segment_ids, offset_delta, causal=causal, block_q=block_q, block_k=block_k)
    precision = _precision(q.dtype)
    q_blocks = _q_blocks(q.reshape(batch, q_len, heads_kv, group, dim), blocks.block_q)
    k_blocks, v_blocks = _kv_blocks(k, blocks.block_k), _kv_blocks(v, blocks.block_k)

    def attend(i):
        qg = q_blocks[i]

        def step(j, carry):
            acc, row_max, row_sum = carry  # acc [B,Hkv,G,bq,D]; stats [B,Hkv,G,bq]
            s = jnp.einsum(
                "bqhgd,bkhd->bhgqk", qg, k_blocks[j], precision=precision, preferred_element_type=jnp.float32
            )
            s = s * scale
            mask = blocks.mask(i, j)
            if mask is not None:
                s = jnp.where(mask[:, None, None], s, -jnp.inf)
            new_max = jnp.maximum(row_max, s.max(-1))
            safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # fully masked so far
            correction = jnp.exp(row_max - safe_max)
            p = jnp.exp(s - safe_max[..., None])
            row_sum = row_sum * correction + p.sum(-1)
            pv = jnp.einsum(
                "bhgqk,bkhd->bhgqd",
                p.astype(v.dtype),
                v_blocks[j],
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            return acc * correction[..., None] + pv, new_max, row_sum

        stats_shape = (batch, heads_kv, group, blocks.block_q)
        init = (
            jnp.zeros(stats_shape + (dim,), jnp.float32),
            jnp.full(stats_shape, -jnp.inf, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
        )
        acc, row_max, row_sum = lax.fori_loop(0, blocks.kv_end(i), step, init)
        empty = row_sum == 0.0
        out = acc / jnp.where(empty, 1.0, row_sum)[..., None]
        lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))
        return out, lse

    out, lse = lax.map(attend, jnp.arange(blocks.num_q))  # [num_q, B, Hkv, G, bq, (D)]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, -1, heads_q, dim)[:, :q_len].astype(q.dtype)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(batch, heads_q, -1)[:, :, :q_len]
    return out, lse


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
    block_q: int = DEFAULT_BLOCK_Q,
    dlse=None,
):
    """Returns (dq, dk, dv) in the dtypes of q, k, v: a scan over K/V blocks, each over the q
    blocks that see it, dq accumulated per q block."""
    batch, q_len, heads_q, dim = q.shape
    kv_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    blocks = _Blocks(q, k, segment_ids, offset_delta, causal=causal, block_q=block_q, block_k=block_k)
    precision = _precision(q.dtype)
    q_blocks = _q_blocks(q.reshape(batch, q_len, heads_kv, group, dim), blocks.block_q)
    dout_blocks = _q_blocks(dout.reshape(batch, q_len, heads_kv, group, dim), blocks.block_q)

    def by_rows(x, fill):  # [B, Hq, Sq] -> [num_q, B, Hkv, G, bq]
        x = _q_blocks(x.reshape(batch, heads_kv, group, q_len).transpose(0, 3, 1, 2), blocks.block_q, fill)
        return x.transpose(0, 1, 3, 4, 2)

    # A padded query row has lse +inf (p = 0) and dout 0: it adds nothing.
    lse_blocks = by_rows(lse, jnp.inf)
    delta_blocks = by_rows(common.softmax_delta(out, dout, dlse), 0.0)
    k_blocks, v_blocks = _kv_blocks(k, blocks.block_k), _kv_blocks(v, blocks.block_k)

    def kv_step(dq, j):
        k_blk, v_blk = k_blocks[j], v_blocks[j]

        def q_step(i, carry):
            dq, dk_blk, dv_blk = carry
            qg, doutg = q_blocks[i], dout_blocks[i]
            s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_blk, precision=precision, preferred_element_type=jnp.float32)
            p = jnp.exp(s * scale - lse_blocks[i][..., None])
            mask = blocks.mask(i, j)
            if mask is not None:
                # Also turns exp(s + inf) of fully masked rows (lse = -inf) into 0.
                p = jnp.where(mask[:, None, None], p, 0.0)
            dv_blk = dv_blk + jnp.einsum(
                "bhgqk,bqhgd->bkhd",
                p.astype(dout.dtype),
                doutg,
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", doutg, v_blk, precision=precision, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_blocks[i][..., None])).astype(q.dtype)
            dq_i = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_blk, precision=precision, preferred_element_type=jnp.float32)
            dk_blk = dk_blk + jnp.einsum(
                "bhgqk,bqhgd->bkhd", ds, qg, precision=precision, preferred_element_type=jnp.float32
            )
            return dq.at[i].add(dq_i), dk_blk, dv_blk

        zeros = jnp.zeros((batch, blocks.block_k, heads_kv, dim), jnp.float32)
        dq, dk_blk, dv_blk = lax.fori_loop(blocks.q_begin(j), blocks.num_q, q_step, (dq, zeros, zeros))
        return dq, (dk_blk, dv_blk)

    dq0 = jnp.zeros(q_blocks.shape, jnp.float32)
    dq, (dk_blocks, dv_blocks) = lax.scan(kv_step, dq0, jnp.arange(blocks.num_kv))

    def unblock(x, length):
        return x.swapaxes(0, 1).reshape(batch, -1, *x.shape[3:])[:, :length]

    dq = (unblock(dq, q_len) * scale).reshape(batch, q_len, heads_q, dim).astype(q.dtype)
    dk = (unblock(dk_blocks, kv_len) * scale).astype(k.dtype)
    dv = unblock(dv_blocks, kv_len).astype(v.dtype)
    return dq, dk, dv
