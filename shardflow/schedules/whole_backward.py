"""The schedules with a whole backward (B computes the gradients of inputs and weights):
GPipe, 1F1B and Megatron-LM's interleaved 1F1B."""

from __future__ import annotations

from shardflow.schedules.table import Action, Schedule, check_sizes, is_count


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every stage runs all m forwards, then all m backwards."""
    check_sizes("gpipe", p, m)
    order = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    return Schedule.from_orders([order] * p, name="gpipe", microbatches=m, chunks=1, split_backward=False)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron-LM): stage s runs p-1-s warm-up forwards, then alternates
    one forward and one backward, then runs the remaining backwards — at most p-s microbatches
    in flight on stage s, against GPipe's m."""
    check_sizes("1f1b", p, m)
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
    check_sizes("interleaved", p, m)
    if not is_count(v, minimum=2):
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
