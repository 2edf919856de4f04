"""shardflow.schedules: every built-in table is valid and has its paper's bubble and memory.

Time is measured in forwards of one chunk (``default_costs``): F = B = W = 1 where the backward is
split, else F = 1 and B = 2 (the whole backward). Bubble fraction: idle over all time of the step;
bubble rate: bubble over ideal time (Megatron-LM's and the Zero Bubble papers' figure)."""

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fast_tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow import schedules as sched
from shardflow.schedules import Action, Schedule

SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
DOC = Path(__file__).resolve().parents[1] / "docs" / "explanation" / "pipeline-schedules.md"


def idle_time(schedule, **kw):
    """Idle time summed over stages, over the whole step."""
    spans = sched.timeline(schedule, **kw)
    return schedule.stages * sched.makespan(schedule, **kw) - sum(e - s for row in spans for s, e, _ in row)


# ----------------------------------------------------------------------------------- validity
@pytest.mark.parametrize("name", list(sched.BUILTIN))
@pytest.mark.parametrize("p,m", SIZES)
def test_every_builtin_table_is_valid_and_reads_back_from_its_text(name, p, m):
    s = sched.by_name(name, p, m)
    assert sched.validate(s) is s
    assert (s.name, s.stages, s.microbatches) == (name, p, m)
    v = s.chunks
    kinds = "FBW" if s.split_backward else "FB"
    for stage in range(p):
        ran = [a for _, a in s.actions_of(stage)]
        assert len(ran) == len(set(ran)) == len(kinds) * m * v
    assert Schedule.from_table(str(s), name=name, layout=s.layout) == s


@settings(max_examples=examples(40), deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 20))
def test_builders_are_valid_for_any_size(p, m):
    for name in ("gpipe", "1f1b", "zb-h1", "zb-v"):
        sched.by_name(name, p, m)  # a Schedule is validated when made
    assert sched.peak_live_activations(sched.one_f_one_b(p, m)) == tuple(min(p - s, m) for s in range(p))
    assert sched.peak_live_activations(sched.zb_h1(p, m), held_until="B") == tuple(min(p - s, m) for s in range(p))
    assert sched.peak_live_activations(sched.zb_v(p, m)) == tuple(min(m + 1 + s, 2 * m, 2 * p) for s in range(p))


@settings(max_examples=examples(20), deadline=None)
@given(p=st.integers(1, 6), groups=st.integers(1, 4), v=st.integers(2, 4))
def test_interleaved_is_valid_for_any_multiple_of_p(p, groups, v):
    m = groups * p
    s = sched.interleaved_1f1b(p, m, v)
    assert sched.bubble_fraction(s) == (p - 1) / (v * m + p - 1)


def test_virtual_stages_loop_for_interleaved_and_turn_back_for_zb_v():
    inter, v_shape = sched.interleaved_1f1b(4, 8, 2), sched.zb_v(4, 8)
    assert [inter.virtual_stage(s, c) for c in (0, 1) for s in range(4)] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [v_shape.virtual_stage(s, c) for c in (0, 1) for s in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    for s in (inter, v_shape, sched.interleaved_1f1b(3, 3, 3)):
        assert all(s.locate(s.virtual_stage(st_, c)) == (st_, c) for st_ in range(s.stages) for c in range(s.chunks))
    assert v_shape.locate(7) == (0, 1)  # the loss is on stage 0
    assert v_shape.dependency(3, Action("F", 2, 1)) == (3, Action("F", 2, 0))  # the V's turn
    assert v_shape.dependency(0, Action("B", 2, 1)) == (0, Action("F", 2, 1))  # the loss's backward


# ----------------------------------------------------------------------------------- bubbles
@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    for s in (sched.gpipe(p, m), sched.one_f_one_b(p, m)):
        assert sched.makespan(s) == 3 * (m + p - 1)
        assert sched.bubble_fraction(s) == (p - 1) / (m + p - 1)  # idle / all time
        assert sched.bubble_fraction(s, {"B": 1}) == (p - 1) / (m + p - 1)  # the table's own cells
        assert sched.bubble_rate(s) == (p - 1) / m  # bubble / ideal time


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p,m", SIZES)
def test_interleaved_bubble_is_p_minus_1_over_v_m_plus_p_minus_1(p, m, v):
    s = sched.interleaved_1f1b(p, m, v)
    assert sched.makespan(s) == 3 * (v * m + p - 1)  # in forwards of one chunk, 1/v of a stage's
    assert sched.bubble_fraction(s) == (p - 1) / (v * m + p - 1)
    assert sched.bubble_rate(s) == (p - 1) / (v * m)  # Megatron: (1/v) (p-1)/m


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    zb, base = sched.zb_h1(p, m), sched.one_f_one_b(p, m)
    assert idle_time(zb) == p * (p - 1) and idle_time(base) == 3 * p * (p - 1)  # same time unit: one F
    assert sched.makespan(zb) == 3 * m + p - 1
    assert sched.bubble_rate(zb) == (p - 1) / (3 * m)  # the paper's (p-1)/3m against 1F1B's (p-1)/m
    assert sched.bubble_fraction(zb) == (p - 1) / (3 * m + p - 1)


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_v_has_no_bubble_inside_any_stage_from_2p_minus_1_microbatches(p, m):
    s = sched.zb_v(p, m)
    if m >= 2 * p - 1:
        # 6m unit actions per stage; the last stage's first forward runs at tick p-1 at the earliest.
        assert sched.makespan(s) == 6 * m + p - 1
        assert sched.bubble_fraction(s) == (p - 1) / (6 * m + p - 1)
        assert sched.bubble_rate(s) == 0.0
    else:  # m = p: the warm-up is cut short
        assert sched.makespan(s) == 6 * m + p - 1 + (p - 2)


def test_lockstep_ticks_last_as_long_as_their_slowest_action():
    for name in sched.BUILTIN:
        if name in ("1f1b-fused", "zb-fused"):  # three or four ticks a step: test_fused_1f1b_in_lockstep
            continue
        s = sched.by_name(name, 4, 8)
        unit = {"F": 1, "B": 1, "W": 1}
        assert [[(a0, a1) for a0, a1, _ in row] for row in sched.timeline(s, unit, lockstep=True)] == [
            [(t, t + 1) for t, _ in s.actions_of(stage)] for stage in range(4)
        ]
        assert sched.timeline(s, unit) == sched.timeline(s, unit, lockstep=True)  # placed as early as can be
    # 1F1B's steady ticks mix a forward (1) and a whole backward (2) on neighbouring stages.
    assert sched.makespan(sched.one_f_one_b(4, 8), lockstep=True) == 40
    assert sched.makespan(sched.one_f_one_b(4, 8)) == 33
    assert sched.makespan(sched.zb_h1(4, 8), lockstep=True) == 27


@pytest.mark.parametrize("p,m", SIZES)
def test_fused_1f1b_in_lockstep(p, m):
    """Every step a whole microbatch's work on every stage: in lockstep the step time is
    (m + p - 1)(F + B + W) whatever the actions cost, 1F1B's bubble (p-1)/(m+p-1)."""
    s = sched.one_f_one_b_fused(p, m)
    assert len(sched.steps(s)) == m + 2 * p - 1
    for costs in ({"F": 1, "B": 1, "W": 1}, {"F": 1, "B": 2, "W": 1}, {"F": 1.0, "B": 1.0, "W": 0.6}):
        assert sched.makespan(s, costs, lockstep=True) == pytest.approx((m + p - 1) * sum(costs.values()))
        assert sched.bubble_fraction(s, costs, lockstep=True) == pytest.approx((p - 1) / (m + p - 1))
    assert sched.peak_live_activations(s) == tuple(min(m, 2 * (p - st)) for st in range(p))
    # 1F1B itself in lockstep: its mixed ticks last as long as a backward that recomputes
    remat = {"F": 1, "B": 2, "W": 1}
    plain = sched.with_split_backward(sched.one_f_one_b(p, m))
    assert sched.makespan(s, remat, lockstep=True) <= sched.makespan(plain, remat, lockstep=True)


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_fused_has_zb_h1s_bubble_in_lockstep(p, m):
    """1f1b-fused's steps with the W's that would lengthen a warm-up or cool-down step held and
    run at the end, two a step: from m = 2p - 1 on, (p - 1)(W + min(F, W)) less than
    1f1b-fused's (m + p - 1)(F + B + W) for any costs — with F = B = W, ZB-H1's bubble
    (p-1)/(3m+p-1) — holding no more micro-batches' residuals than 1f1b-fused's stage 0."""
    s, fused = sched.zb_fused(p, m), sched.one_f_one_b_fused(p, m)
    assert len(sched.steps(s)) == m + 2 * p - 1
    for costs in (
        {"F": 1, "B": 1, "W": 1},
        {"F": 1, "B": 2, "W": 1},
        {"F": 1.0, "B": 1.3, "W": 0.6},
        {"F": 1.0, "B": 1.5, "W": 1.2},
    ):
        fused_span = (m + p - 1) * sum(costs.values())
        if m >= 2 * p - 1:
            saved = (p - 1) * (costs["W"] + min(costs["F"], costs["W"]))
            assert sched.makespan(s, costs, lockstep=True) == pytest.approx(fused_span - saved)
        else:
            assert sched.makespan(s, costs, lockstep=True) < fused_span
    if m >= 2 * p - 1:
        assert sched.bubble_fraction(s, lockstep=True) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert max(sched.peak_live_activations(s)) == max(sched.peak_live_activations(fused))


def test_steps_keep_each_stages_order():
    """A step never runs an action before one the table put earlier on its stage, and data
    crosses between stages only between steps."""
    for name in sched.BUILTIN:
        s = sched.with_split_backward(sched.by_name(name, 4, 8))
        step_of = {t: j for j, step in enumerate(sched.steps(s)) for t in step}
        for stage in range(4):
            seen = {}
            for t, a in s.actions_of(stage):
                kinds = seen.setdefault(step_of[t], [])
                assert (
                    all(sched.KINDS.index(k) < sched.KINDS.index(a.kind) or k == a.kind == "W" for k in kinds)
                    and kinds.count("W") <= sched.W_SLOTS
                ), (name, stage, t)
                kinds.append(a.kind)
                dep = s.dependency(stage, a)
                if dep is not None:
                    dep_tick = next(u for u, b in s.actions_of(dep[0]) if b == dep[1])
                    same = step_of[dep_tick] == step_of[t]
                    assert not same or (dep[0] == stage and a.kind == "W"), (name, stage, a)


# ----------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("p,m", SIZES)
def test_peak_live_activations(p, m):
    assert sched.peak_live_activations(sched.gpipe(p, m)) == (m,) * p
    assert sched.peak_live_activations(sched.one_f_one_b(p, m)) == tuple(p - s for s in range(p))
    # ZB-H1: 1F1B's in-flight microbatches (F to B); held until W, p on every stage, 1F1B's stage 0.
    zb = sched.zb_h1(p, m)
    assert sched.peak_live_activations(zb, held_until="B") == tuple(p - s for s in range(p))
    assert sched.peak_live_activations(zb) == (p,) * p
    # Interleaved, in chunks (1/v of a stage's layers each): Megatron's warm-up plus one.
    for v in (2, 3):
        expected = tuple(min(2 * (p - 1 - s) + (v - 1) * p + 1, v * m) for s in range(p))
        assert sched.peak_live_activations(sched.interleaved_1f1b(p, m, v)) == expected
    # ZB-V, in chunks of half a stage: at most 2p, p stages' worth, as 1F1B's stage 0, W included;
    # reached on every stage from m = 2p - 1 on.
    expected = tuple(min(m + 1 + s, 2 * m, 2 * p) for s in range(p))
    assert expected == (2 * p,) * p or m < 2 * p - 1
    for held_until in ("B", "W"):
        assert sched.peak_live_activations(sched.zb_v(p, m), held_until=held_until) == expected


# ----------------------------------------------------------------------------------- refusals
def refusal(rows, **kw) -> str:
    with pytest.raises(ValueError) as caught:
        Schedule.from_table(rows, **kw)
    return str(caught.value)


def test_a_backward_before_the_next_stage_sent_its_gradient_is_refused():
    good = ["F0 F1  . B0  . B1", " . F0 B0 F1 B1  ."]
    assert Schedule.from_table(good).rows == sched.one_f_one_b(2, 2).rows
    assert refusal(["F0 F1 B0  .  . B1", " . F0 B0 F1 B1  ."]) == (
        "schedule 'custom': tick 2, stage 0: B0 needs B0 on stage 1 at an earlier tick; it runs at tick 2"
    )
    assert refusal(["F0  . F1 B0  . B1", " . F0 F1 B0 B1  ."]).startswith(
        "schedule 'custom': tick 2, stage 1: F1 needs F1 on stage 0 at an earlier tick; it runs at tick 2"
    )
    assert "tick 1, stage 0: B0 needs B0 on stage 1 at an earlier tick; it never runs" in refusal(["F0 B0", " . F0"])


def test_a_duplicate_action_is_refused():
    assert (
        refusal(["F0 F1 F1 B0  . B1", " . F0 B0 F1 B1  ."])
        == "schedule 'custom': tick 2, stage 0: F1 runs a second time (first at tick 1)"
    )


def test_a_missing_w_is_refused():
    rows = [list(row) for row in sched.zb_h1(2, 2).rows]
    tick = rows[1].index(Action("W", 1))
    rows[1][tick] = None
    assert refusal(rows) == "schedule 'custom': stage 1 never runs W1 (at no tick)"


def test_malformed_tables_are_refused_naming_the_cell():
    assert "tick 2, stage 0: W0 in a schedule without a split backward" in refusal(
        ["F0 B0 W0", " . . ."], split_backward=False
    )
    assert "tick 0, stage 0: F2 names microbatch 2, the schedule has 2" in refusal(["F2 F1", "F0 F0"], microbatches=2)
    assert "tick 0, stage 0: F0c2 names chunk 2, the schedule has 2 per stage" in refusal(["F0c2", "."], chunks=2)
    assert "stage 1 has 1 ticks, stage 0 has 2" in refusal(["F0 B0", "."])
    assert "cannot read 'X3'" in refusal(["X3"])
    assert "a schedule needs at least one stage" in refusal([])
    with pytest.raises(ValueError, match="an Action's kind is one of F, B, W"):
        Action("Q", 0)


def test_orders_that_wait_on_each_other_are_refused():
    with pytest.raises(ValueError) as caught:
        Schedule.from_orders([["B0", "F0"], ["F0", "B0"]])
    assert str(caught.value) == (
        "schedule 'custom': the orders deadlock at tick 0: stage 0's next action B0 "
        "needs B0 on stage 1, which stage 1's order runs after its next action F0, "
        "itself waiting"
    )


def test_by_name_refusals():
    with pytest.raises(
        ValueError,
        match="unknown pipeline schedule 'pipedream'; the built-in ones are "
        "gpipe, 1f1b, 1f1b-fused, interleaved, zb-h1, zb-v, zb-fused",
    ):
        sched.by_name("pipedream", 4, 8)
    with pytest.raises(ValueError, match=r"multiple of the number of stages .* got m = 6; use m = 4 or 8"):
        sched.by_name("interleaved", 4, 6)
    with pytest.raises(ValueError, match="v chooses the chunks of 'interleaved' only"):
        sched.by_name("zb-h1", 4, 8, v=2)
    with pytest.raises(ValueError, match=r"m \(microbatches\) must be an int >= 1, got 0"):
        sched.gpipe(4, 0)
    with pytest.raises(ValueError, match="with one chunk per stage use '1f1b'"):
        sched.interleaved_1f1b(4, 8, 1)
    assert sched.by_name("ZB_H1", 2, 2) == sched.zb_h1(2, 2)
    assert sched.by_name("interleaved", 2, 4, v=3) == sched.interleaved_1f1b(2, 4, 3)


# ----------------------------------------------------------------------------------- views
def test_text_grid():
    assert str(sched.one_f_one_b(2, 2)) == (
        "1f1b: 2 stages, 2 microbatches, 6 ticks\ns0 | F0 F1  . B0  . B1\ns1 |  . F0 B0 F1 B1  ."
    )
    assert [str(a) for a in (Action("F", 3), Action("B", 3, 1), Action("W", 12, 2))] == ["F3", "b3", "W12c2"]
    assert [Action.parse(t) for t in ("F3", "b3", "W12c2", ".")] == [
        Action("F", 3),
        Action("B", 3, 1),
        Action("W", 12, 2),
        None,
    ]
    s = sched.zb_v(2, 3)
    assert s[1, 1] == Action("F", 0) and s.actions[1] == (Action("F", 1), Action("F", 0))


@pytest.mark.slow
def test_draw_one_box_per_action():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    for s in (sched.one_f_one_b(4, 8), sched.zb_v(4, 8)):
        fig = s.draw()
        ax = fig.axes[0]
        actions = sum(len(s.actions_of(stage)) for stage in range(s.stages))
        assert len(ax.patches) == actions and len(ax.texts) == actions
        fig.savefig(io.BytesIO(), format="png")
    own = Figure()
    assert sched.gpipe(2, 2).draw(own.add_subplot()) is own


@pytest.mark.slow
def test_importing_schedules_loads_no_matplotlib():
    check = "import shardflow.schedules, sys; assert not [m for m in sys.modules if m.startswith('matplotlib')]"
    done = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]


# ----------------------------------------------------------------------------------- the docs
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def schedules_section() -> str:
    """docs/explanation/pipeline-schedules.md's section on schedules: from its heading to the next one."""
    text = DOC.read_text()
    start = text.index("## Schedules")
    end = text.find("\n## ", start)
    return text[start : end if end >= 0 else len(text)]


def test_the_docs_print_what_the_code_prints():
    """Each python block of the section runs (in order, in one namespace) and prints exactly the
    text block that follows it."""
    blocks = [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(schedules_section())]
    namespace, checked = {}, 0
    for i, (lang, code, _, end) in enumerate(blocks):
        if lang != "python":
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(DOC), "exec"), namespace)
        following = blocks[i + 1] if i + 1 < len(blocks) else None
        if following and following[0] == "text" and not schedules_section()[end : following[2]].strip():
            assert out.getvalue() == following[1], code
            checked += 1
    assert checked >= 8


RECOMPUTING = {"F": 1, "B": 2, "W": 1}  # B recomputes its forward (remat), as the 3b / 7b benchmarks run


def measures_table(p: int = 4) -> list[str]:
    def number(x):
        return f"{x:g}"

    lines = [
        "| schedule | m | ticks | step time | bubble fraction | bubble rate | lockstep step time | "
        "executor's lockstep time, F:B:W = 1:2:1 | peak live activations per stage | peak, in stages |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for m in (8, 16):
        for name in sched.BUILTIN:
            s = sched.by_name(name, p, m)
            v, peaks = s.chunks, sched.peak_live_activations(s)
            lines.append(
                f"| {name} | {m} | {s.ticks} | {number(sched.makespan(s) / v)} | "
                f"{sched.bubble_fraction(s):.3f} | {sched.bubble_rate(s):.3f} | "
                f"{number(sched.makespan(s, lockstep=True) / v)} | "
                f"{number(sched.makespan(sched.with_split_backward(s), RECOMPUTING, lockstep=True) / v)} | "
                f"{' '.join(map(str, peaks))} | "
                f"{number(max(peaks) / v)} |"
            )
    return lines


def test_the_docs_table_is_measured():
    marker = "<!-- measured: tests/test_schedules.py::measures_table -->\n"
    section = schedules_section()
    table = section[section.index(marker) + len(marker) :].split("\n\n")[0].splitlines()
    assert table == measures_table()
