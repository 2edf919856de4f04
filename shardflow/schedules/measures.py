"""What a schedule costs: its timeline under per-action durations, makespan, bubble, the
steps a lockstep executor groups its ticks into, and the activations it keeps alive."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

from shardflow.schedules.table import KINDS, W_SLOTS, Action, Schedule

Costs = Mapping[str, int | float]


def default_costs(schedule: Schedule) -> dict[str, int]:
    """Time per action in units of one forward through one chunk: F = B = W = 1 where the backward
    is split (the Zero Bubble papers' T_F = T_B = T_W), else F = 1, B = 2 (the whole backward,
    B + W, about twice a forward)."""
    return {"F": 1, "B": 1, "W": 1} if schedule.split_backward else {"F": 1, "B": 2}


def steps(schedule: Schedule) -> tuple[range, ...]:
    """The table's ticks grouped into the steps a lockstep executor runs (``shardflow.pipelining``):
    in a step each stage runs at most one F, one B and ``W_SLOTS`` W's, in that order, and data
    crosses between stages only at the step's end. A tick joins the step before it unless one of
    its actions would run on its stage after an action of a later kind (F < B < W), after an F or
    B of its own kind, or as a W past the step's W slots, or needs an action of that step other
    than its own stage's B (a W after its B); the last virtual stage's B needs its F a step
    earlier (the head runs at the end of a step). So a stage runs its actions in the table's
    order, and holds what the table holds."""
    groups, current, kinds, ran_in = [], [], {}, {}
    for tick, row in enumerate(schedule.actions):
        actions = [(stage, a) for stage, a in enumerate(row) if a is not None]

        def joins(stage, action):
            dep = schedule.dependency(stage, action)
            same_step = dep is not None and dep in ran_in
            ran = kinds.get(stage, [])
            in_order = all(KINDS.index(k) < KINDS.index(action.kind) or k == action.kind == "W" for k in ran)
            return (
                in_order
                and ran.count("W") < W_SLOTS
                and (not same_step or (dep[0] == stage and dep[1].kind == "B" and action.kind == "W"))
            )

        if current and not all(joins(s, a) for s, a in actions):
            groups.append(range(current[0], current[-1] + 1))
            current, kinds, ran_in = [], {}, {}
        current.append(tick)
        for stage, action in actions:
            kinds.setdefault(stage, []).append(action.kind)
            ran_in[stage, action] = tick
    if current:
        groups.append(range(current[0], current[-1] + 1))
    return tuple(groups)


def timeline(schedule: Schedule, costs: Costs | None = None, *, lockstep: bool = False):
    """When each action runs, given what each costs (``default_costs``, updated by ``costs``).

    Returns, per stage, ``(start, end, action)`` in the table's order. By default each stage runs
    its actions in the table's order, each as soon as the stage is free and the action's
    dependency has ended (communication free) — the time the papers' formulas count, and what a
    runtime achieves whose stages wait only for the data they receive. ``lockstep=True``: every
    step (``steps``) starts when the step before has ended on every stage, a stage running its
    actions of the step one after the other — what a loop over steps with a collective per step
    achieves. With unit costs and a step per tick, lockstep is the table itself, and so is the
    default for a table placed by ``from_orders`` (every builder's but 1f1b-fused).
    """
    cost = {**default_costs(schedule), **(costs or {})}
    spans: list[list[tuple]] = [[] for _ in range(schedule.stages)]
    if lockstep:
        step_start = 0
        for step in steps(schedule):
            longest = 0
            for stage in range(schedule.stages):
                end = step_start
                for tick in step:
                    action = schedule.rows[stage][tick]
                    if action is not None:
                        spans[stage].append((end, end + cost[action.kind], action))
                        end += cost[action.kind]
                longest = max(longest, end - step_start)
            step_start += longest
        return tuple(tuple(row) for row in spans)
    ends: dict[tuple[int, Action], int | float] = {}
    free = [0] * schedule.stages
    for tick in range(schedule.ticks):
        for stage in range(schedule.stages):
            action = schedule.rows[stage][tick]
            if action is None:
                continue
            dep = schedule.dependency(stage, action)
            start = max(free[stage], 0 if dep is None else ends[dep])
            end = start + cost[action.kind]
            ends[stage, action] = free[stage] = end
            spans[stage].append((start, end, action))
    return tuple(tuple(row) for row in spans)


def makespan(schedule: Schedule, costs: Costs | None = None, *, lockstep: bool = False):
    """The time from the first action's start to the last one's end (``timeline``)."""
    return max(end for row in timeline(schedule, costs, lockstep=lockstep) for _, end, _ in row)


def bubble_fraction(schedule: Schedule, costs: Costs | None = None, *, lockstep: bool = False) -> float:
    """Idle time over all time: ``1 - work / (stages * makespan)``, every stage counted over the
    whole step (``timeline``'s). GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1)."""
    spans = timeline(schedule, costs, lockstep=lockstep)
    total = schedule.stages * max(end for row in spans for _, end, _ in row)
    work = sum(end - start for row in spans for start, end, _ in row)
    return float(Fraction(total - work) / Fraction(total))


def bubble_rate(schedule: Schedule, costs: Costs | None = None, *, lockstep: bool = False) -> float:
    """Bubble over ideal time, as Megatron-LM ((p-1)/m for 1F1B) and the Zero Bubble papers
    ((p-1)/(3m) for ZB-H1, 0 for ZB-V) state it: the largest, over stages, of the stage's idle time
    between its first action's start and its last action's end, over its work. It leaves out the
    time before a stage's first action and after its last, which consecutive steps overlap when
    nothing synchronizes the stages in between; where stage 0 spans the step (GPipe, 1F1B,
    interleaved, ZB-H1) it is the whole step's bubble over its ideal time."""
    rates = []
    for row in timeline(schedule, costs, lockstep=lockstep):
        work = sum(Fraction(end) - Fraction(start) for start, end, _ in row)
        rates.append((Fraction(row[-1][1]) - Fraction(row[0][0]) - work) / work)
    return float(max(rates))


def peak_live_activations(schedule: Schedule, *, held_until: str = "W") -> tuple[int, ...]:
    """Per stage, the most (microbatch, chunk) activations held at once: from the tick of the F that
    makes one to the tick of the action that frees it. ``held_until="W"``: its W where the backward
    is split (W needs the layer inputs F saved), else its B; ``"B"``: its B (the Zero Bubble papers'
    count, for which W's saved inputs are the smaller M_W). A chunk's activations are 1/chunks of
    a stage's: interleaved and ZB-V count in chunks."""
    if held_until not in ("B", "W"):
        raise ValueError(f"held_until is 'B' or 'W', got {held_until!r}")
    freed_by = "W" if held_until == "W" and schedule.split_backward else "B"
    peaks = []
    for row in schedule.rows:
        live = peak = 0
        for action in row:
            if action is not None:
                live += (action.kind == "F") - (action.kind == freed_by)
                peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)
