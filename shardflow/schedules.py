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
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction

KINDS = ("F", "B", "W")
W_SLOTS = 2  # W's a stage may run in one step of the lockstep executor (``steps``)
LAYOUTS = ("loop", "v")


@dataclasses.dataclass(frozen=True)
class Action:
    """One cell of a schedule: ``kind`` ("F", "B" or "W") of ``microbatch`` through ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"an Action's kind is one of {', '.join(KINDS)}, got {self.kind!r}")
        for field in ("microbatch", "chunk"):
            value = getattr(self, field)
            if not _is_count(value, minimum=0):
                raise ValueError(f"an Action's {field} is an int >= 0, got {value!r}")

    def __str__(self) -> str:
        """``F3``; chunk 1 in lowercase, ``f3``; chunk 2 and up as a suffix, ``F3c2``."""
        if self.chunk == 1:
            return f"{self.kind.lower()}{self.microbatch}"
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")

    @staticmethod
    def parse(text: str) -> Action | None:
        """The Action that ``str`` prints (``F3``, ``f3``, ``B3c2``); ``.``, ``-`` or ``""`` is idle."""
        text = text.strip()
        if text in (".", "-", ""):
            return None
        match = _CELL.fullmatch(text)
        if match is None or (match.group("kind").islower() and match.group("chunk")):
            raise ValueError(
                f"cannot read {text!r} as an action: write F3 / B3 / W3 for microbatch 3 "
                f"(f3 for chunk 1, F3c2 for chunk 2) or . for idle"
            )
        kind, microbatch, chunk = match.group("kind"), int(match.group("mb")), match.group("chunk")
        if kind.islower():
            return Action(kind.upper(), microbatch, 1)
        return Action(kind, microbatch, int(chunk) if chunk else 0)


_CELL = re.compile(r"(?P<kind>[FBWfbw])(?P<mb>\d+)(?:c(?P<chunk>\d+))?")

Cell = Action | str | None


class _VirtualStages:
    """Which virtual stage each (stage, chunk) runs, and what each action waits for: all a schedule's
    dependencies follow from ``stages``, ``chunks`` and ``layout``."""

    stages: int
    chunks: int
    layout: str

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """Which block of the model's layers (0 first, ``stages * chunks - 1`` last) chunk ``chunk``
        of ``stage`` runs: ``chunk * p + stage`` ("loop"); for odd chunks of a "v" layout
        ``chunk * p + p - 1 - stage``, running back up the stages."""
        p = self.stages
        return chunk * p + (p - 1 - stage if self.layout == "v" and chunk % 2 else stage)

    def locate(self, virtual_stage: int) -> tuple[int, int]:
        """(stage, chunk) that runs ``virtual_stage``; the inverse of ``virtual_stage``."""
        chunk, offset = divmod(virtual_stage, self.stages)
        return (self.stages - 1 - offset if self.layout == "v" and chunk % 2 else offset), chunk

    def dependency(self, stage: int, action: Action) -> tuple[int, Action] | None:
        """(stage, action) that must run at an earlier tick than ``action`` on ``stage``: the forward
        of the virtual stage before, the backward of the virtual stage after (of the last virtual
        stage: its own forward), for W its own B; None for the first virtual stage's forwards."""
        k = self.virtual_stage(stage, action.chunk)
        mb = action.microbatch
        if action.kind == "W":
            return stage, Action("B", mb, action.chunk)
        if action.kind == "F":
            return None if k == 0 else self._run_by(k - 1, "F", mb)
        last = self.stages * self.chunks - 1
        return self._run_by(k, "F", mb) if k == last else self._run_by(k + 1, "B", mb)

    def _run_by(self, virtual_stage: int, kind: str, microbatch: int) -> tuple[int, Action]:
        stage, chunk = self.locate(virtual_stage)
        return stage, Action(kind, microbatch, chunk)


@dataclasses.dataclass(frozen=True)
class _Pipeline(_VirtualStages):
    stages: int
    chunks: int
    layout: str


@dataclasses.dataclass(frozen=True, repr=False)
class Schedule(_VirtualStages):
    """A validated table: ``rows[stage][tick]`` is the Action that stage runs at that tick, or None.

    ``schedule[tick, stage]`` reads one cell, ``actions[tick][stage]`` is the table tick-major. ``microbatches`` m,
    ``chunks`` v (layer chunks per stage), ``split_backward`` (B and W separate), ``layout`` ("loop" or "v": which
    virtual stage
    each chunk runs, see ``virtual_stage``), ``name`` (for messages and titles).
    """

    name: str
    rows: tuple[tuple[Action | None, ...], ...]
    microbatches: int
    chunks: int = 1
    split_backward: bool = False
    layout: str = "loop"

    def __post_init__(self):
        object.__setattr__(self, "rows", tuple(tuple(row) for row in self.rows))
        validate(self)

    # ------------------------------------------------------------------------------- shape
    @property
    def stages(self) -> int:
        return len(self.rows)

    @property
    def ticks(self) -> int:
        return len(self.rows[0]) if self.rows else 0

    @property
    def actions(self) -> tuple[tuple[Action | None, ...], ...]:
        """The table tick-major: ``actions[tick][stage]``, as a loop over ticks reads it."""
        return tuple(zip(*self.rows))

    def __getitem__(self, tick_stage: tuple[int, int]) -> Action | None:
        tick, stage = tick_stage
        return self.rows[stage][tick]

    def actions_of(self, stage: int) -> tuple[tuple[int, Action], ...]:
        """(tick, action) of every action ``stage`` runs, in tick order."""
        return tuple((t, a) for t, a in enumerate(self.rows[stage]) if a is not None)

    # ------------------------------------------------------------------------------- making
    @classmethod
    def from_table(
        cls,
        rows: str | Sequence[str | Sequence[Cell]],
        *,
        name: str = "custom",
        microbatches: int | None = None,
        chunks: int | None = None,
        split_backward: bool | None = None,
        layout: str = "loop",
    ) -> Schedule:
        """A Schedule from a table written by hand, validated.

        ``rows``: one row per stage, each a sequence of cells (an Action, None, or its text:
        ``F3``, ``f3``, ``B3c2``, ``.``) or one string of whitespace-separated cells; a row may
        start with a label ending in ``|``, as ``format`` prints. A single string is split into
        lines (where some contain ``|``, the others — ``format``'s title — are skipped), so
        ``Schedule.from_table(str(schedule))`` gives ``schedule`` back, named "custom".
        microbatches, chunks and split_backward default to what the table uses.
        """
        parsed = tuple(tuple(_cell(c) for c in _cells(row)) for row in _lines(rows))
        return cls(
            name, parsed, *_infer([a for row in parsed for a in row], microbatches, chunks, split_backward), layout
        )

    @classmethod
    def from_orders(
        cls,
        orders: Sequence[Sequence[Action | str]],
        *,
        name: str = "custom",
        microbatches: int | None = None,
        chunks: int | None = None,
        split_backward: bool | None = None,
        layout: str = "loop",
    ) -> Schedule:
        """A Schedule from the order in which each stage runs its actions: every action runs at the
        earliest tick after both the stage's previous action and its dependency (``dependency``).
        Raises ValueError, naming the stalled stage and the action it waits for, where the orders
        deadlock."""
        orders = [[_cell(a) for a in order] for order in orders]
        for stage, order in enumerate(orders):
            for a in order:
                if not isinstance(a, Action):
                    raise ValueError(
                        f"schedule {name!r}: stage {stage}'s order lists {a!r}; an order "
                        f"lists Actions (or their text, F3), no idle cells"
                    )
        m, v, split = _infer([a for order in orders for a in order], microbatches, chunks, split_backward)
        if layout not in LAYOUTS:
            raise ValueError(f"schedule {name!r}: layout is one of {LAYOUTS}, got {layout!r}")
        pipeline = _Pipeline(len(orders), v, layout)
        ran_at: dict[tuple[int, Action], int] = {}
        next_index = [0] * len(orders)
        rows: list[list[Action | None]] = [[] for _ in orders]
        tick = 0
        while any(i < len(order) for i, order in zip(next_index, orders)):
            runs = {}
            for stage, order in enumerate(orders):
                if next_index[stage] < len(order):
                    action = order[next_index[stage]]
                    dep = pipeline.dependency(stage, action)
                    if dep is None or ran_at.get(dep, tick) < tick:
                        runs[stage] = action
            if not runs:
                raise ValueError(_deadlock(name, pipeline, orders, next_index, tick))
            for stage, row in enumerate(rows):
                row.append(runs.get(stage))
                if stage in runs:
                    ran_at[stage, runs[stage]] = tick
                    next_index[stage] += 1
            tick += 1
        return cls(name, rows, m, v, split, layout)

    # ------------------------------------------------------------------------------- showing
    def title(self) -> str:
        parts = [f"{self.stages} stages", f"{self.microbatches} microbatches"]
        if self.chunks > 1:
            parts.append(f"{self.chunks} chunks per stage ({self.layout})")
        if self.split_backward:
            parts.append("split backward")
        return f"{self.name}: " + ", ".join(parts + [f"{self.ticks} ticks"])

    def format(self) -> str:
        """The table as text: a title line, then one line per stage, ``.`` where it is idle."""
        cells = [["." if a is None else str(a) for a in row] for row in self.rows]
        width = max((len(c) for row in cells for c in row), default=1)
        label = len(f"s{self.stages - 1}")
        return "\n".join(
            [self.title()]
            + [f"s{s}".ljust(label) + " | " + " ".join(c.rjust(width) for c in row) for s, row in enumerate(cells)]
        )

    __str__ = format

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
            f"chunks={self.chunks}, split_backward={self.split_backward}, layout={self.layout!r}, "
            f"ticks={self.ticks})"
        )

    def draw(self, ax=None):
        """The table as a matplotlib picture: one box per action (F, B, W in their own colors, later
        chunks lighter), its microbatch written in it. Draws on ``ax`` (a new Figure, no pyplot,
        when None) and returns the figure."""
        from matplotlib.colors import to_rgb
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle

        if ax is None:
            ax = Figure(
                figsize=(max(6.0, 0.3 * self.ticks + 1.5), 0.5 * self.stages + 1.3), layout="constrained"
            ).add_subplot()
        base = {"F": to_rgb("#3b6fb6"), "B": to_rgb("#e08a2c"), "W": to_rgb("#4a9a5b")}

        def color(action: Action):
            # later chunks are mixed with white: chunk 0 full color, the last chunk half-way.
            fade = 0.5 * action.chunk / (self.chunks - 1) if self.chunks > 1 else 0.0
            return tuple(c + (1 - c) * fade for c in base[action.kind])

        for stage in range(self.stages):
            for tick, action in self.actions_of(stage):
                ax.add_patch(
                    Rectangle((tick, stage + 0.05), 1, 0.9, facecolor=color(action), edgecolor="white", linewidth=0.5)
                )
                ax.text(
                    tick + 0.5,
                    stage + 0.5,
                    str(action.microbatch),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if action.chunk else "white",
                )
        ax.set_xlim(0, self.ticks)
        ax.set_ylim(self.stages, 0)
        ax.set_yticks([s + 0.5 for s in range(self.stages)], [f"stage {s}" for s in range(self.stages)])
        ax.set_xlabel("tick")
        ax.set_title(self.title(), fontsize=9)
        kinds = [k for k in KINDS if k != "W" or self.split_backward]
        names = {
            "F": "F forward",
            "B": "B backward" + (" (inputs)" if self.split_backward else ""),
            "W": "W backward (weights)",
        }
        handles = [Patch(facecolor=base[k], label=names[k]) for k in kinds]
        if self.chunks > 1:
            handles.append(
                Patch(facecolor=color(Action("F", 0, self.chunks - 1)), label=f"chunk {self.chunks - 1} (lighter)")
            )
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
        return ax.figure


# ----------------------------------------------------------------------------------- validation
def validate(schedule: Schedule) -> Schedule:
    """Raise ValueError, naming the tick, the stage and the action, unless ``schedule`` is runnable:
    every cell an Action of a known microbatch and chunk (W only where the backward is split), at
    most once per stage; every action at a tick strictly after its ``dependency``; every
    (microbatch, chunk) of every stage run F, B and, where split, W. Returns ``schedule``."""
    s = schedule
    where = f"schedule {s.name!r}"
    if not s.rows:
        raise ValueError(f"{where}: a schedule needs at least one stage (one row)")
    for field in ("microbatches", "chunks"):
        if not _is_count(getattr(s, field), minimum=1):
            raise ValueError(f"{where}: {field} must be an int >= 1, got {getattr(s, field)!r}")
    if s.layout not in LAYOUTS:
        raise ValueError(f"{where}: layout is one of {LAYOUTS}, got {s.layout!r}")
    for stage, row in enumerate(s.rows):
        if len(row) != s.ticks:
            raise ValueError(
                f"{where}: stage {stage} has {len(row)} ticks, stage 0 has {s.ticks}; "
                f"every stage needs a cell (an action or None) at every tick"
            )

    ran_at: dict[tuple[int, Action], int] = {}
    for tick in range(s.ticks):
        for stage in range(s.stages):
            action = s.rows[stage][tick]
            if action is None:
                continue
            at = f"{where}: tick {tick}, stage {stage}"
            if not isinstance(action, Action):
                raise ValueError(f"{at}: a cell is an Action or None, got {action!r}")
            if action.kind == "W" and not s.split_backward:
                raise ValueError(
                    f"{at}: {action} in a schedule without a split backward "
                    f"(split_backward=False: B is the whole backward)"
                )
            if action.microbatch >= s.microbatches:
                raise ValueError(
                    f"{at}: {action} names microbatch {action.microbatch}, "
                    f"the schedule has {s.microbatches} (0 to {s.microbatches - 1})"
                )
            if action.chunk >= s.chunks:
                raise ValueError(f"{at}: {action} names chunk {action.chunk}, the schedule has {s.chunks} per stage")
            if (stage, action) in ran_at:
                raise ValueError(f"{at}: {action} runs a second time (first at tick {ran_at[stage, action]})")
            ran_at[stage, action] = tick

    for tick in range(s.ticks):
        for stage in range(s.stages):
            action = s.rows[stage][tick]
            dep = None if action is None else s.dependency(stage, action)
            if dep is not None and not ran_at.get(dep, tick) < tick:
                dep_stage, dep_action = dep
                when = f"it runs at tick {ran_at[dep]}" if dep in ran_at else "it never runs"
                raise ValueError(
                    f"{where}: tick {tick}, stage {stage}: {action} needs {dep_action} "
                    f"on stage {dep_stage} at an earlier tick; {when}"
                )

    kinds = KINDS if s.split_backward else ("F", "B")
    for stage in range(s.stages):
        for chunk in range(s.chunks):
            for mb in range(s.microbatches):
                for kind in kinds:
                    if (stage, Action(kind, mb, chunk)) not in ran_at:
                        raise ValueError(f"{where}: stage {stage} never runs {Action(kind, mb, chunk)} (at no tick)")
    return schedule


def with_split_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with every B of an unsplit schedule run as B (inputs) then W (weights), at
    the stage's next tick. The executor runs a table in lockstep — a tick lasts as long as its
    slowest action — so an unsplit backward (two forwards' work) beside a forward would make
    every mixed tick a double one; split, each action is one forward's work."""
    if schedule.split_backward:
        return schedule
    orders = [
        [
            b
            for _, a in schedule.actions_of(stage)
            for b in ((a, Action("W", a.microbatch, a.chunk)) if a.kind == "B" else (a,))
        ]
        for stage in range(schedule.stages)
    ]
    return Schedule.from_orders(
        orders,
        name=schedule.name,
        microbatches=schedule.microbatches,
        chunks=schedule.chunks,
        split_backward=True,
        layout=schedule.layout,
    )


# ----------------------------------------------------------------------------------- builders
def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every stage runs all m forwards, then all m backwards."""
    _check_sizes("gpipe", p, m)
    order = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    return Schedule.from_orders([order] * p, name="gpipe", microbatches=m, chunks=1, split_backward=False)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron-LM): stage s runs p-1-s warm-up forwards, then alternates
    one forward and one backward, then runs the remaining backwards — at most p-s microbatches
    in flight on stage s, against GPipe's m."""
    _check_sizes("1f1b", p, m)
    orders = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        order = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", warmup + i), Action("B", i)]
        order += [Action("B", i) for i in range(m - warmup, m)]
        orders.append(order)
    return Schedule.from_orders(orders, name="1f1b", microbatches=m, chunks=1, split_backward=False)


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): each stage holds v chunks of layers,
    chunk c of stage s running virtual stage c*p + s. Microbatches go in groups of p: the forwards
    of a group through chunk 0, then through chunk 1, ...; the backwards in the same order from
    the last chunk down. Needs m to be a multiple of p."""
    _check_sizes("interleaved", p, m)
    if not _is_count(v, minimum=2):
        raise ValueError(
            f"interleaved: v (chunks per stage) must be an int >= 2, got {v!r}; with one chunk per stage use '1f1b'"
        )
    if m % p:
        raise ValueError(
            f"interleaved: the number of microbatches must be a multiple of the number "
            f"of stages (the schedule runs microbatches in groups of p = {p}), got m = {m}; "
            f"use m = {m // p * p or p} or {(m // p + 1) * p}"
        )

    def nth(k: int, kind: str) -> Action:
        group, r = divmod(k, p * v)
        chunk = r // p if kind == "F" else v - 1 - r // p
        return Action(kind, group * p + r % p, chunk)

    total = m * v
    orders = []
    for s in range(p):
        # Megatron's warm-up: forwards enough to cover the first backward's trip back to stage s.
        warmup = min((p - 1 - s) * 2 + (v - 1) * p, total)
        order = [nth(k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            order += [nth(warmup + k, "F"), nth(k, "B")]
        order += [nth(k, "B") for k in range(total - warmup, total)]
        orders.append(order)
    return Schedule.from_orders(orders, name="interleaved", microbatches=m, chunks=v, split_backward=False)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into
    B (for the inputs, on the critical path) and W (for the weights, free to move). Stage s runs
    1F1B's order with each B followed by a W, except that it holds back its first s W's; they run
    in the cool-down, where 1F1B waits for backwards. Same in-flight microbatches as 1F1B."""
    _check_sizes("zb-h1", p, m)
    orders = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        order = [Action("F", i) for i in range(warmup)]
        held: collections.deque[Action] = collections.deque()

        def backward(i: int, run_one_w: bool):
            order.append(Action("B", i))
            held.append(Action("W", i))
            if run_one_w:
                order.append(held.popleft())

        for i in range(m - warmup):
            order.append(Action("F", warmup + i))
            backward(i, run_one_w=i >= s)
        for i in range(m - warmup, m):
            backward(i, run_one_w=True)
        orders.append(order + list(held))
    return Schedule.from_orders(orders, name="zb-h1", microbatches=m, chunks=1, split_backward=True)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): two chunks per stage in
    a V — chunk 0 of stage s runs virtual stage s on the way down, chunk 1 virtual stage 2p-1-s on
    the way back up, so stage 0 holds the first layers and the loss — with B and W split.

    Stage s's order, in phases: forwards of chunk 0 until the first microbatch comes back up to
    its chunk 1; forwards alternating chunk 1 and chunk 0 until the first backward arrives;
    F, B, W of chunk 1; then the steady F B W of chunk 0 and of chunk 1 in turn; the cool-down
    runs the backwards, filling the waits with held-back W's. From m = 2p-1 on, every stage works
    without a gap from its first action to its last, the table is 6m + p - 1 ticks (the last stage
    can start no earlier than tick p-1), and at most 2p (microbatch, chunk) activations — p
    stages' worth, as 1F1B's first stage — are live on any stage. Fewer microbatches cut the
    warm-up short, with a few idle ticks."""
    _check_sizes("zb-v", p, m)
    orders = []
    for s in range(p):
        order: list[Action] = []
        ran = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}  # per kind and chunk: how many so far

        def has_next(kind: str, chunk: int) -> bool:
            n = ran[kind][chunk]
            if kind == "F":  # chunk 1's forward of a microbatch comes after chunk 0's
                return n < m and (chunk == 0 or n < ran["F"][0])
            if kind == "B":  # chunk 0's backward of a microbatch comes after chunk 1's
                return n < ran["F"][chunk] and (chunk == 1 or n < ran["B"][1])
            return n < ran["B"][chunk]

        def run(pattern: str, times: int = 1):
            """``times`` times: each step of ``pattern`` ("F0 B1" = F of chunk 0, B of chunk 1)
            that the stage has left to run."""
            for _ in range(times):
                for kind, chunk in ((step[0], int(step[1])) for step in pattern.split()):
                    if has_next(kind, chunk):
                        order.append(Action(kind, ran[kind][chunk], chunk))
                        ran[kind][chunk] += 1

        run("F0", 2 * (p - s) - 1)  # until microbatch 0 is back up at this stage's chunk 1
        run("F1 F0", s)  # until its backward arrives
        run("F1 B1 W1", p - s)
        while ran["F"][1] < m:
            run("F0 B0 W0 F1 B1 W1")
        run("B0 B1", s)
        run("B0 W0", p - s)
        while ran["B"][0] < m:
            run("B0 B1")
        run("W1", m)  # the held-back W's
        run("W0", m)
        orders.append(order)
    return Schedule.from_orders(orders, name="zb-v", microbatches=m, chunks=2, split_backward=True, layout="v")


def one_f_one_b_fused(p: int, m: int) -> Schedule:
    """1F1B for a lockstep executor: at step t stage s runs the forward of microbatch t - s and
    the backward, B then W, of microbatch t - (2p - 1 - s) — each step one F, one B and one W on
    every stage in the steady state (three ticks of the table, one ``step``). Where 1F1B's ticks
    mix a forward on one stage with a backward on its neighbour, and so last as long as the
    slower, these steps each do a microbatch's whole work on every stage, whatever F, B and W
    cost (a backward that recomputes its forward included): m + 2p - 1 steps, lockstep time
    (m + p - 1)(F + B + W), 1F1B's bubble (p - 1)/(m + p - 1). The price: 2(p - s) microbatches
    in flight on stage s, twice 1F1B's."""
    _check_sizes("1f1b-fused", p, m)
    n_steps = m + 2 * p - 1
    rows: list[list[Action | None]] = [[None] * (3 * n_steps) for _ in range(p)]
    for s in range(p):
        for i in range(m):
            rows[s][3 * (i + s)] = Action("F", i)
            backward = i + 2 * p - 1 - s
            rows[s][3 * backward + 1] = Action("B", i)
            rows[s][3 * backward + 2] = Action("W", i)
    return Schedule("1f1b-fused", rows, m, 1, True)


def zb_fused(p: int, m: int) -> Schedule:
    """ZB-H1's bubble for a lockstep executor: ``1f1b-fused``'s steps, with W moved out of the
    steps whose length is set by a stage running F and B while another runs less — where stage 0
    has no B yet (the warm-up) or no F left (the cool-down), stage s > 0 runs F and B and holds
    its W, 2s of them in all; it runs them at the end, two a step, in the s steps after its last
    B, which stage 0's B and W make as long as two W's. So the steps that were F + B + W long
    are F + B (warm-up) or B + max(F, W) (cool-down): with F = B = W, ZB-H1's bubble
    (p-1)/(3m+p-1) at every step a table of four ticks (F, B, W, W). The price: stage s holds
    the stash of 2s micro-batches' B for their W (1f1b-fused none), and their residuals (every
    stage as many as stage 0 holds in 1f1b-fused, 2p)."""
    _check_sizes("zb-fused", p, m)
    n_steps, ticks = m + 2 * p - 1, 2 + W_SLOTS  # a step's ticks: F, B, then its W slots
    forward = lambda s, t: 0 <= t - s < m  # stage s runs F(t - s) at step t
    backward = lambda s, t: 0 <= t - (2 * p - 1 - s) < m  # and B(t - (2p - 1 - s))
    rows: list[list[Action | None]] = [[None] * (ticks * n_steps) for _ in range(p)]
    for s in range(p):
        held = []
        for t in range(n_steps):
            if forward(s, t):
                rows[s][ticks * t] = Action("F", t - s)
            if backward(s, t):
                w = Action("W", t - (2 * p - 1 - s))
                rows[s][ticks * t + 1] = Action("B", w.microbatch)
                if s > 0 and forward(s, t) and not (forward(0, t) and backward(0, t)):
                    held.append(w)
                else:
                    rows[s][ticks * t + 2] = w
        last_b = m - 1 + 2 * p - 1 - s
        free = [ticks * t + k for t in range(last_b + 1, n_steps) for k in range(2, ticks)]
        assert len(held) <= len(free), (p, m, s, held)
        for w, tick in zip(held, free):
            rows[s][tick] = w
    return Schedule("zb-fused", rows, m, 1, True)


BUILTIN: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "1f1b-fused": one_f_one_b_fused,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "zb-fused": zb_fused,
}
_CHUNKS = {"gpipe": 1, "1f1b": 1, "1f1b-fused": 1, "zb-h1": 1, "zb-v": 2, "zb-fused": 1}


def by_name(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """The built-in schedule a config names: "gpipe", "1f1b", "1f1b-fused", "interleaved" (v chunks
    per stage, 2 by default), "zb-h1" or "zb-v"."""
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if key not in BUILTIN:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; the built-in ones are "
            f"{', '.join(BUILTIN)} (or pass a Schedule of your own)"
        )
    if key == "interleaved":
        return interleaved_1f1b(p, m, 2 if v is None else v)
    if v is not None and v != _CHUNKS[key]:
        raise ValueError(
            f"schedule {key!r} runs {_CHUNKS[key]} chunk(s) per stage, got v = {v}; "
            f"v chooses the chunks of 'interleaved' only"
        )
    return BUILTIN[key](p, m)


# ----------------------------------------------------------------------------------- measures
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


# ----------------------------------------------------------------------------------- helpers
def _is_count(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_sizes(name: str, p: int, m: int) -> None:
    for what, value in (("p (stages)", p), ("m (microbatches)", m)):
        if not _is_count(value, minimum=1):
            raise ValueError(f"{name}: {what} must be an int >= 1, got {value!r}")


def _lines(rows: str | Sequence) -> Sequence:
    if not isinstance(rows, str):
        return rows
    lines = [line for line in rows.splitlines() if line.strip()]
    return [line for line in lines if "|" in line] if any("|" in line for line in lines) else lines


def _cells(row: str | Sequence[Cell]) -> Sequence[Cell]:
    return row.rsplit("|", 1)[-1].split() if isinstance(row, str) else row


def _cell(cell: Cell) -> Action | None:
    return Action.parse(cell) if isinstance(cell, str) else cell


def _infer(actions: list, microbatches, chunks, split_backward) -> tuple[int, int, bool]:
    """microbatches, chunks and split_backward of a hand-written table: what it uses, unless given."""
    actions = [a for a in actions if isinstance(a, Action)]
    if microbatches is None:
        microbatches = max((a.microbatch for a in actions), default=-1) + 1
    if chunks is None:
        chunks = max((a.chunk for a in actions), default=0) + 1
    if split_backward is None:
        split_backward = any(a.kind == "W" for a in actions)
    return microbatches, chunks, split_backward


def _deadlock(name: str, pipeline: _Pipeline, orders, next_index, tick: int) -> str:
    stage = next(s for s, order in enumerate(orders) if next_index[s] < len(order))
    action = orders[stage][next_index[stage]]
    dep_stage, dep_action = pipeline.dependency(stage, action)
    dep_order = orders[dep_stage]
    if dep_action not in dep_order:
        why = f"which stage {dep_stage}'s order never runs"
    else:
        why = (
            f"which stage {dep_stage}'s order runs after its next action "
            f"{dep_order[next_index[dep_stage]]}, itself waiting"
        )
    return (
        f"schedule {name!r}: the orders deadlock at tick {tick}: stage {stage}'s next action "
        f"{action} needs {dep_action} on stage {dep_stage}, {why}"
    )
