"""A schedule's table: ``Action`` (a cell), ``Schedule`` (the validated table, read from rows or
built from each stage's order), ``validate`` and ``with_split_backward``."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

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
            if not is_count(value, minimum=0):
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
        if not is_count(getattr(s, field), minimum=1):
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


def is_count(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_sizes(name: str, p: int, m: int) -> None:
    for what, value in (("p (stages)", p), ("m (microbatches)", m)):
        if not is_count(value, minimum=1):
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
