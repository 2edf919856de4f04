"""agreement: the solver's result on a multi-process run, process 0's on every process."""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import numpy as np
from jax.experimental import multihost_utils

from shardflow.specs import ShardingError

_RAISED = 255  # process_0s's status where process 0's solve raised


def process_0s(solve, columns: int):
    """``solve()``'s result — status, x (as chosen: 0 or 1), fun, bound, message — as process 0
    found it, on every process of a multi-process run; the others do not run HiGHS. Every
    process builds the same model (the build is deterministic), but branch and bound stops at
    a clock, which runs differently on each host: taken from one process, the plan is the same
    everywhere whatever the clocks did. Where process 0's solve raises, it raises there and
    every other process raises a ShardingError, rather than waiting for a plan that will not
    come."""
    if jax.process_count() == 1:
        return solve()
    head, bits = np.zeros(24 + 256, np.uint8), np.zeros((columns + 7) // 8, np.uint8)
    raised = None
    if jax.process_index() == 0:
        try:
            result = solve()
        except Exception as e:  # told to the others below, then raised here
            raised, result = e, SimpleNamespace(status=_RAISED, x=None, message=f"{type(e).__name__}: {e}")
        found = result.x is not None
        head[:2] = result.status, found
        head[8:24] = np.array([result.fun if found else math.nan, getattr(result, "bound", math.nan)]).view(np.uint8)
        message = result.message.encode()[:256]
        head[24 : 24 + len(message)] = np.frombuffer(message, np.uint8)
        if found:
            bits = np.packbits(np.asarray(result.x) > 0.5)
    head, bits = (np.asarray(v).astype(np.uint8) for v in multihost_utils.broadcast_one_to_all((head, bits)))
    fun, bound = head[8:24].copy().view(np.float64)
    message = head[24:].tobytes().rstrip(b"\0").decode(errors="replace")
    if raised is not None:
        raise raised
    if head[0] == _RAISED:
        raise ShardingError(f"the solve on process 0, whose result every process plans with, raised {message}")
    return SimpleNamespace(
        status=int(head[0]),
        fun=fun,
        bound=bound,
        message=message,
        x=np.unpackbits(bits, count=columns).astype(float) if head[1] else None,
    )
