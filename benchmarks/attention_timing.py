"""How benchmarks/attention.py measures: wall-clock seconds per call with dispatch pipelined,
interleaved rounds of contenders, and device time per kernel from a profiler trace."""

from __future__ import annotations

import statistics
import time

import jax

ROUNDS = 3
PIPELINED = 10


def time_samples(fn, args, *, iters):
    """Seconds per call, one sample per PIPELINED calls dispatched back to back and ended by one
    block_until_ready: the device stays busy, so host dispatch and sync latency (0.1-0.6 ms per
    call on the H100, measured against profiler device time) are not counted as kernel time."""
    times = []
    for _ in range(max(1, iters // PIPELINED)):
        start = time.perf_counter()
        for _ in range(PIPELINED):
            result = fn(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / PIPELINED)
    return times


def interleaved_medians(calls, samples, *, rounds=ROUNDS):
    """{name: median of samples(fn, args)} of {name: (fn, args)}, sampled in interleaved rounds
    so that drifting clocks hit every contender alike; each round starts at another contender."""
    taken = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        start = r * len(order) // rounds
        for name in order[start:] + order[:start]:
            fn, args = calls[name]
            taken[name].extend(samples(fn, args))
    return {name: statistics.median(values) for name, values in taken.items()}


def device_ms_samples(fn, args, *, iters):
    """[device ms per call] of fn(*args): its kernels' time in a profiler trace of iters calls.
    NaN off the GPU."""
    if jax.default_backend() != "gpu":
        return [float("nan")]
    return [sum(t for _, t in kernel_times(fn, args, iters=iters))]


def median_seconds(fn, args, *, warmup, iters):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return statistics.median(time_samples(fn, args, iters=iters))


def kernel_times(fn, args, *, iters):
    """[(kernel name, device ms per call)] of fn(*args), longest first, from a profiler trace of
    iters calls: GPU time only, so launch overhead and host gaps are not in it."""
    import collections
    import glob
    import tempfile

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(iters):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        profile = jax.profiler.ProfileData.from_file(path)
    totals = collections.Counter()
    for plane in profile.planes:
        if plane.name.startswith("/device:GPU:0"):
            for line in plane.lines:
                if line.name.startswith("Stream"):  # the other lines regroup the same kernels
                    for event in line.events:
                        totals[event.name] += event.duration_ns / 1e6 / iters
    if not totals:
        raise RuntimeError(
            "no GPU kernels in the trace; planes and lines: "
            + str({plane.name: [line.name for line in plane.lines] for plane in profile.planes})
        )
    return totals.most_common()
