"""Pipeline schedules as data: which action each stage runs at each tick.

A schedule is a table, one row per pipeline stage and one column per tick; a cell is an
``Action`` or idle (``None``):

    1f1b: 4 stages, 8 microbatches, 22 ticks
    s0 | F0 F1 F2 F3  .  .  . B0 F4 B1 F5 B2 F6 B3 F7 B4  . B5  . B6  . B7
    s1 |  . F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5  . B6  . B7  .
    s2 |  .  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6  . B7  .  .
    s3 |  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7  .  .  .

``Action(kind, microbatch, chunk)``: ``F`` runs one microbatch forward through one chunk of the
stage's layers; ``B`` runs it backward — for the inputs only where the schedule splits the backward
(``split_backward``), else the whole backward; ``W`` is the backward for the weights, split
schedules only. A stage holds ``chunks`` chunks of layers; chunk ``c`` of stage ``s`` runs the
model's virtual stage ``schedule.virtual_stage(s, c)``: ``c * p + s`` where the chunks loop
around the stages (``layout="loop"``, Megatron's interleaved schedule), and ``c * p + p - 1 - s``
for odd chunks where they come back up the stages (``layout="v"``, ZB-V), so that the last
virtual stage — the loss — sits on stage 0.

Every action takes one tick, and runs at a tick strictly after the action it depends on:
the forward of the virtual stage before it, the backward of the virtual stage after it (the last
virtual stage's backward: its own forward), and, for W, its own B. ``validate`` checks this and
that every (microbatch, virtual stage) runs each of F, B (and W) exactly once; a ``Schedule`` is
validated when it is made, so every Schedule is a valid one.

The builders write the order in which each stage runs its actions, as in the papers, and
``Schedule.from_orders`` places every action at the earliest tick its dependency allows.
``timeline`` puts durations on the table (one forward = 1; ``default_costs``), ``bubble_fraction``
/ ``bubble_rate`` / ``peak_live_activations`` measure it, ``Schedule.format`` prints it and
``Schedule.draw`` draws it (matplotlib, imported only there).

The package: ``table`` (Action, Schedule, validate), the builders by family (``whole_backward``,
``zero_bubble``, ``lockstep``), ``builtin`` (the schedules by config name) and ``measures``.
"""

from shardflow.schedules.builtin import BUILTIN, by_name
from shardflow.schedules.lockstep import one_f_one_b_fused, zb_fused
from shardflow.schedules.measures import (
    Costs,
    bubble_fraction,
    bubble_rate,
    default_costs,
    makespan,
    peak_live_activations,
    steps,
    timeline,
)
from shardflow.schedules.table import KINDS, LAYOUTS, W_SLOTS, Action, Cell, Schedule, validate, with_split_backward
from shardflow.schedules.whole_backward import gpipe, interleaved_1f1b, one_f_one_b
from shardflow.schedules.zero_bubble import zb_h1, zb_v

__all__ = [
    "KINDS",
    "LAYOUTS",
    "W_SLOTS",
    "Action",
    "Cell",
    "Costs",
    "Schedule",
    "validate",
    "with_split_backward",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_v",
    "one_f_one_b_fused",
    "zb_fused",
    "BUILTIN",
    "by_name",
    "default_costs",
    "steps",
    "timeline",
    "makespan",
    "bubble_fraction",
    "bubble_rate",
    "peak_live_activations",
]
