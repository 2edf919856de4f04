"""Schedules built for the lockstep executor: each step one F, one B and its W's on every
stage, so a step's length does not depend on which actions meet in it."""

from __future__ import annotations

from shardflow.schedules.table import W_SLOTS, Action, Schedule, check_sizes


def one_f_one_b_fused(p: int, m: int) -> Schedule:
    """1F1B for a lockstep executor: at step t stage s runs the forward of microbatch t - s and
    the backward, B then W, of microbatch t - (2p - 1 - s) — each step one F, one B and one W on
    every stage in the steady state (three ticks of the table, one ``step``). Where 1F1B's ticks
    mix a forward on one stage with a backward on its neighbour, and so last as long as the
    slower, these steps each do a microbatch's whole work on every stage, whatever F, B and W
    cost (a backward that recomputes its forward included): m + 2p - 1 steps, lockstep time
    (m + p - 1)(F + B + W), 1F1B's bubble (p - 1)/(m + p - 1). The price: 2(p - s) microbatches
    in flight on stage s, twice 1F1B's."""
    check_sizes("1f1b-fused", p, m)
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
    check_sizes("zb-fused", p, m)
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
