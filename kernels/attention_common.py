"""Block arithmetic shared by every attention implementation.

Conventions used throughout ``shardflow.kernels``:

* q, k, v, out, dout: ``[batch, seq, heads, head_dim]``; q has ``heads_q`` heads, k/v have
  ``heads_kv`` and q head ``h`` reads kv head ``h // (heads_q // heads_kv)``.
* lse: ``[batch, heads_q, seq_q]``, float32, natural log; ``-inf`` for a fully masked row.
* ``offset_delta = q_offset - kv_offset``. The causal rule "global query position >= global key
  position" is ``i + offset_delta >= j`` in local indices, so only the difference matters. It is
  a Python int when static and an int32 scalar array when traced.
* segment_ids: ``[batch, seq]`` int32, shared by queries and keys (requires seq_q == seq_kv);
  a query sees a key only when both carry the same id.

The helpers below compute, for one q block (or one kv block), which blocks of the other side can
contain a visible entry and which are visible in full, so that kernels skip fully masked blocks
and apply the mask only on the boundary. They work on Python ints and on traced int32 scalars
alike, and use only non-negative integer division (Triton's `lax.div` truncates).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


def _floor_div_nonneg(x, d: int):
    """floor(max(x, 0) / d) for a Python int or an int32 scalar."""
    if isinstance(x, int):
        return max(x, 0) // d
    return lax.div(jnp.maximum(x, 0), jnp.int32(d))


def _min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return jnp.minimum(a, b)


def _max(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return jnp.maximum(a, b)


def kv_block_range(
    q_start,
    *,
    block_q: int,
    block_k: int,
    num_kv_blocks: int,
    kv_len: int,
    causal: bool,
    has_segment_ids: bool,
    offset_delta,
):
    """(num_full, end) for the q block starting at row q_start.

    kv blocks [0, num_full) are visible to every row of the q block (no mask needed), blocks
    [num_full, end) need the element mask, blocks from `end` on are fully masked and skipped.
    """
    end = num_kv_blocks
    num_full = kv_len // block_k  # a partial last kv block holds padding
    if causal:
        # Row i sees keys j <= i + offset_delta.
        last_row_visible_end = q_start + block_q + offset_delta  # exclusive
        end = _min(_floor_div_nonneg(last_row_visible_end + block_k - 1, block_k), end)
        num_full = _min(_floor_div_nonneg(q_start + offset_delta + 1, block_k), num_full)
    if has_segment_ids:
        num_full = 0
    return _min(num_full, end), end


def q_block_range(
    kv_start, *, block_q: int, block_k: int, num_q_blocks: int, causal: bool, has_segment_ids: bool, offset_delta
):
    """(begin, begin_full) for the kv block starting at key kv_start.

    q blocks [begin, begin_full) need the element mask, [begin_full, num_q_blocks) see the whole
    kv block, blocks before `begin` see none of it. Padded query rows need no mask: their
    cotangent is zero and their lse is +inf, so they contribute nothing.
    """
    begin, begin_full = 0, 0
    if causal:
        begin = _min(_floor_div_nonneg(kv_start - offset_delta, block_q), num_q_blocks)
        first_full = _floor_div_nonneg(kv_start + block_k - 1 - offset_delta + block_q - 1, block_q)
        begin_full = _min(_max(first_full, begin), num_q_blocks)
    if has_segment_ids:
        begin_full = num_q_blocks
    return begin, begin_full


def element_mask(
    q_index, kv_index, *, causal: bool, kv_len: int | None, offset_delta, q_segment_ids=None, kv_segment_ids=None
):
    """Visibility of keys kv_index[None, :] to queries q_index[:, None] (None: all visible)."""
    mask = None

    def conj(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if causal:
        mask = conj(mask, q_index[:, None] + offset_delta >= kv_index[None, :])
    if kv_len is not None:
        mask = conj(mask, jnp.broadcast_to(kv_index[None, :] < kv_len, (q_index.shape[0], kv_index.shape[0])))
    if q_segment_ids is not None:
        mask = conj(mask, q_segment_ids[:, None] == kv_segment_ids[None, :])
    return mask


def softmax_delta(out, dout, dlse=None):
    """delta [B, Hq, Sq] float32 of the backward, ds = p (dp - delta): delta_i = sum_d dout_id
    out_id; a cotangent of lse enters as -dlse because d lse / d s = p."""
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))
    return delta if dlse is None else delta - dlse


def segment_pair(segment_ids):
    """(q ids, kv ids): ``segment_ids`` is one [B, S] array for both (self-attention) or that
    pair (a ring's block of queries against another device's block of keys)."""
    return segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
