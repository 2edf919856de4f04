"""Ring attention: attention whose sequence is split over mesh axes, K/V passed around them.

Each device holds one block of the queries and one of the keys and values (block r of n along
the sequence, in mesh order over the ring's axes). The forward attends the local queries to the
local K/V block, passes that block to the next device and attends to the one it receives, n
times, merging the partial outputs by their log-sum-exp; nothing holds the whole K/V. The
backward passes K/V around again, the dK/dV accumulated for a block travelling with it and
sent home at the end; dQ stays. Each block's backward is exact on its own, as flash attention's
is: it takes the whole row's output and log-sum-exp (Liu et al., Ring Attention, 2023).

Causal masks follow the tokens' global positions (the kernels' ``q_offset`` / ``kv_offset``).
With static offsets every (query part, key part) pair of a step is wholly visible, wholly
masked (skipped) or on the diagonal, known from the two block indices, so every kernel call
has a static mask: a step runs its masks' calls on chunks sliced at the device's offsets where
every device has the same masks (zigzag), else it is one ``lax.switch`` over the kinds it can
be on some device (``_step``). Which positions a block holds is the sequence's :class:`Layout`:

- contiguous: block r holds positions [r L, (r+1) L). Causal work is unbalanced: device r has
  r + 1/2 blocks of it, the last device about twice the mean.
- zigzag: block r holds chunks r and 2n-1-r of 2n (Brandon et al., 2023): every device the
  same causal work, 2n - 1 of its 4n chunk pairs unmasked or half masked.
- striped: block r holds positions r, r + n, r + 2n, ... (Brandon et al., Striped Attention):
  every pair of blocks is nearly half masked, a kernel call each with a diagonal shifted by 0
  or 1.

The same steps run on K/V gathered instead of passed (``gather=True``, the attention's
``context="all_gather"`` with a layout): one all-gather of every block, in flight while the
device attends to its own, then no collective in the forward; the backward ends on the own
block, so the dK/dV sums passed around the ring arrive home whole (no last hop), sent in K's
and V's dtypes. The device then holds the whole K/V for the attention's duration; the ring
never does. Measured faster at 64k and 128k tokens on 4 GPUs (benchmarks/results/context.md).

The layout is applied to the tokens once (``Layout.permute``, e.g. by the data loader, with the
RoPE positions permuted alike); attention on one device un-permutes, attends and permutes back,
so a program means the same on any mesh. Segment ids travel with their K/V block.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LAYOUTS = ("zigzag", "striped")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the tokens of a sequence are ordered for a ring of ``blocks`` devices."""

    kind: str
    blocks: int

    def __post_init__(self):
        if self.kind not in LAYOUTS or not (isinstance(self.blocks, int) and self.blocks >= 1):
            raise ValueError(
                f"layout: kind one of {LAYOUTS} and blocks a positive int, got {self.kind!r}, {self.blocks!r}"
            )

    def positions(self, seq: int) -> np.ndarray:
        """The global position of the token at each stored index of a sequence of ``seq``."""
        n = self.blocks
        chunks = 2 * n if self.kind == "zigzag" else n
        if seq % chunks:
            raise ValueError(
                f"layout {self.kind} over {n} blocks: a sequence of {seq} does not split into {chunks} chunks"
            )
        index = np.arange(seq)
        if self.kind == "striped":
            length = seq // n
            return (index % length) * n + index // length
        c = seq // chunks
        order = [x for r in range(n) for x in (r, chunks - 1 - r)]
        return np.concatenate([np.arange(k * c, (k + 1) * c) for k in order])

    def permute(self, x, axis: int = 1):
        """Natural order -> this layout, along ``axis`` (tokens, targets, RoPE tables)."""
        return jnp.take(x, self.positions(x.shape[axis]), axis=axis)

    def unpermute(self, x, axis: int = 1):
        return jnp.take(x, np.argsort(self.positions(x.shape[axis])), axis=axis)


class Part(NamedTuple):
    """A contiguous run of a block's stored tokens: ``[start, start + length)`` of the block,
    at global position ``offset`` (traced, or a Python int for a Python block index). ``start``
    is traced only in a step's slot (``_pick``), where devices compute different pairs."""

    start: object
    length: int
    offset: object


def parts(layout: Layout | None, block, length: int, base) -> list[Part]:
    """The contiguous runs of positions in block ``block`` of ``length`` stored tokens;
    ``base``: the global position of the sequence's first token. A striped block is not a
    run: its one part's offset is its block index, which shifts the causal diagonal instead
    (0 for blocks at or before this one, 1 after), see ``_mask``."""
    if layout is None:
        return [Part(0, length, base + block * length)]
    if layout.kind == "zigzag":
        c = length // 2
        return [Part(0, c, base + block * c), Part(c, c, base + (2 * layout.blocks - 1 - block) * c)]
    return [Part(0, length, block)]


# What a (query part, key part) pair attends: nothing (SKIP), every key (FULL), keys up to the
# causal diagonal at a static offset difference (an int: q_offset - kv_offset), or at traced
# offsets (a pair of int32 scalars). All but the last are static masks, which the Mosaic GPU
# kernel takes (for the difference 0).
SKIP, FULL = None, "full"


def _mask(causal, layout, qp: Part, kp: Part):
    """The static mask of a pair whose offsets are Python ints."""
    if not causal:
        return FULL
    if layout is not None and layout.kind == "striped":
        # q token i is at i n + r, key j of block s at j n + s: visible iff j <= i (s <= r) or
        # j < i (s > r) — the causal diagonal of the local indices, or that diagonal shifted.
        return 0 if kp.offset <= qp.offset else -1
    if kp.offset > qp.offset + qp.length - 1:
        return SKIP
    if kp.offset + kp.length - 1 <= qp.offset:
        return FULL
    return qp.offset - kp.offset


def _step_kinds(causal, layout, n, q_len, kv_len, q_base, kv_base):
    """With static bases, (table, kinds): ``kinds[table[q block, kv block]]`` is the masks of
    a ring step's pairs (kv parts outer, q parts inner), one tuple per distinct step. None
    for causal attention at traced bases."""
    if causal and not (isinstance(q_base, int) and isinstance(kv_base, int)):
        return None
    kinds, table = {}, np.zeros((n, n), np.int32)
    for r in range(n):
        for s in range(n):
            masks = tuple(
                _mask(causal, layout, qp, kp)
                for kp in parts(layout, s, kv_len, kv_base)
                for qp in parts(layout, r, q_len, q_base)
            )
            table[r, s] = kinds.setdefault(masks, len(kinds))
    return table, list(kinds)


def _step(plan, pairs, q_block, j, run, skipped):
    """The computed pairs of ring step ``j`` (kv block q_block - j): ``(q part, kv part,
    run(q part, kv part, mask))`` each, or ``skipped(q part, kv part)`` where a branch must
    return something for a pair it does not compute. With a plan, by how the step's kinds on
    the devices differ:

    - one kind (step 0: every device's own block): its unmasked pairs, no branch;
    - the same masks on every device, on other pairs (zigzag: each device attends two of its
      four chunk pairs unmasked, which two depends on the device): one kernel call per mask
      (a *slot*), its operands sliced at the device's pair's offsets, no branch;
    - else one ``lax.switch`` over the kinds present, so the step is one conditional (XLA's
      scheduler then overlaps a collective with all of it).

    Without a plan, a cond per pair on whether its traced offsets mask it wholly."""

    def fixed(masks, keep_skipped):
        return [
            (qp, kp, run(qp, kp, m)) if m is not SKIP else (qp, kp, skipped(qp, kp))
            for (qp, kp), m in zip(pairs, masks)
            if m is not SKIP or keep_skipped
        ]

    if plan is not None:
        table, kinds = plan
        n = len(table)
        step_kinds = table[np.arange(n), (np.arange(n) - j) % n]
        present = sorted(set(step_kinds.tolist()))
        if len(present) == 1:
            return fixed(kinds[present[0]], keep_skipped=False)
        slots = _slots(pairs, [kinds[k] for k in step_kinds])
        if slots is not None:
            return [
                (qp, kp, run(qp, kp, m))
                for qp, kp, m in (
                    (_pick(pairs, 0, chosen, q_block), _pick(pairs, 1, chosen, q_block), m) for m, chosen in slots
                )
            ]
        branch = jnp.asarray(np.searchsorted(present, step_kinds), jnp.int32)[q_block]
        results = lax.switch(
            branch, [lambda m=kinds[k]: [r for _, _, r in fixed(m, keep_skipped=True)] for k in present]
        )
        return [(qp, kp, r) for (qp, kp), r in zip(pairs, results)]
    results = []
    for qp, kp in pairs:
        offsets = (jnp.asarray(qp.offset, jnp.int32), jnp.asarray(kp.offset, jnp.int32))
        visible = offsets[1] <= offsets[0] + qp.length - 1
        results.append(
            (
                qp,
                kp,
                lax.cond(visible, lambda qp=qp, kp=kp, o=offsets: run(qp, kp, o), lambda qp=qp, kp=kp: skipped(qp, kp)),
            )
        )
    return results


def _slots(pairs, device_masks):
    """Where every device computes pairs of the same masks and lengths: ``[(mask, the pair
    index on each device)]``, the pairs every device computes alike first (their slices
    static), else None."""
    computed = [[(m, i) for i, m in enumerate(masks) if m is not SKIP] for masks in device_masks]

    def shape(mi):  # masks are None, "full" or ints: compared by repr
        return repr(mi[0]), pairs[mi[1]][0].length, pairs[mi[1]][1].length

    if any(sorted(map(shape, c)) != sorted(map(shape, computed[0])) for c in computed):
        return None
    common = set.intersection(*map(set, computed))
    rows = [sorted(c, key=lambda mi: (mi not in common, shape(mi), mi[1])) for c in computed]
    return [(slot[0][0], np.array([i for _, i in slot])) for slot in zip(*rows)]


def _pick(pairs, side: int, chosen: np.ndarray, q_block):
    """Side 0 (q) or 1 (kv) of pair ``chosen[device]`` on this device, as one Part: its start
    static where every device's pair starts there."""
    if (chosen == chosen[0]).all():
        return pairs[chosen[0]][side]
    index = jnp.asarray(chosen, jnp.int32)[q_block]
    candidates = [p[side] for p in pairs]
    starts = {candidates[i].start for i in chosen}
    start = starts.pop() if len(starts) == 1 else jnp.asarray([p.start for p in candidates], jnp.int32)[index]
    offset = jnp.stack([jnp.asarray(p.offset, jnp.int32) for p in candidates])[index]
    return Part(start, candidates[chosen[0]].length, offset)


def _ring(axes, sizes):
    n = math.prod(sizes[a] for a in axes)
    return n, lax.axis_index(axes), [(j, (j + 1) % n) for j in range(n)]


def _blocks(k, v, ids, axes, sizes, done):
    """(step, source block index, k, v, segment ids) at each of the ring's n steps, starting
    with this device's own; ``ids`` (the keys' segment ids, or None) travel with the block, in
    the same collective. The next block's ppermute is issued before the current block is used,
    but after ``done()`` (the previous step's kernel results) is computed: without that order
    XLA's scheduler, which prices the attention kernels as nearly free, hoists the ring's
    chained ppermutes to the top of the program, where nothing overlaps them. (Tied to the
    merged sums instead, the send waited for merges XLA had placed after the next step's
    kernels.)"""
    n, r, perm = _ring(axes, sizes)
    block = _kv(k, v), ids
    for j in range(n):
        following = None
        if j < n - 1:
            after_previous = lax.optimization_barrier((block, done()))[0] if j else block
            following = _send(after_previous, axes, perm)
        (kv, ids) = block
        yield j, (r - j) % n, kv[0], kv[1], ids
        block = following


def _kv(k, v):
    """K and V as one array where their shapes and dtypes agree, else the pair."""
    return jnp.stack([k, v]) if k.shape == v.shape and k.dtype == v.dtype else (k, v)


def _send(tree, axes, perm):
    """``lax.ppermute`` of a pytree as one collective: its leaves' bytes concatenated. XLA runs
    one collective at a time, so two sends in a ring step run one after the other, and the
    second is not overlapped with the step's kernels."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) <= 1:
        return jax.tree.unflatten(treedef, [lax.ppermute(x, axes, perm) for x in leaves])
    raw = lax.ppermute(
        jnp.concatenate([lax.bitcast_convert_type(x, jnp.uint8).reshape(-1) for x in leaves]), axes, perm
    )
    out, start = [], 0
    for x in leaves:
        width = x.dtype.itemsize
        piece = lax.slice_in_dim(raw, start, start + x.size * width)
        out.append(lax.bitcast_convert_type(piece.reshape(x.shape + ((width,) if width > 1 else ())), x.dtype))
        start += x.size * width
    return jax.tree.unflatten(treedef, out)


def _merge(out, lse, out_j, lse_j):
    """Two partial attentions over disjoint keys, merged by their log-sum-exps (-inf: none)."""
    new = jnp.logaddexp(lse, lse_j)
    finite = jnp.isfinite(new)

    def weight(l):  # [b, h, s] -> [b, s, h, 1]
        w = jnp.where(finite, jnp.exp(l - jnp.where(finite, new, 0.0)), 0.0)
        return jnp.swapaxes(w, 1, 2)[..., None]

    return out * weight(lse) + out_j.astype(jnp.float32) * weight(lse_j), new


def _seq(x, part: Part, axis=1):
    if isinstance(part.start, int):
        return lax.slice_in_dim(x, part.start, part.start + part.length, axis=axis)
    return lax.dynamic_slice_in_dim(x, part.start, part.length, axis=axis)


def _put(x, y, part: Part, axis=1):
    return lax.dynamic_update_slice_in_dim(x, y, part.start, axis=axis)


def _gathered(k, v, ids, axes, sizes):
    """``block(j)``: (K/V, segment ids) of block r - j, the block j steps back around the ring:
    this device's own (j = 0) as it is, the others from one all-gather of every block, which
    the step on the own block overlaps."""
    n, r, _ = _ring(axes, sizes)
    own = (_kv(k, v), ids)
    everything = lax.all_gather(own, axes, axis=0, tiled=False) if n > 1 else None

    def block(j):
        return (
            own
            if j == 0
            else jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, (r - j) % n, 0, keepdims=False), everything)
        )

    return block


def _gathered_steps(k, v, ids, axes, sizes):
    """``_blocks``' steps, own block first, from ``_gathered``: no collective between steps."""
    n, r, _ = _ring(axes, sizes)
    block = _gathered(k, v, ids, axes, sizes)
    for j in range(n):
        kv, kv_ids = block(j)
        yield j, (r - j) % n, kv[0], kv[1], kv_ids


def forward(attend, q, k, v, *, causal, q_block, q_base, kv_base, layout, axes, sizes, segment_ids=None, gather=False):
    """(out, lse) of this device's query block (block ``q_block``) against every K/V block of
    the ring. ``attend(q, k, v, segments, mask) -> (out, lse)`` is one contiguous pair's
    attention (``segments``: () or the pair's (q ids, kv ids); ``mask``: FULL, a static offset
    difference or traced (q_offset, kv_offset)); ``q_base`` / ``kv_base``: the global position
    of token 0 of q / of k (Python ints where static); ``segment_ids``: this block's, or None;
    ``gather``: every K/V block from one all-gather overlapped with the own block's step
    (``_gathered``), not passed around the ring."""
    b, _, h, _ = q.shape
    n = _ring(axes, sizes)[0]
    q_parts = parts(layout, q_block, q.shape[1], q_base)
    plan = _step_kinds(causal, layout, n, q.shape[1], k.shape[1], q_base, kv_base)
    out, lse = jnp.zeros(q.shape, jnp.float32), jnp.full((b, h, q.shape[1]), -jnp.inf, jnp.float32)
    previous = []
    blocks = (
        _gathered_steps(k, v, segment_ids, axes, sizes)
        if gather
        else _blocks(k, v, segment_ids, axes, sizes, done=lambda: previous)
    )
    for j, src, k, v, kv_ids in blocks:
        pairs = [(qp, kp) for kp in parts(layout, src, k.shape[1], kv_base) for qp in q_parts]
        results = _step(
            plan,
            pairs,
            q_block,
            j,
            run=lambda qp, kp, mask: attend(
                _seq(q, qp), _seq(k, kp), _seq(v, kp), _segments(segment_ids, kv_ids, qp, kp), mask
            ),
            skipped=lambda qp, kp: (
                jnp.zeros(_seq(q, qp).shape, q.dtype),
                jnp.full((b, h, qp.length), -jnp.inf, jnp.float32),
            ),
        )
        previous = [r for _, _, r in results]
        for qp, _, (out_j, lse_j) in results:
            merged, merged_lse = _merge(_seq(out, qp), _seq(lse, qp, axis=2), out_j, lse_j)
            out, lse = _put(out, merged, qp), _put(lse, merged_lse, qp, axis=2)
    return out.astype(q.dtype), lse


def backward(
    attend_bwd,
    q,
    k,
    v,
    out,
    lse,
    dout,
    dlse,
    *,
    causal,
    q_block,
    q_base,
    kv_base,
    layout,
    axes,
    sizes,
    segment_ids=None,
    gather=False,
):
    """(dq, dk, dv) of this device's blocks. ``attend_bwd(q, k, v, out, lse, dout, dlse,
    segments, mask) -> (dq, dk, dv)`` is one contiguous pair's backward given the whole rows'
    out and lse. A block's dK/dV sums (f32) follow it around the ring one step behind, in the
    same collective as the next K/V block: each step sends this block on and the previous
    block's sums, both ready once the previous step's kernels are. After the last step the
    sums go home, in K's and V's own dtypes.

    ``gather``: every K/V block from one all-gather (``_gathered``); the steps take the blocks in
    the order that ends on this device's own, so a block's sums, passed on after each step (in
    K's and V's dtypes, added to in float32), are whole when they reach home: n - 1 sends of
    the sums alone, none after the last step."""
    n, r, perm = _ring(axes, sizes)
    q_parts = parts(layout, q_block, q.shape[1], q_base)
    plan = _step_kinds(causal, layout, n, q.shape[1], k.shape[1], q_base, kv_base)
    dq = jnp.zeros(q.shape, jnp.float32)
    zeros = (
        jnp.zeros((2,) + k.shape, jnp.float32)
        if k.shape == v.shape
        else (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    )
    dtypes = k.dtype, v.dtype

    def rows(qp):
        return [_seq(x, qp) for x in (q, out, dout)] + [None if x is None else _seq(x, qp, axis=2) for x in (lse, dlse)]

    block, sums = (_kv(k, v), segment_ids), None
    gathered = _gathered(k, v, segment_ids, axes, sizes) if gather else None
    for t in range(n):
        if gather:
            # block r - 1 - t at step t, this device's own last: its sums end at home. Each step
            # sends the sums it has added to (the next device adds to them next step).
            j = (t + 1) % n
            (kv, kv_ids), src = gathered(j), (r - j) % n
            dkv = zeros if t == 0 else _as(_send(_as(sums, dtypes), axes, perm), jnp.float32)
        else:
            j = t
            (kv, kv_ids), src = block, (r - j) % n
            # out: this block for the next device's next step, the previous block's sums for its this one
            following, received = _send((block if j < n - 1 else None, sums), axes, perm)
            dkv = zeros if j == 0 else received
        k, v = kv[0], kv[1]
        pairs = [(qp, kp) for kp in parts(layout, src, k.shape[1], kv_base) for qp in q_parts]

        def run(qp, kp, mask, k=k, v=v, kv_ids=kv_ids):
            q_, out_, dout_, lse_, dlse_ = rows(qp)
            return attend_bwd(
                q_, _seq(k, kp), _seq(v, kp), out_, lse_, dout_, dlse_, _segments(segment_ids, kv_ids, qp, kp), mask
            )

        def skipped(qp, kp, k=k, v=v):
            return (
                jnp.zeros(_seq(q, qp).shape, q.dtype),
                jnp.zeros(_seq(k, kp).shape, k.dtype),
                jnp.zeros(_seq(v, kp).shape, v.dtype),
            )

        for qp, kp, (dq_j, dk_j, dv_j) in _step(plan, pairs, q_block, j, run, skipped):
            dq = _add_at(dq, dq_j, qp)
            dkv = _add_kv(_add_kv(dkv, 0, dk_j, kp), 1, dv_j, kp)
        if not gather:
            block = following
        sums = dkv
    dk, dv = _as(sums, dtypes)
    if not gather:  # the last block's sums (block r + 1's, summed whole) go home
        dk, dv = _send(_kv(dk, dv), axes, perm)
    return dq.astype(q.dtype), dk, dv


def _as(sums, dtypes):
    """The dK/dV sums (stacked [2, ...] or a pair) in ``dtypes`` (one dtype, or one each):
    stacked where the two agree, as ``_kv`` stacks K and V."""
    dk_dtype, dv_dtype = dtypes if isinstance(dtypes, tuple) else (dtypes, dtypes)
    if not isinstance(sums, tuple) and dk_dtype == dv_dtype:
        return sums.astype(dk_dtype)
    return sums[0].astype(dk_dtype), sums[1].astype(dv_dtype)


def _segments(q_ids, kv_ids, qp: Part, kp: Part):
    """() without segment ids, else the pair's (q ids, kv ids)."""
    return () if q_ids is None else (_seq(q_ids, qp), _seq(kv_ids, kp))


def _add_at(total, x, part: Part):
    return _put(total, _seq(total, part) + x, part)


def _add_kv(dkv, i: int, x, part: Part):
    """dK (i = 0) or dV (i = 1) of ``part`` plus ``x``, in the stacked [2, ...] sums or a pair."""
    if isinstance(dkv, tuple):
        return tuple(_add_at(d, x, part) if j == i else d for j, d in enumerate(dkv))
    start = (i, 0, part.start) + (0,) * (x.ndim - 2)
    return lax.dynamic_update_slice(dkv, (_seq(dkv[i], part) + x)[None], start)


def causal_work(layout: Layout | None, n: int, seq: int) -> np.ndarray:
    """Per device of a ring of ``n`` over a sequence of ``seq``, the (query, key) pairs causal
    attention has to compute: its queries' positions against every key's."""
    positions = np.arange(seq) if layout is None else layout.positions(seq)
    return np.array(
        [(block[:, None] >= np.arange(seq)[None, :]).sum() for block in positions.reshape(n, -1)], np.float64
    )
