"""Pipeline parallelism as one SPMD program: a schedule's table executed by a scan over ticks.

Every device of the pipeline axis runs the same program. At each tick it looks up its action in
the schedule's table (by its index on the axis) — forward (F), backward for inputs (B), backward
for weights (W) or idle — and runs it through ``lax.switch``; activations and their gradients
move to the neighbouring stage by ``ppermute`` between ticks. The pipelined loss owns its
gradient: F on the last virtual stage also runs the head and the loss and its backward, so a
micro-batch's B can start while later micro-batches are still in their forwards (1F1B and the
zero-bubble schedules need that; autodiff through a pipelined forward gives GPipe only).

``execute`` is the per-device program (call it inside ``shard_map`` over the pipeline axis).
It returns the mean loss and every gradient; a loss seeded with another cotangent scales them
(the loss is a scalar, so its gradient is linear in the seed).

Memory. What a schedule keeps is explicit: F stores its stage's ``jax.vjp`` residuals (the
saved activations) in a slot that B (or W, when the schedule splits the backward) frees; slots
are assigned per stage by interval colouring of the table, so a stage holds as many as its
schedule keeps alive at once (GPipe m, 1F1B p - s on stage s). Inputs received from a
neighbour wait in slots the same way.

Partial: the schedule tables come from ``shardflow.schedules``; the sf.parallelize integration
(a primitive whose rule shards the stacked layers over the pipeline axis, composed with the
other axes' rules inside the layer) is not built yet.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

IDLE, F, B, W = 0, 1, 2, 3
KINDS = {"F": F, "B": B, "W": W}


class Action(NamedTuple):
    kind: str          # "F", "B" or "W"
    microbatch: int
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class Table:
    """The schedule as the executor reads it: ``actions[t][s]`` is stage ``s``'s Action at
    tick ``t`` or None; ``virtual_stage(s, c)`` the block of layers chunk ``c`` of stage ``s``
    runs (0 .. stages * chunks - 1)."""
    actions: tuple
    stages: int
    microbatches: int
    chunks: int
    virtual_stage: Callable[[int, int], int]
    split_backward: bool


def _place(table: Table):
    """(stage, chunk) of every virtual stage."""
    where = {}
    for s in range(table.stages):
        for c in range(table.chunks):
            where[table.virtual_stage(s, c)] = (s, c)
    n = table.stages * table.chunks
    if sorted(where) != list(range(n)):
        raise ValueError(f"virtual_stage maps (stage, chunk) onto {sorted(where)}, not 0..{n - 1}")
    return where


def _colour(intervals):
    """Slot per interval [start, end] (inclusive ticks), reusing a slot once its interval ended:
    the fewest slots any assignment can use (interval graphs are perfect)."""
    slots, free, busy = {}, [], []          # busy: (end, slot)
    count = 0
    for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        busy.sort()
        while busy and busy[0][0] < start:
            free.append(busy.pop(0)[1])
        if free:
            slot = min(free)
            free.remove(slot)
        else:
            slot, count = count, count + 1
        slots[key] = slot
        busy.append((end, slot))
    return slots, count


class Plan(NamedTuple):
    """Per (tick, stage) int32 arrays the scan indexes by tick and device; -1 where unused."""
    kind: np.ndarray          # IDLE / F / B / W
    microbatch: np.ndarray
    chunk: np.ndarray
    resid_slot: np.ndarray    # F stores, B (or W) reads the stage's vjp residuals here
    grad_slot: np.ndarray     # split backward: B stores the output gradient W needs
    in_slot: np.ndarray       # F reads its input / B its output gradient from this inbox slot
    out_dir: np.ndarray       # where the action's result goes: 0 none, 1 next stage, 2 previous, 3 itself
    recv_f: np.ndarray        # [T + 1, s, 2] inbox-F slot for what arrives from (previous, next) stage
    recv_b: np.ndarray        # [T, s, 2] inbox-B slot likewise
    self_f: np.ndarray        # [T, s] inbox-F slot for this stage's own forward output (V turn)
    self_b: np.ndarray
    n_resid: int
    n_grad: int
    n_in_f: int
    n_in_b: int
    directions: frozenset     # which of "f_next", "f_prev", "b_next", "b_prev" the schedule uses


def plan(table: Table) -> Plan:
    p, m, v = table.stages, table.microbatches, table.chunks
    where = _place(table)
    last = p * v - 1
    T = len(table.actions)
    shape = (T, p)
    kind, mb, ch, in_slot, out_dir = (np.full(shape, -1, np.int32) for _ in range(5))
    kind[:] = IDLE
    ran = {}                                   # (kind, mb, virtual stage) -> tick
    for t, row in enumerate(table.actions):
        for s, a in enumerate(row):
            if a is None:
                continue
            k = table.virtual_stage(s, a.chunk)
            ran[(a.kind, a.microbatch, k)] = t
            kind[t, s], mb[t, s], ch[t, s] = KINDS[a.kind], a.microbatch, a.chunk

    def tick_of(kd, i, k):
        if (kd, i, k) not in ran:
            raise ValueError(f"the table has no {kd}{i} of virtual stage {k} (stage, chunk {where[k]})")
        return ran[(kd, i, k)]

    def direction(src_stage, dst_stage):
        if dst_stage == src_stage:
            return 3
        return 1 if dst_stage == (src_stage + 1) % p else 2 if dst_stage == (src_stage - 1) % p else None

    # Lifetimes per stage: residuals F -> B (or W), output gradients B -> W, inbox entries
    # arrival -> use. Arrival is the tick after the send (self hand-offs: the same tick's end).
    resid, grads = [dict() for _ in range(p)], [dict() for _ in range(p)]
    inbox_f, inbox_b = [dict() for _ in range(p)], [dict() for _ in range(p)]
    sends = []                                 # (tick, stage, kind, mb, target virtual stage)
    for (kd, i, k), t in ran.items():
        s, c = where[k]
        if kd == "F":
            end = tick_of("W", i, k) if table.split_backward else tick_of("B", i, k)
            resid[s][(i, k)] = (t, end)
            if k < last:
                ds, _ = where[k + 1]
                inbox_f[ds][(i, k + 1)] = (t + (ds != s), tick_of("F", i, k + 1))
                sends.append((t, s, "F", i, k + 1))
            else:                              # the head's gradient waits for this stage's B
                inbox_b[s][(i, k)] = (t, tick_of("B", i, k))
        elif kd == "B":
            if table.split_backward:
                grads[s][(i, k)] = (t, tick_of("W", i, k))
            if k > 0:
                ds, _ = where[k - 1]
                inbox_b[ds][(i, k - 1)] = (t + (ds != s), tick_of("B", i, k - 1))
                sends.append((t, s, "B", i, k - 1))
    resid_slots = [_colour(r) for r in resid]
    grad_slots = [_colour(g) for g in grads]
    in_f_slots = [_colour(x) for x in inbox_f]
    in_b_slots = [_colour(x) for x in inbox_b]

    resid_slot, grad_slot = np.full(shape, -1, np.int32), np.full(shape, -1, np.int32)
    recv_f, recv_b = np.full((T + 1, p, 2), -1, np.int32), np.full((T + 1, p, 2), -1, np.int32)
    self_f, self_b = np.full(shape, -1, np.int32), np.full(shape, -1, np.int32)
    directions = set()
    for (kd, i, k), t in ran.items():
        s, _ = where[k]
        key = (i, k)
        if kd == "F":
            resid_slot[t, s] = resid_slots[s][0][key]
            if k > 0:
                in_slot[t, s] = in_f_slots[s][0][key]
            if k == last:
                self_b[t, s] = in_b_slots[s][0][key]
        elif kd == "B":
            in_slot[t, s] = in_b_slots[s][0][key]
            resid_slot[t, s] = resid_slots[s][0][key]
            if table.split_backward:
                grad_slot[t, s] = grad_slots[s][0][key]
        else:
            resid_slot[t, s] = resid_slots[s][0][key]
            grad_slot[t, s] = grad_slots[s][0][key]
    for t, s, kd, i, k in sends:
        ds, _ = where[k]
        d = direction(s, ds)
        if d is None:
            raise ValueError(f"tick {t}: stage {s} sends {kd}{i} to stage {ds}, not a neighbour")
        out_dir[t, s] = d
        inbox = in_f_slots if kd == "F" else in_b_slots
        slot = inbox[ds][0][(i, k)]
        if d == 3:
            (self_f if kd == "F" else self_b)[t, s] = slot
            continue
        directions.add(f"{kd.lower()}_{'next' if d == 1 else 'prev'}")
        # arriving from the previous stage (sent "next") lands in column 0, from the next in 1
        (recv_f if kd == "F" else recv_b)[t + 1, ds, 0 if d == 1 else 1] = slot
    return Plan(kind, mb, ch, resid_slot, grad_slot, in_slot, out_dir, recv_f, recv_b, self_f, self_b,
                max(n for _, n in resid_slots), max((n for _, n in grad_slots), default=0),
                max((n for _, n in in_f_slots), default=0), max((n for _, n in in_b_slots), default=0),
                frozenset(directions))


def execute(stage_fn, head_fn, stage_params, head_params, xs, head_args, *, axis: str, table: Table):
    """The pipelined loss and its gradients on this device (inside ``shard_map`` over ``axis``).

    stage_fn(params, x) -> x: one virtual stage (its block of layers); ``stage_params`` holds this
    device's chunks stacked on a leading dim of size ``table.chunks``. head_fn(head_params, y,
    args) -> scalar loss of one micro-batch. ``xs`` [m, ...] and ``head_args`` (a pytree of
    [m, ...]) are the micro-batches, the same on every device. Returns (mean loss, d stage_params,
    d head_params, d xs), each the full value on every device (reduced over ``axis``) except
    d stage_params, this device's own.
    """
    pl = plan(table)
    p, m, v = table.stages, table.microbatches, table.chunks
    T = pl.kind.shape[0]
    me = lax.axis_index(axis)
    last_stage, last_chunk = _place(table)[p * v - 1]
    first_stage, first_chunk = _place(table)[0]

    chunk0 = jax.tree.map(lambda a: a[0], stage_params)
    x0 = xs[0]
    _, vjp0 = jax.vjp(stage_fn, chunk0, x0)
    resid_leaves, resid_tree = jax.tree.flatten(vjp0)

    def buffers(n, like):
        return jax.tree.map(lambda a: jnp.zeros((max(n, 1),) + jnp.shape(a), jnp.result_type(a)), like)

    carry = dict(
        resid=buffers(pl.n_resid, resid_leaves),
        grad=buffers(pl.n_grad, x0),
        in_f=buffers(pl.n_in_f, x0),
        in_b=buffers(pl.n_in_b, x0),
        d_params=jax.tree.map(jnp.zeros_like, stage_params),
        d_head=jax.tree.map(jnp.zeros_like, head_params),
        d_xs=jnp.zeros_like(xs),
        loss=jnp.zeros((), jnp.float32),
        out=jnp.zeros_like(x0),            # what this tick's action sends on
    )
    tables = {k: jnp.asarray(getattr(pl, k)) for k in
              ("kind", "microbatch", "chunk", "resid_slot", "grad_slot", "in_slot", "out_dir",
               "recv_f", "recv_b", "self_f", "self_b")}

    def at(buf, i):
        return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, jnp.maximum(i, 0), keepdims=False), buf)

    def put(buf, i, value):
        return jax.tree.map(lambda b, x: lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), jnp.maximum(i, 0), 0),
                            buf, value)

    def add(buf, i, value):
        return put(buf, i, jax.tree.map(jnp.add, at(buf, i), value))

    def forward(c, row):
        i, k = row["microbatch"], row["chunk"]
        is_first = (me == first_stage) & (k == first_chunk)
        x = jnp.where(is_first, lax.dynamic_index_in_dim(xs, i, keepdims=False), at(c["in_f"], row["in_slot"]))
        y, vjp = jax.vjp(stage_fn, at(stage_params, k), x)
        c = dict(c, resid=put(c["resid"], row["resid_slot"], jax.tree.leaves(vjp)), out=y)

        def head(c):
            args = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), head_args)
            loss, (dh, dy) = jax.value_and_grad(head_fn, argnums=(0, 1))(head_params, y, args)
            return dict(c, loss=c["loss"] + loss, d_head=jax.tree.map(jnp.add, c["d_head"], dh),
                        in_b=put(c["in_b"], row["self_b"], dy))
        return lax.cond((me == last_stage) & (k == last_chunk), head, lambda c: c, c)

    def backward(c, row, with_weights: bool):
        i, k = row["microbatch"], row["chunk"]
        dy = at(c["in_b"], row["in_slot"])
        vjp = jax.tree.unflatten(resid_tree, at(c["resid"], row["resid_slot"]))
        dp, dx = vjp(dy)
        if with_weights:
            c = dict(c, d_params=add(c["d_params"], k, dp))
        else:
            c = dict(c, grad=put(c["grad"], row["grad_slot"], dy))
        is_first = (me == first_stage) & (k == first_chunk)
        d_xs = jnp.where(is_first, lax.dynamic_update_index_in_dim(c["d_xs"], dx, i, 0), c["d_xs"])
        return dict(c, d_xs=d_xs, out=dx)

    def weights(c, row):
        dy = at(c["grad"], row["grad_slot"])
        vjp = jax.tree.unflatten(resid_tree, at(c["resid"], row["resid_slot"]))
        dp, _ = vjp(dy)
        return dict(c, d_params=add(c["d_params"], row["chunk"], dp), out=jnp.zeros_like(c["out"]))

    branches = [lambda c, row: dict(c, out=jnp.zeros_like(c["out"])), forward,
                lambda c, row: backward(c, row, not table.split_backward), weights]
    shift_next = [(j, (j + 1) % p) for j in range(p)]
    shift_prev = [(j, (j - 1) % p) for j in range(p)]

    def tick(c, t):
        row = {k: tab[t, me] for k, tab in tables.items()}
        c = lax.switch(row["kind"], branches, c, row)
        is_f, out = row["kind"] == F, c["out"]
        # A hand-off to itself (the turn of a V) goes straight into this stage's inbox; a
        # forward's self_b slot was the head's, already filled.
        c = dict(c, in_f=_put_where(c["in_f"], jnp.where(is_f, row["self_f"], -1), out, put),
                 in_b=_put_where(c["in_b"], jnp.where(is_f, -1, row["self_b"]), out, put))
        for col, (direction, perm) in enumerate((("next", shift_next), ("prev", shift_prev))):
            if not any(d.endswith(direction) for d in pl.directions):
                continue
            sent = lax.ppermute(jnp.where(row["out_dir"] == col + 1, out, jnp.zeros_like(out)), axis, perm)
            c = dict(c, in_f=_put_where(c["in_f"], tables["recv_f"][t + 1, me, col], sent, put),
                     in_b=_put_where(c["in_b"], tables["recv_b"][t + 1, me, col], sent, put))
        return c, None

    c, _ = lax.scan(tick, carry, jnp.arange(T))
    loss = lax.psum(c["loss"], axis) / m
    d_head = jax.tree.map(lambda g: lax.psum(g, axis) / m, c["d_head"])
    d_xs = lax.psum(c["d_xs"], axis) / m
    d_params = jax.tree.map(lambda g: g / m, c["d_params"])
    return loss, d_params, d_head, d_xs


def _put_where(buf, slot, value, put):
    """``buf`` with ``value`` at ``slot``, unchanged where ``slot`` is -1."""
    return jax.tree.map(lambda new, old: jnp.where(slot >= 0, new, old), put(buf, slot, value), buf)
