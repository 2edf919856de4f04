"""Pipeline parallelism as one SPMD program: a schedule's table executed by a scan over steps.

Every device of the pipeline axis runs the same program. The executor groups the table's ticks
into steps (``schedules.steps``): in a step each stage runs at most one forward (F), one backward
for inputs (B) and one backward for weights (W), in the table's order; activations and their
gradients move to the neighbouring stage by ``ppermute`` between steps. At each step a device
looks up its actions (by its index on the axis) and runs them, each a loop of 0 or 1 trips,
which XLA updates in place, where a ``lax.switch`` would copy every buffer every step. The
pipelined loss owns its gradient: F on the last virtual stage also runs the head and the loss
and its backward, so a micro-batch's B can start while later micro-batches are still in their
forwards (1F1B and the zero-bubble schedules need that; autodiff through a pipelined forward
gives GPipe only).

``execute`` is the per-device program (call it inside ``shard_map`` over the pipeline axis).
It returns the mean loss and every gradient; a loss seeded with another cotangent scales them
(the loss is a scalar, so its gradient is linear in the seed).

Lockstep. Devices meet at every step's ppermutes, so a step lasts as long as its slowest stage:
an unsplit schedule runs with each backward as B (inputs) then W (weights) at the stage's next
tick (``schedules.with_split_backward``; ``split_vjp`` cuts the traced backward so that B and W
share no equation, B keeping for W the values W reads, the stash). The published tables are
tight — nearly every tick a hop between stages, so a step per tick — and a tick that mixes a
forward on one stage with a backward that recomputes its forward on the next lasts as long as
the backward; ``1f1b-fused`` puts one F, one B and one W on every stage in each steady step, so
its steps are equal whatever the actions cost. The head runs on every device of the axis at
once, after the step's actions, sharded as its parameters are (a vocab split over the stages
shares its work out); and the hand-offs wait for every action of the step (an optimization
barrier), else XLA runs W after them and a device does two steps' work between two hand-offs.

Memory. What a schedule keeps is explicit: F stores its stage's residuals (the saved
activations, less the layer weights) in a slot that W frees, B the stash in one that W frees;
the layers' scans write and read them there row by row (``shardflow.slots``); slots are
assigned per stage by interval colouring of the table, so a stage holds as many as its schedule
keeps alive at once (GPipe m, 1F1B p - s on stage s, 1f1b-fused 2(p - s)). Inputs received from
a neighbour wait in slots the same way. The weight gradients are summed over micro-batches in
float32 (at least), each layer's added by the backward's scan as it makes it, and rounded to
the parameters' dtype once at the end.

Partial: interleaved / V layouts that keep the layers in device order between steps (today
the stacked layers are reordered each step, a collective explain shows) are not built yet; an
undifferentiated call still runs the backward. On one 4-GPU host 0.67-0.77x FSDP so far
(benchmarks/results/pipeline.md) with the published tables.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import mlir

from shardflow import slots
from shardflow.conversion import Step
from shardflow.program import open_jaxpr, source_line
from shardflow.registry import Decision, defrule
from shardflow.schedules import W_SLOTS, Schedule, by_name, steps, with_split_backward
from shardflow.slots import at, put
from shardflow.specs import B, Partial, ShardingError, Split, definition, describe, local_shape
from shardflow.split_vjp import split_vjp


def _place(table: Schedule) -> dict:
    """(stage, chunk) of every virtual stage."""
    return {k: table.locate(k) for k in range(table.stages * table.chunks)}


def _colour(intervals):
    """Slot per interval [start, end] (inclusive times), reusing a slot once its interval ended:
    the fewest slots any assignment can use (interval graphs are perfect)."""
    slots, free, busy = {}, [], []  # busy: (end, slot)
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


class StepTables(NamedTuple):
    """The executor's tables for a schedule run step by step (``schedules.steps``): a stage runs in
    a step at most one F, one B and ``W_SLOTS`` W's, so each kind has its own columns.

    ``tables``: name -> int32 [steps, stages], -1 where unused — ``f_mb`` / ``f_chunk`` (-1: no F),
    ``f_in`` (the inbox-F slot F reads), ``f_resid`` (where F stores the residuals), ``f_self``
    (the inbox-F slot for its own output: the turn of a V), ``f_head`` (the inbox-B slot for the
    head's dy, on the last virtual stage); ``b_mb`` / ``b_chunk``, ``b_in``, ``b_resid``, ``b_stash``
    (where B stores what W reads), ``b_self``, ``bw_whole`` (1, else 0: the micro-batch's W runs
    in the same step, so B is the whole backward, W's work included, and nothing is stashed);
    ``w_chunk``, ``w_resid``, ``w_stash`` [steps, stages, W_SLOTS] (W's on their own, in the
    step's order; ``w_slots`` of the columns used); and
    ``recv_f`` / ``recv_b`` [steps + 1, stages, 2]: the inbox slot for what arrives from the
    (previous, next) stage. ``heads`` [steps]: the last virtual stage's forward runs in the step."""

    tables: dict
    heads: np.ndarray
    n_resid: int
    n_stash: int
    n_in_f: int
    n_in_b: int
    directions: frozenset  # which of "f_next", "f_prev", "b_next", "b_prev" the schedule sends
    w_slots: int

    @property
    def steps(self) -> int:
        return len(self.heads)


@functools.lru_cache(maxsize=64)  # per Schedule: the executor and explain's pricing both ask
def step_tables(table: Schedule) -> StepTables:
    """The executor's tables for ``table`` run with a split backward (``with_split_backward``)."""
    table = with_split_backward(table)
    p, v = table.stages, table.chunks
    where = _place(table)
    last = p * v - 1
    groups = steps(table)
    step_of = {t: j for j, group in enumerate(groups) for t in group}
    S = len(groups)
    shape = (S, p)
    tab = {
        name: np.full(shape, -1, np.int32)
        for name in (
            "f_mb",
            "f_chunk",
            "f_in",
            "f_resid",
            "f_self",
            "f_head",
            "b_mb",
            "b_chunk",
            "b_in",
            "b_resid",
            "b_stash",
            "b_self",
        )
    }
    tab.update({name: np.full(shape + (W_SLOTS,), -1, np.int32) for name in ("w_chunk", "w_resid", "w_stash")})
    tab["bw_whole"] = np.zeros(shape, np.int32)
    tab["recv_f"], tab["recv_b"] = (np.full((S + 1, p, 2), -1, np.int32) for _ in range(2))
    ran = {}  # (kind, mb, virtual stage) -> tick
    for t, row in enumerate(table.actions):
        for s, a in enumerate(row):
            if a is not None:
                ran[(a.kind, a.microbatch, table.virtual_stage(s, a.chunk))] = t

    def direction(src_stage, dst_stage):  # 1 next stage, 2 previous, 3 itself
        return 3 if dst_stage == src_stage else 1 if dst_stage == (src_stage + 1) % p else 2

    def delivered(t):  # the end of tick t's step, after its actions
        return groups[step_of[t]][-1] + 0.5

    # Lifetimes per stage, in ticks (a stage runs a step's actions in the table's order):
    # residuals F -> W, stash B -> W, inbox entries from the end of the sending step (hand-offs,
    # the head's dy) to their use.
    resid, stashes = [dict() for _ in range(p)], [dict() for _ in range(p)]
    inbox_f, inbox_b = [dict() for _ in range(p)], [dict() for _ in range(p)]
    sends = []  # (tick, stage, kind, mb, target virtual stage)
    for (kd, i, k), t in ran.items():
        s, c = where[k]
        if kd == "F":
            resid[s][(i, k)] = (t, ran[("W", i, k)])
            if k < last:
                ds, _ = where[k + 1]
                inbox_f[ds][(i, k + 1)] = (delivered(t), ran[("F", i, k + 1)])
                sends.append((t, s, "F", i, k + 1))
            else:  # the head's gradient waits for this stage's B
                inbox_b[s][(i, k)] = (delivered(t), ran[("B", i, k)])
        elif kd == "B":
            if step_of[t] != step_of[ran[("W", i, k)]]:  # else the step runs the whole backward
                stashes[s][(i, k)] = (t, ran[("W", i, k)])
            if k > 0:
                ds, _ = where[k - 1]
                inbox_b[ds][(i, k - 1)] = (delivered(t), ran[("B", i, k - 1)])
                sends.append((t, s, "B", i, k - 1))
    resid_slots = [_colour(r) for r in resid]
    stash_slots = [_colour(x) for x in stashes]
    in_f_slots = [_colour(x) for x in inbox_f]
    in_b_slots = [_colour(x) for x in inbox_b]

    heads = np.zeros(S, bool)
    for (kd, i, k), tick in ran.items():
        s, c, t = *where[k], step_of[tick]
        key, r = (i, k), resid_slots[s][0][(i, k)]
        if kd == "F":
            tab["f_mb"][t, s], tab["f_chunk"][t, s], tab["f_resid"][t, s] = i, c, r
            if k > 0:
                tab["f_in"][t, s] = in_f_slots[s][0][key]
            if k == last:
                tab["f_head"][t, s], heads[t] = in_b_slots[s][0][key], True
        elif kd == "B":
            tab["b_mb"][t, s], tab["b_chunk"][t, s], tab["b_resid"][t, s] = i, c, r
            tab["b_in"][t, s] = in_b_slots[s][0][key]
            if key in stash_slots[s][0]:
                tab["b_stash"][t, s] = stash_slots[s][0][key]
            else:
                tab["bw_whole"][t, s] = 1
        elif key in stash_slots[s][0]:
            j = int((tab["w_chunk"][t, s] >= 0).sum())  # the step's next W slot
            tab["w_chunk"][t, s, j], tab["w_resid"][t, s, j], tab["w_stash"][t, s, j] = c, r, stash_slots[s][0][key]
    directions = set()
    for tick, s, kd, i, k in sends:
        ds, t = where[k][0], step_of[tick]
        d = direction(s, ds)
        slot = (in_f_slots if kd == "F" else in_b_slots)[ds][0][(i, k)]
        if d == 3:
            tab[f"{kd.lower()}_self"][t, s] = slot
            continue
        directions.add(f"{kd.lower()}_{'next' if d == 1 else 'prev'}")
        # arriving from the previous stage (sent "next") lands in column 0, from the next in 1
        tab[f"recv_{kd.lower()}"][t + 1, ds, 0 if d == 1 else 1] = slot
    return StepTables(
        tab,
        heads,
        max(n for _, n in resid_slots),
        max((n for _, n in stash_slots), default=0),
        max((n for _, n in in_f_slots), default=0),
        max((n for _, n in in_b_slots), default=0),
        frozenset(directions),
        int((tab["w_chunk"] >= 0).sum(-1).max()),
    )


class Bodies(NamedTuple):
    """A virtual stage and the head as functions of flat lists of arrays (one device's view).

    forward(chunk, x) -> (y, stored): ``stored`` are the residuals B and W need, less those
    that are the chunk's own parameters (passed again rather than kept per micro-batch).
    backward(chunk, stored, dy) -> (d chunk, dx), and the same work cut in two
    (``split_vjp``): backward_x(chunk, stored, dy) -> (dx, stash) and
    backward_w(chunk, stored, stash) -> d chunk, the stash being what W reads of B's values
    (the cotangents of the weights' matmuls).
    head(head_params, y, args) -> (loss, d head_params, dy).
    """

    forward: Callable
    backward: Callable
    backward_x: Callable
    backward_w: Callable
    head: Callable


def bodies_of(layer_fn, head_fn, chunk, x, head_params, args) -> Bodies:
    """The Bodies on one device as ClosedJaxprs, for ``layer_fn(layer, h) -> h`` scanned over a
    chunk of stacked layers and ``head_fn(head_params, y, args) -> loss``, traced at the given
    (abstract) values."""
    chunk_leaves, chunk_tree = jax.tree.flatten(chunk)
    head_leaves, head_tree = jax.tree.flatten(head_params)
    arg_leaves, arg_tree = jax.tree.flatten(args)
    n = len(chunk_leaves)

    def stage(leaves, x):
        layers = jax.tree.unflatten(chunk_tree, leaves)
        return lax.scan(lambda h, layer: (layer_fn(layer, h), None), x, layers)[0]

    pullback = {}

    def full_forward(leaves, x):
        y, vjp = jax.vjp(stage, leaves, x)
        residuals, pullback["tree"] = jax.tree.flatten(vjp)
        return y, residuals

    traced = jax.make_jaxpr(full_forward)(chunk_leaves, x)
    inputs = traced.jaxpr.invars[:n]
    # Where each residual comes from: a chunk parameter (its index) or the stored list (-1).
    from_chunk = tuple(inputs.index(v) if v in inputs else -1 for v in traced.jaxpr.outvars[1:])
    # forward: the traced jaxpr less the residuals that are chunk parameters (no new trace).
    y, *residuals = traced.jaxpr.outvars
    forward = traced.replace(
        jaxpr=traced.jaxpr.replace(outvars=[y] + [r for r, i in zip(residuals, from_chunk) if i < 0])
    )
    y, *stored = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in forward.out_avals)

    def pullback_of(leaves, stored):
        stored = iter(stored)
        residuals = [leaves[i] if i >= 0 else next(stored) for i in from_chunk]
        return jax.tree.unflatten(pullback["tree"], residuals)

    def backward(leaves, stored, dy):
        d_leaves, dx = pullback_of(leaves, stored)(dy)
        return list(d_leaves), dx

    def head(hp, y, a):
        loss, (dh, dy) = jax.value_and_grad(
            lambda hp, y: head_fn(jax.tree.unflatten(head_tree, hp), y, jax.tree.unflatten(arg_tree, a)), argnums=(0, 1)
        )(hp, y)
        return loss, list(dh), dy

    backward_jaxpr = jax.make_jaxpr(backward)(chunk_leaves, stored, y)
    split = split_vjp(backward_jaxpr, shared=n + len(stored), weights=n)
    jaxprs = Bodies(
        forward=forward,
        backward=backward_jaxpr,
        backward_x=split.b,
        backward_w=split.w,
        head=jax.make_jaxpr(head)(head_leaves, y, arg_leaves),
    )
    if jax.tree.structure(y) != jax.tree.structure(x) or y.shape != jnp.shape(x) or y.dtype != jnp.result_type(x):
        raise ValueError(
            f"pipeline: a layer must map its input to the same shape and dtype; "
            f"{jnp.result_type(x)}{list(jnp.shape(x))} became {y.dtype}{list(y.shape)}"
        )
    return jaxprs


def callables(jaxprs: Bodies, run=jaxpr_as_fun) -> Bodies:
    """Bodies calling each ClosedJaxpr through ``run`` (e.g. a rule's local lowering), in and
    out as the flat lists ``execute`` passes."""

    def flat(jaxpr, split):
        fn = run(jaxpr)
        return lambda *groups: split(list(fn(*[x for g in groups for x in (g if isinstance(g, list) else [g])])))

    f, b, bx, bw, h = jaxprs
    n_dp = len(b.out_avals) - 1
    return Bodies(
        forward=flat(f, lambda o: (o[0], o[1:])),
        backward=flat(b, lambda o: (o[:n_dp], o[n_dp])),
        backward_x=flat(bx, lambda o: (o[0], o[1:])),
        backward_w=flat(bw, lambda o: o),
        head=flat(h, lambda o: (o[0], o[1:-1], o[-1])),
    )


def sequential(bodies: Bodies, table: Schedule, stage, head_params, xs, args):
    """What every schedule computes, one micro-batch and one virtual stage after another on one
    device: (loss, d stage, d head_params, d xs), each a flat list (stage leaves [p, v, ...])."""
    where = _place(table)
    m, n_virtual = table.microbatches, table.stages * table.chunks

    def chunk(k):
        return [x[where[k]] for x in stage]

    d_chunk, d_hp = _gradient_shapes(bodies, chunk(0), xs[0], head_params, [a[0] for a in args])
    d_stage = [jnp.zeros(x.shape[:2] + g.shape, _summed(g.dtype)) for x, g in zip(stage, d_chunk)]
    d_head = [jnp.zeros(g.shape, _summed(g.dtype)) for g in d_hp]
    loss, d_xs = jnp.zeros((), jnp.float32), []

    for i in range(m):
        h, stored = xs[i], []
        for k in range(n_virtual):
            h, st = bodies.forward(chunk(k), h)
            stored.append(st)
        l, dh, dy = bodies.head(head_params, h, [a[i] for a in args])
        loss, d_head = loss + l, [a + b.astype(a.dtype) for a, b in zip(d_head, dh)]
        for k in reversed(range(n_virtual)):
            dc, dy = bodies.backward(chunk(k), stored[k], dy)
            d_stage = [d.at[where[k]].add(g.astype(d.dtype)) for d, g in zip(d_stage, dc)]
        d_xs.append(dy)
    return (
        loss / m,
        [(d / m).astype(g.dtype) for d, g in zip(d_stage, d_chunk)],
        [(d / m).astype(g.dtype) for d, g in zip(d_head, d_hp)],
        jnp.stack(d_xs) / m,
    )


def _summed(dtype):
    """The dtype gradients are summed over micro-batches in: at least float32 (bf16 gradients
    summed 16 times in bf16 would round 16 times; they are rounded once, at the end)."""
    return jnp.promote_types(dtype, jnp.float32)


def _flat(out) -> list:
    first, rest = out
    return [first, *rest]


def _gradient_shapes(bodies: Bodies, chunk, x, head_params, args):
    """(a chunk's gradient, the head params' gradient) as the bodies make them: sharded bodies
    may make them in other blocks than the parameters' (a replicated bias's gradient split with
    the activations)."""
    y, stored = jax.eval_shape(bodies.forward, chunk, x)
    return (
        jax.eval_shape(bodies.backward, chunk, stored, y)[0],
        jax.eval_shape(bodies.head, list(head_params), y, args)[1],
    )


def execute(bodies: Bodies, table: Schedule, stage, head_params, xs, args, *, axis: str):
    """The pipelined loss and its gradients on this device (inside ``shard_map`` over ``axis``):
    ``sequential``'s results, each device holding its own [1, v, ...] block of the stage leaves
    and of their gradients, the rest whole on every device."""
    pl = step_tables(table)
    p, m, v = table.stages, table.microbatches, table.chunks
    me = lax.axis_index(axis)
    last_stage, last_chunk = _place(table)[p * v - 1]
    first_stage, first_chunk = _place(table)[0]
    mine = [x[0] for x in stage]  # [v, ...] this device's chunks
    # Each chunk's layers split once, before the loop over steps, so that each layer's weights,
    # and its gradients' float32 sums, are arrays of their own (slots.Rows): sliced from a
    # stack inside the loop, XLA:GPU copies them for every micro-batch. So an action runs in one
    # loop of 0 or 1 trips per chunk, each with its chunk's arrays.
    layers = [[slots.Rows(x[k, l] for l in range(x.shape[1])) for x in mine] for k in range(v)]

    def sums(d_stage, k):
        """Chunk k's gradient sums, as slots.run adds to them."""
        return {r: (slots.Rows(d[k]), None) for r, d in enumerate(d_stage)}

    def summed(d_stage, k, new):
        """``d_stage`` with chunk k's sums replaced by ``new`` (slots.run's results)."""
        return [[list(n) if j == k else d_j for j, d_j in enumerate(d)] for d, n in zip(d_stage, new)]

    x0 = xs[0]
    stacked0 = [x[0] for x in mine]
    d_chunk, d_hp = _gradient_shapes(bodies, stacked0, x0, head_params, [a[0] for a in args])

    def buffers(n, like, spare=0):
        return [jnp.zeros((max(n, 1) + spare,) + tuple(a.shape), a.dtype) for a in like]

    # The actions as local jaxprs, which slots.run evaluates with the residuals and the stash
    # written into and read from their slots by the layers' scans themselves.
    like = lambda avals: [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    chunk0, n = like(stacked0), len(mine)
    f_jaxpr = jax.make_jaxpr(lambda *a: _flat(bodies.forward(list(a[:n]), a[n])))(*chunk0, x0)
    stored0 = like(f_jaxpr.out_avals[1:])
    n_stored, stash0 = len(stored0), []
    # Only the backward the table runs is traced: split (B, then W at another step) and / or
    # whole (B and W of a micro-batch in one step).
    whole_b = bool(pl.tables["bw_whole"].any())
    split_b = bool(((pl.tables["b_chunk"] >= 0) & (pl.tables["bw_whole"] == 0)).any())
    if split_b:
        bx_jaxpr = jax.make_jaxpr(lambda *a: _flat(bodies.backward_x(list(a[:n]), list(a[n:-1]), a[-1])))(
            *chunk0, *stored0, x0
        )
        stash0 = like(bx_jaxpr.out_avals[1:])
        bw_jaxpr = jax.make_jaxpr(
            lambda *a: bodies.backward_w(list(a[:n]), list(a[n : n + n_stored]), list(a[n + n_stored :]))
        )(*chunk0, *stored0, *stash0)
    if whole_b:
        b_jaxpr = jax.make_jaxpr(
            lambda *a: (lambda d, dx: [*d, dx])(*bodies.backward(list(a[:n]), list(a[n:-1]), a[-1]))
        )(*chunk0, *stored0, x0)
    n_stash = len(stash0)
    carry = dict(
        stored=buffers(pl.n_resid, stored0),
        stash=buffers(pl.n_stash, stash0) if split_b else [],
        in_f=buffers(pl.n_in_f, [x0], spare=1)[0],  # the last slot takes writes to nowhere
        in_b=buffers(pl.n_in_b, [x0], spare=1)[0],
        d_stage=[
            [[jnp.zeros(g.shape[1:], _summed(g.dtype)) for _ in range(g.shape[0])] for _ in range(v)] for g in d_chunk
        ],  # [leaf][chunk][layer]
        d_head=[jnp.zeros(g.shape, _summed(g.dtype)) for g in d_hp],
        d_xs=buffers(m, [x0], spare=1)[0],
        loss=jnp.zeros((), jnp.float32),
        out_f=jnp.zeros_like(x0),  # what this step's F and B send on (read only where sent)
        out_b=jnp.zeros_like(x0),
    )
    tables = {name: jnp.asarray(tab) for name, tab in pl.tables.items()}

    def when(pred, fn, c, keys):
        """``c`` with its entries ``keys`` replaced by ``fn`` of them where ``pred``. A loop of 0
        or 1 trips, not a conditional: XLA updates a loop's state in place, where a conditional
        copies every buffer its branches pass through — all of them, every step."""
        part = {k: c[k] for k in keys}
        _, part = lax.while_loop(
            lambda s: s[0] < pred.astype(jnp.int32), lambda s: (s[0] + 1, fn(s[1])), (jnp.int32(0), part)
        )
        return dict(c, **part)

    def is_first(k):
        return (me == first_stage) & (k == first_chunk)

    def forward(k, row, c):
        i = row["f_mb"]
        x = jnp.where(is_first(k), at(xs, i), at(c["in_f"], row["f_in"]))
        y, *stored = slots.run(
            f_jaxpr, layers[k] + [x], writes={1 + r: (b, row["f_resid"]) for r, b in enumerate(c["stored"])}
        )
        return dict(stored=stored, out_f=y)

    def head(row, c):  # on every device: y from the last stage; dy to it
        y = lax.psum(jnp.where(me == last_stage, c["out_f"], jnp.zeros_like(c["out_f"])), axis)
        i = tables["f_mb"][row["t"], last_stage]
        loss, dh, dy = bodies.head(list(head_params), y, [at(a, i) for a in args])
        return dict(
            loss=c["loss"] + loss,
            d_head=[a + b.astype(a.dtype) for a, b in zip(c["d_head"], dh)],
            in_b=put(c["in_b"], row["f_head"], dy),
        )

    def backward(k, row, c):
        i = row["b_mb"]
        dy = at(c["in_b"], row["b_in"])
        dx, *stash = slots.run(
            bx_jaxpr,
            layers[k] + [None] * n_stored + [dy],
            reads={n + r: (b, row["b_resid"]) for r, b in enumerate(c["stored"])},
            writes={1 + s: (b, row["b_stash"]) for s, b in enumerate(c["stash"])},
        )
        return dict(stash=stash, d_xs=put(c["d_xs"], jnp.where(is_first(k), i, -1), dx), out_b=dx)

    def whole_backward(k, row, c):  # B and W of one micro-batch in one step: nothing stashed
        i = row["b_mb"]
        *d_stage, dx = slots.run(
            b_jaxpr,
            layers[k] + [None] * n_stored + [at(c["in_b"], row["b_in"])],
            reads={n + r: (b, row["b_resid"]) for r, b in enumerate(c["stored"])},
            adds=sums(c["d_stage"], k),
        )
        return dict(
            d_stage=summed(c["d_stage"], k, d_stage), d_xs=put(c["d_xs"], jnp.where(is_first(k), i, -1), dx), out_b=dx
        )

    def weights(k, j, row, c):  # the step's j-th W
        reads = {n + r: (b, row["w_resid"][j]) for r, b in enumerate(c["stored"])}
        reads.update({n + n_stored + s: (b, row["w_stash"][j]) for s, b in enumerate(c["stash"])})
        return dict(
            d_stage=summed(
                c["d_stage"],
                k,
                slots.run(bw_jaxpr, layers[k] + [None] * (n_stored + n_stash), reads=reads, adds=sums(c["d_stage"], k)),
            )
        )

    heads = jnp.asarray(pl.heads)
    shifts = (("next", [(j, (j + 1) % p) for j in range(p)]), ("prev", [(j, (j - 1) % p) for j in range(p)]))

    def step(c, t):
        row = dict({name: tab[t, me] for name, tab in tables.items()}, t=t)
        read = lambda fn, *key: lambda part: fn(*key, row, dict(c, **part))  # the other entries as they are now
        for k in range(v):  # at most one F, one B, W_SLOTS W's a step: one loop of a kind runs each
            c = when(row["f_chunk"] == k, read(forward, k), c, ("stored", "out_f"))
        for k in range(v):
            if split_b:
                c = when(
                    (row["b_chunk"] == k) & (row["bw_whole"] < 1), read(backward, k), c, ("stash", "d_xs", "out_b")
                )
            if whole_b:
                c = when(
                    (row["b_chunk"] == k) & (row["bw_whole"] > 0),
                    read(whole_backward, k),
                    c,
                    ("d_stage", "d_xs", "out_b"),
                )
        for j in range(pl.w_slots):
            for k in range(v * split_b):
                c = when(row["w_chunk"][j] == k, read(weights, k, j), c, ("d_stage",))
        # The head last: every device waits in its collectives for the last stage's forward,
        # so a device's own actions before it run alongside that forward, after it they would not
        # (a step as long as two). Its dy is read at a later step.
        c = when(heads[t], read(head), c, ("loss", "d_head", "in_b"))
        # The hand-offs wait for W too: XLA would otherwise run W, which nothing sent depends
        # on, after them, and a device would do this step's W and the next step's work
        # between two hand-offs — a step as long as two on one device (seen on H200).
        out_f, out_b, d_stage = lax.optimization_barrier((c["out_f"], c["out_b"], c["d_stage"]))
        # A hand-off to itself (the turn of a V) goes straight into this stage's inbox.
        c = dict(
            c, d_stage=d_stage, in_f=put(c["in_f"], row["f_self"], out_f), in_b=put(c["in_b"], row["b_self"], out_b)
        )
        for kind, out in (("f", out_f), ("b", out_b)):
            for col, (direction, perm) in enumerate(shifts):
                if f"{kind}_{direction}" in pl.directions:
                    c = dict(
                        c,
                        **{
                            f"in_{kind}": put(
                                c[f"in_{kind}"], tables[f"recv_{kind}"][t + 1, me, col], lax.ppermute(out, axis, perm)
                            )
                        },
                    )
        return c, None

    c, _ = lax.scan(step, carry, jnp.arange(pl.steps))
    loss = c["loss"] / m
    d_head = [(g / m).astype(like.dtype) for g, like in zip(c["d_head"], d_hp)]
    d_xs = lax.psum(c["d_xs"][:m], axis) / m
    d_stage = [
        (jnp.stack([jnp.stack(rows) for rows in g]) / m).astype(like.dtype)[None]
        for g, like in zip(c["d_stage"], d_chunk)
    ]
    return loss, d_stage, d_head, d_xs


# ------------------------------------------------------------------------------ the primitive
#
# sf_pipeline: operands (*stage leaves [p, v, ...], *head params, xs [m, ...], *args [m, ...]),
# results (loss, *d stage leaves, *d head params, d xs) — the loss and its whole gradient, as
# ``sequential`` computes them. Its params hold the Bodies as single-device jaxprs, so shardflow
# shards them like any loop body (the rule below); bound outside parallelize it runs them in
# sequence.

pipeline_p = Primitive("sf_pipeline")
pipeline_p.multiple_results = True


def operand_groups(params, values):
    """(stage leaves, head leaves, xs, head args) of an sf_pipeline equation's operands (or of
    anything listed like them)."""
    ns, nh, na = params["counts"]
    return values[:ns], values[ns : ns + nh], values[ns + nh], values[ns + nh + 1 : ns + nh + 1 + na]


def _bodies_param(params) -> Bodies:
    return Bodies(*(params[name] for name in Bodies._fields))


def _uneven(layer_fn, counts, n_layers, table):
    """(device_order of a layer leaf, the ``active`` flag of each padded layer [p, v, width],
    layer_fn of {"layer", "active"} skipping inactive ones) for virtual stages of ``counts``
    layers each (in the model's order: stage s's chunk c runs ``table.virtual_stage(s, c)``),
    padded to the largest."""
    p, v = table.stages, table.chunks
    if len(counts) != p * v or sum(counts) != n_layers or min(counts) < 1:
        per = f"{p} stages" if v == 1 else f"{p} stages x {v} chunks (one per virtual stage, in the model's order)"
        raise ValueError(
            f"pipeline: layers_per_stage {list(counts)} must be {p * v} counts of at least 1, "
            f"for {per}, summing to the {n_layers} layers"
        )
    width, starts = max(counts), np.cumsum((0,) + counts[:-1])
    virtual = [[table.virtual_stage(s, c) for c in range(v)] for s in range(p)]
    index = np.array([[[starts[k] + min(j, counts[k] - 1) for j in range(width)] for k in row] for row in virtual])
    active = np.array([[[j < counts[k] for j in range(width)] for k in row] for row in virtual], np.float32)

    def device_order(leaf):  # [L, ...] -> [p, v, width, ...]
        return leaf[index]

    def masked(layer, h):
        return lax.cond(layer["active"] > 0, lambda: layer_fn(layer["layer"], h), lambda: h)

    return device_order, jnp.asarray(active), masked


def _sequential_impl(*values, **params):
    stage, head, xs, args = operand_groups(params, list(values))
    loss, d_stage, d_head, d_xs = sequential(callables(_bodies_param(params)), params["table"], stage, head, xs, args)
    return [loss.astype(params["head"].out_avals[0].dtype), *d_stage, *d_head, d_xs]


def _abstract_eval(*avals, **params):
    stage, head, xs, _ = operand_groups(params, list(avals))
    loss = params["head"].out_avals[0]
    return [loss, *stage, *head, xs]


pipeline_p.def_impl(lambda *values, **params: jax.jit(lambda *v: _sequential_impl(*v, **params))(*values))
pipeline_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(pipeline_p, mlir.lower_fun(_sequential_impl, multiple_results=True))


def _check_layer_and_head(layer_fn, head, layers, x, head_params, head_args, m: int) -> None:
    """A ShardingError naming ``layer_fn`` or ``head`` unless one layer maps a micro-batch's
    activations to their own shape and dtype (the stages hand them on) and the head makes a
    float scalar of them (the loss the schedule differentiates)."""

    def one_micro_batch(a):
        return jax.ShapeDtypeStruct((a.shape[0] // m,) + tuple(a.shape[1:]), a.dtype)

    h = one_micro_batch(x)
    one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)
    got = jax.eval_shape(layer_fn, one_layer, h)
    if jax.tree.structure(got) != jax.tree.structure(h) or (got.shape, got.dtype) != (h.shape, h.dtype):
        raise ShardingError(
            f"sf.pipeline: layer_fn {definition(layer_fn)} must map a micro-batch's activations "
            f"h {describe(h)} to the same shape and dtype; it returns {_described(got)}: each "
            "stage hands its output to the next as the next one's h"
        )
    loss = jax.eval_shape(head, head_params, h, jax.tree.map(one_micro_batch, head_args))
    if not (isinstance(loss, jax.ShapeDtypeStruct) and loss.shape == () and jnp.issubdtype(loss.dtype, jnp.floating)):
        raise ShardingError(
            f"sf.pipeline: head {definition(head)} must return a micro-batch's loss, a float "
            f"scalar; it returns {_described(loss)} (y {describe(h)}): the schedule "
            "differentiates the mean of the micro-batches' losses"
        )


def _described(tree) -> str:
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1 and jax.tree.structure(tree).num_leaves == 1 and not isinstance(tree, (tuple, list, dict)):
        return describe(leaves[0])
    return str(jax.tree.map(describe, tree)).replace("'", "")


def pipeline(
    layer_fn,
    layers,
    x,
    *,
    head,
    head_params,
    head_args=(),
    stages: int,
    microbatches: int,
    schedule="1f1b",
    chunks: int | None = None,
    layers_per_stage=None,
    axis: str = "pipe",
):
    """``mean_i head(head_params, layers applied to micro-batch i of x, head_args of i)``.

    ``layers`` is a pytree of stacked layer parameters (leading dim: the number of layers),
    ``layer_fn(layer, h) -> h`` one layer; ``x`` and each leaf of ``head_args`` are split into
    ``microbatches`` along dim 0, strided (micro-batch i holds rows i, i + m, ...: a batch split
    over a data axis leaves every micro-batch split the same way, without moving a row). In ``sf.parallelize`` on a
    mesh with ``axis`` of ``stages`` devices, the layers are split over it in blocks and the schedule runs;
    elsewhere the same
    numbers come from one device running the micro-batches in turn. Differentiating the result
    gives the schedule's gradients (computed with the loss; the loss must be the output that is
    differentiated — its gradient is linear in the seed). Partial: called without
    differentiating (an evaluation), it still runs the backward and drops it.

    ``layers_per_stage`` (e.g. [5, 4, 4, 3]) splits the layers unevenly: every stage holds as
    many as the largest, the padding ones skipped by a ``lax.cond`` (predication: the stage's
    program is the same on every device, its work is not). With v chunks per stage it has a
    count per virtual stage, p * v of them in the model's order.
    """
    leaves, layer_tree = jax.tree.flatten(layers)
    n_layers = {x.shape[0] for x in leaves}
    if len(n_layers) != 1:
        raise ValueError(f"pipeline: the stacked layers' leading dims differ: {sorted(n_layers)}")
    (n_layers,) = n_layers
    table = schedule if isinstance(schedule, Schedule) else by_name(schedule, stages, microbatches, chunks)
    p, m, v = table.stages, table.microbatches, table.chunks
    if x.shape[0] % m:
        raise ValueError(f"pipeline: a batch of {x.shape[0]} does not split into {m} micro-batches")
    _check_layer_and_head(layer_fn, head, layers, x, head_params, head_args, m)
    if layers_per_stage is not None:
        device_order, active, layer_fn = _uneven(layer_fn, tuple(layers_per_stage), n_layers, table)
        stage_tree = {"layer": jax.tree.map(device_order, layers), "active": active}
    else:
        if n_layers % (p * v):
            raise ValueError(
                f"pipeline: {n_layers} layers do not split into {p} stages x {v} chunks; "
                f"give layers_per_stage for an uneven split"
            )
        per_chunk = n_layers // (p * v)
        order = np.array([[table.virtual_stage(s, c) for c in range(v)] for s in range(p)])

        def device_order(leaf):  # [L, ...] -> [p, v, L / (p v), ...]
            blocks = leaf.reshape((p * v, per_chunk) + leaf.shape[1:])
            if (order.reshape(-1) == np.arange(p * v)).all():
                return blocks.reshape((p, v) + blocks.shape[1:])
            return blocks[order]

        stage_tree = jax.tree.map(device_order, layers)

    def micro(a):  # micro-batch i: rows i, i + m, i + 2m, ... (a batch split stays split)
        return a.reshape((a.shape[0] // m, m) + a.shape[1:]).swapaxes(0, 1)

    stage, layer_tree = jax.tree.flatten(stage_tree)
    head_leaves, head_tree = jax.tree.flatten(head_params)
    xs = micro(x)
    arg_leaves, arg_tree = jax.tree.flatten(jax.tree.map(micro, head_args))
    jaxprs = bodies_of(
        layer_fn,
        head,
        jax.tree.unflatten(layer_tree, [jax.ShapeDtypeStruct(a.shape[2:], a.dtype) for a in stage]),
        jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype),
        head_params,
        jax.tree.unflatten(arg_tree, [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in arg_leaves]),
    )
    params = dict(jaxprs._asdict(), table=table, axis=axis, counts=(len(stage), len(head_leaves), len(arg_leaves)))

    def bind(stage, head_leaves, xs, arg_leaves):
        outs = pipeline_p.bind(*stage, *head_leaves, xs, *arg_leaves, **params)
        ns, nh = len(stage), len(head_leaves)
        return outs[0], (outs[1 : 1 + ns], outs[1 + ns : 1 + ns + nh], outs[1 + ns + nh])

    @jax.custom_vjp
    def loss(stage, head_leaves, xs, arg_leaves):
        return bind(stage, head_leaves, xs, arg_leaves)[0]

    def loss_fwd(stage, head_leaves, xs, arg_leaves):
        value, grads = bind(stage, head_leaves, xs, arg_leaves)
        return value, grads

    def loss_bwd(grads, g):  # head_args (targets, masks) get no gradient
        d_stage, d_head, d_xs = grads
        scale = lambda ds: [d * g.astype(d.dtype) for d in ds]
        return scale(d_stage), scale(d_head), d_xs * g.astype(d_xs.dtype), [None] * len(arg_leaves)

    loss.defvjp(loss_fwd, loss_bwd)
    return loss(stage, head_leaves, xs, arg_leaves)


# ------------------------------------------------------------------------------ the rule
#
# On the pipeline axis the stage leaves are split by stage (dim 0) and everything else is whole;
# the bodies run whole on it (a device runs its own stages). On the other axes the bodies are
# sharded like a loop body, from the operands' NdSbps with the stacking dims (p, v for the
# stage leaves, m for xs and args) unsplit: an activation leaves a stage (forward, dx, the
# head's dy) as it entered, residuals go from forward to backward as forward made them, and the
# gradients come out as backward made them (partial where the batch is split).


def _inner(sbp, ax, lead):
    """The NdSbp inside the bodies of an operand with ``lead`` stacking dims."""
    return tuple(B if i == ax else (Split(s.dim - lead) if isinstance(s, Split) else s) for i, s in enumerate(sbp))


def outer_sbp(sbp, ax, lead, on_axis):
    """The NdSbp outside the bodies of a value that is ``sbp`` inside them, with ``lead``
    stacking dims in front and ``on_axis`` on the pipeline axis (``ax``)."""
    return tuple(
        on_axis if i == ax else (Split(s.dim + lead) if isinstance(s, Split) else s) for i, s in enumerate(sbp)
    )


def _operand(sbp, ax, lead, on_axis):
    """What the operand must be: ``on_axis`` on the pipeline axis; elsewhere as it is, except
    that stacking dims are not split and nothing is partial."""
    return tuple(
        on_axis if i == ax else (B if isinstance(s, Partial) or (isinstance(s, Split) and s.dim < lead) else s)
        for i, s in enumerate(sbp)
    )


def pipeline_axis(eqn, mesh) -> int | None:
    """The index of the pipeline's mesh axis, None where the mesh has none (the stages then
    run in turn); a ShardingError where the stages do not fit it."""
    table, axis, names = eqn.params["table"], eqn.params["axis"], tuple(mesh.axis_names)
    ax = names.index(axis) if axis in names else None
    if ax is None and table.stages > 1:
        raise ShardingError(
            f"{source_line(eqn)}: sf.pipeline over {table.stages} stages on axis {axis!r}, which "
            f"the mesh {dict(zip(names, mesh.devices.shape))} lacks"
        )
    if ax is not None and mesh.devices.shape[ax] != table.stages:
        raise ShardingError(
            f"{source_line(eqn)}: sf.pipeline over {table.stages} stages on mesh axis {axis!r} of "
            f"{mesh.devices.shape[ax]} devices"
        )
    return ax


def _propagate(prop, eqn):
    params, src = eqn.params, source_line(eqn)
    ax = pipeline_axis(eqn, prop.mesh)
    stage, head, xs, args = operand_groups(params, [prop.of(a) for a in eqn.invars])
    # Over an axis that splits the micro-batches (data parallel) a stage's weights enter whole:
    # gathered once a step and their gradients reduced once (ZeRO), where split (FSDP) the
    # bodies would gather them again for every micro-batch. Over the others (tensor parallel)
    # they stay as they are.
    data_axes = {i for i, s in enumerate(xs) if i != ax and s == Split(1)}
    whole_over_data = lambda sbp: tuple(B if i in data_axes else t for i, t in enumerate(sbp))
    stage = [whole_over_data(_operand(s, ax, 2, Split(0))) for s in stage]
    # The head runs on every device of the axis at once, split as its parameters are (a vocab
    # split over the stages shares the head's work out); replicated parameters run it whole.
    head = [
        whole_over_data(_operand(s, ax, 0, s[ax] if ax is not None and isinstance(s[ax], Split) else B)) for s in head
    ]
    xs = _operand(xs, ax, 1, B)
    args = [_operand(s, ax, 1, B) for s in args]
    chunk = [_inner(s, ax, 2) for s in stage]
    x = _inner(xs, ax, 1)

    def run(name, in_sbp):
        if ax is None or name == "head":
            return prop.run_body(open_jaxpr(params[name]), in_sbp, src)
        with prop.holding(ax):
            return prop.run_body(open_jaxpr(params[name]), in_sbp, src)

    forward, (_, *stored) = run("forward", chunk + [x])
    head_body, (loss, *d_head_and_dy) = run("head", head + [x] + [_inner(s, ax, 1) for s in args])
    on_axis = lambda sbp, entry=B: sbp if ax is None else tuple(entry if i == ax else s for i, s in enumerate(sbp))
    loss = on_axis(loss)
    d_head = [on_axis(d, h[ax] if ax is not None else B) for d, h in zip(d_head_and_dy[:-1], head)]
    backward, outs = run("backward", chunk + stored + [x])
    d_chunk = outs[:-1]
    backward_x, (_, *stash) = run("backward_x", chunk + stored + [x])
    backward_w, _ = run("backward_w", chunk + stored + stash)
    wanted = dict(
        forward=(x, *stored),
        head=(loss, *d_head, x),
        backward=(*d_chunk, x),
        backward_x=(x, *stash),
        backward_w=tuple(d_chunk),
    )
    outs = [loss] + [outer_sbp(s, ax, 2, Split(0)) for s in d_chunk] + d_head + [outer_sbp(x, ax, 1, B)]
    decision = Decision(
        tuple(stage + head + [xs] + args), tuple(outs), bodies=tuple((name, wanted[name]) for name in Bodies._fields)
    )
    rebody = lambda old, new: old.replace(jaxpr=new)
    return prop.decide(
        eqn,
        decision,
        src,
        forward=rebody(params["forward"], forward),
        head=rebody(params["head"], head_body),
        backward=rebody(params["backward"], backward),
        backward_x=rebody(params["backward_x"], backward_x),
        backward_w=rebody(params["backward_w"], backward_w),
    )


def body_runs(table: Schedule, staged: bool) -> dict:
    """How many times each body runs on a device in a step (averaged over the stages where
    they differ): forward and a backward per micro-batch and chunk, the head per micro-batch;
    the backward whole where the micro-batch's W runs in its B's step
    (``StepTables.tables["bw_whole"]``) or the stages run in turn (not ``staged``), else as
    backward_x and backward_w."""
    trips = table.microbatches * table.chunks
    whole = trips
    if staged:
        tabs = step_tables(table).tables
        whole = int(((tabs["b_chunk"] >= 0) & (tabs["bw_whole"] > 0)).sum()) / table.stages
        whole = int(whole) if whole == int(whole) else whole
    return dict(
        forward=trips, head=table.microbatches, backward=whole, backward_x=trips - whole, backward_w=trips - whole
    )


def _lower(local, eqn, ins):
    params = eqn.params
    bodies = callables(_bodies_param(params), run=local.body_fn)
    stage, head, xs, args = operand_groups(params, list(ins))
    if params["axis"] not in local.names:  # one stage: the micro-batches in turn
        loss, d_stage, d_head, d_xs = sequential(bodies, params["table"], stage, head, xs, args)
    else:
        loss, d_stage, d_head, d_xs = execute(bodies, params["table"], stage, head, xs, args, axis=params["axis"])
    return [loss.astype(params["head"].out_avals[0].dtype), *d_stage, *d_head, d_xs]


def _comm(eqn, ins, sigs, mesh):
    """Per step, one ppermute of an activation-sized block per kind (F, B) and direction the table
    sends it; per micro-batch, the last stage's output summed onto every device for the head
    (whose own collectives explain lists in its body); at the end, d xs summed over the stages."""
    params = eqn.params
    table, axis = params["table"], params["axis"]
    if axis not in mesh.axis_names or table.stages == 1:
        return []
    ax = mesh.axis_names.index(axis)
    _, _, xs, _ = operand_groups(params, list(eqn.invars))
    _, _, xs_sbp, _ = operand_groups(params, list(ins))
    x = jax.core.ShapedArray(xs.aval.shape[1:], xs.aval.dtype)
    n = mesh.devices.shape[ax]

    def all_reduce(aval, sbp):
        return Step(
            "all_reduce",
            (axis,),
            value=aval,
            bytes=int(2 * (n - 1) / n * math.prod(local_shape(aval.shape, sbp, mesh)) * aval.dtype.itemsize),
        )

    block = math.prod(local_shape(x.shape, _inner(xs_sbp, ax, 1), mesh)) * x.dtype.itemsize
    pl = step_tables(table)
    return (
        [Step("ppermute", (axis,), bytes=block, value=x)] * (pl.steps * len(pl.directions))
        + [all_reduce(x, _inner(xs_sbp, ax, 1))] * table.microbatches
        + [all_reduce(xs.aval, xs_sbp)]
    )


def _solve(builder, eqn, scale):
    from shardflow.pipeline_solve import solve_pipeline  # the solver's side, loaded when a pipeline is solved

    return solve_pipeline(builder, eqn, scale)


defrule(
    pipeline_p,
    propagate=_propagate,
    solve=_solve,
    lower=_lower,
    comm=_comm,
    comm_reason="passes activations and gradients between stages, gives the head the last stage's output, sums d xs",
    trips=lambda eqn, body, mesh: body_runs(eqn.params["table"], pipeline_axis(eqn, mesh) is not None)[body],
)
