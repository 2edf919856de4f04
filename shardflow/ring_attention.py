"""Ring attention: attention whose sequence is split over mesh axes, K/V passed around them.

Each device holds one block of the queries and one of the keys and values (block r of n along
the sequence, in mesh order over the ring's axes). The forward attends the local queries to the
local K/V block, passes that block to the next device and attends to the one it receives, n
times, merging the partial outputs by their log-sum-exp; nothing holds the whole K/V. The
backward passes K/V around again, the dK/dV accumulated for a block travelling with it and
sent home at the end; dQ stays. Each block's backward is exact on its own, as flash attention's
is: it takes the whole row's output and log-sum-exp (Liu et al., Ring Attention, 2023).

Causal masks follow the blocks' global positions (the kernels' ``q_offset`` / ``kv_offset``);
a block entirely in a query block's future is skipped (``lax.cond``). With contiguous blocks
that leaves device n-1 with n blocks of work and device 0 with one (zigzag and striped layouts,
which balance it, are not built yet). Segment ids are not supported on a ring (queries and keys
would need their own).

Every step's ppermute is independent of that step's attention, so XLA may run them together.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def _ring(axes, sizes):
    n = math.prod(sizes[a] for a in axes)
    return n, lax.axis_index(axes), [(j, (j + 1) % n) for j in range(n)]


def _masked(causal, q_offset, sq, kv_offset):
    """Whether a K/V block starting at ``kv_offset`` lies wholly after every query of the block
    [q_offset, q_offset + sq)."""
    return jnp.asarray(causal) & (kv_offset > q_offset + sq - 1)


def _merge(out, lse, out_j, lse_j):
    """Two partial attentions over disjoint keys, merged by their log-sum-exps (-inf: none)."""
    new = jnp.logaddexp(lse, lse_j)
    finite = jnp.isfinite(new)

    def weight(l):   # [b, h, s] -> [b, s, h, 1]
        w = jnp.where(finite, jnp.exp(l - jnp.where(finite, new, 0.0)), 0.0)
        return jnp.swapaxes(w, 1, 2)[..., None]

    return out * weight(lse) + out_j.astype(jnp.float32) * weight(lse_j), new


def forward(attend, q, k, v, *, causal, q_offset, kv_offset, axes, sizes):
    """(out, lse) of this device's query block against every K/V block of the ring.

    ``attend(q, k, v, q_offset, kv_offset) -> (out, lse)`` is one block's attention;
    ``q_offset`` is this query block's global position, ``kv_offset`` that of K/V block 0."""
    n, r, perm = _ring(axes, sizes)
    b, sq, h, _ = q.shape
    out = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.full((b, h, sq), -jnp.inf, jnp.float32)
    for j in range(n):
        src = (r - j) % n
        offset = kv_offset + src * k.shape[1]
        if j < n - 1:
            k_next, v_next = lax.ppermute((k, v), axes, perm)
        out_j, lse_j = lax.cond(
            _masked(causal, q_offset, sq, offset),
            lambda: (jnp.zeros(q.shape, q.dtype), jnp.full((b, h, sq), -jnp.inf, jnp.float32)),
            lambda: attend(q, k, v, q_offset, offset))
        out, lse = _merge(out, lse, out_j, lse_j)
        if j < n - 1:
            k, v = k_next, v_next
    return out.astype(q.dtype), lse


def backward(attend_bwd, q, k, v, out, lse, dout, dlse, *, causal, q_offset, kv_offset, axes, sizes):
    """(dq, dk, dv) of this device's blocks. ``attend_bwd(q, k, v, out, lse, dout, dlse,
    q_offset, kv_offset) -> (dq, dk, dv)`` is one block's backward given the whole rows' out
    and lse; dk / dv of a block are summed as it travels, then sent home."""
    n, r, perm = _ring(axes, sizes)
    sq = q.shape[1]
    dq = jnp.zeros(q.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for j in range(n):
        src = (r - j) % n
        offset = kv_offset + src * k.shape[1]
        if j < n - 1:
            k_next, v_next = lax.ppermute((k, v), axes, perm)
        dq_j, dk_j, dv_j = lax.cond(
            _masked(causal, q_offset, sq, offset),
            lambda: (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype)),
            lambda: attend_bwd(q, k, v, out, lse, dout, dlse, q_offset, offset))
        dq, dk, dv = dq + dq_j, dk + dk_j, dv + dv_j
        # block src's sums move on with it; after the last step they go home (src + 1 -> ... -> src)
        dk, dv = lax.ppermute((dk, dv), axes, perm)
        if j < n - 1:
            k, v = k_next, v_next
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

