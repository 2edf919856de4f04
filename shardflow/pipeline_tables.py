"""The tables the pipeline executor runs by: a schedule's ticks grouped into lockstep steps
(``schedules.steps``), each stage's F, B and W per step, and the slots (residuals, stash, inboxes)
assigned by interval colouring, so a stage holds as many as its schedule keeps alive at once."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from shardflow.schedules import W_SLOTS, Schedule, steps, with_split_backward


def placements(table: Schedule) -> dict:
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
    where = placements(table)
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
