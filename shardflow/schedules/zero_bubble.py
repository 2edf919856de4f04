"""The zero-bubble schedules (Qi et al.): the backward split into B (inputs) and W (weights),
W moved into the bubbles. ZB-H1 and ZB-V."""

from __future__ import annotations

import collections

from shardflow.schedules.table import Action, Schedule, check_sizes


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into
    B (for the inputs, on the critical path) and W (for the weights, free to move). Stage s runs
    1F1B's order with each B followed by a W, except that it holds back its first s W's; they run
    in the cool-down, where 1F1B waits for backwards. Same in-flight microbatches as 1F1B."""
    check_sizes("zb-h1", p, m)
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
    check_sizes("zb-v", p, m)
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
