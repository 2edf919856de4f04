"""Planning time of the presets' train steps: the greedy planner against the whole-program solver.

    python benchmarks/solve_time.py [--presets 1b,7b] [--strategies fsdp,tp,2d] [--repeats 3]

8 simulated CPU devices, mesh {data: 2, model: 4}, the `shardflow train` step (AdamW, 8 x 2048
tokens per step), explain only (trace, plan, boxing; no XLA compile). Per row: each planner's
wall time (the median of --repeats plans, each from a fresh trace: one plan's time moves by
0.4 s from run to run here) and its plan's modelled seconds (collectives and local work,
explain's `modelled_seconds`), and the solver's own line (what it solved, how long HiGHS took).

The same 2-core machine runs HiGHS up to twice as slowly in some hours (solve_time.md), so the
script first times a fixed LP that depends on nothing in shardflow — a seeded 600 x 600
transportation problem, solved as the solver's relaxations are — and prints it beside the rows: the
machine's speed in this run, to compare runs by.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _checkout  # noqa: E402,F401
import _results  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from scipy import sparse  # noqa: E402

import shardflow as sf  # noqa: E402
from shardflow import train  # noqa: E402
from shardflow.passes import solve  # noqa: E402
from shardflow.train import config, data  # noqa: E402


def measure(preset, strategy, data_dir, batch=8, seq=2048, stationary_weights=False):
    cfg = config.Config()
    cfg.stationary_weights = stationary_weights
    cfg.model = {"preset": preset}
    cfg.data.path, cfg.data.seq_len = data_dir, seq
    cfg.batch_size, cfg.strategy, cfg.mesh, cfg.eval_every = batch, strategy, {"data": 2, "model": 4}, 0
    run = train.setup(cfg)
    state = jax.eval_shape(lambda: train.init_state(run))
    tokens = jax.ShapeDtypeStruct((1, batch, seq), np.int32)
    out = []
    for passes in (sf.passes.DEFAULT, sf.passes.SOLVER):
        step = run.train_step()
        step.passes = passes
        t = time.perf_counter()
        plan = step.explain(*state, {"inputs": tokens, "targets": tokens})
        out.append((time.perf_counter() - t, plan.modelled_seconds, plan.planner))
    return out


def reference_seconds(n=600, seed=0) -> float:
    """The solver's LP relaxation (``solve.highs.relaxation``: HiGHS's dual simplex, its options) on
    a seeded n x n transportation problem, supplies normalised so every flow lies in [0, 1]: the
    fastest of three runs."""
    rng = np.random.default_rng(seed)
    cost = rng.random(n * n) * 1e3
    supply = rng.integers(1, 100, n) / 100 / n
    sides = np.concatenate([supply, supply[rng.permutation(n)]])
    rows = np.concatenate([np.repeat(np.arange(n), n), n + np.tile(np.arange(n), n)])
    a = sparse.csc_array((np.ones(2 * n * n), (rows, np.tile(np.arange(n * n), 2))), shape=(2 * n, n * n))
    best = np.inf
    for _ in range(3):
        t = time.perf_counter()
        assert solve.highs.relaxation(cost, a, sides, sides).status == 0
        best = min(best, time.perf_counter() - t)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="1b,7b")
    parser.add_argument("--strategies", default="fsdp,tp,2d")
    parser.add_argument("--repeats", type=int, default=3, help="plans per row; the median time is reported")
    parser.add_argument("--stationary-weights", action="store_true", help="the trainer's stationary_weights: true")
    parser.add_argument("--out", help="write the rows and the reference LP's time as JSON")
    args = parser.parse_args()
    data_dir = str(data.prepare(data.stdlib_sources(max_bytes=200_000)[:5], tempfile.mkdtemp()))
    reference_lp_s = reference_seconds()
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, mesh data=2 x model=4; "
        f"the machine's reference LP: {reference_lp_s:.2f} s"
    )
    print("| preset | strategy | greedy s | greedy ms modelled | solver s | solver ms modelled | solver |")
    print("|---|---|---:|---:|---:|---:|---|")
    rows = []
    for preset in args.presets.split(","):
        for strategy in args.strategies.split(","):
            runs = [
                measure(preset, strategy, data_dir, stationary_weights=args.stationary_weights)
                for _ in range(args.repeats)
            ]
            (_, mg, _), (_, ms, planner) = runs[-1]
            tg, ts = (statistics.median(run[i][0] for run in runs) for i in (0, 1))
            print(
                f"| {preset} | {strategy} | {tg:.1f} | {mg * 1e3:.2f} | {ts:.1f} | {ms * 1e3:.2f} | {planner} |",
                flush=True,
            )
            rows.append(
                {
                    "preset": preset,
                    "strategy": strategy,
                    "greedy_s_each": [run[0][0] for run in runs],
                    "solver_s_each": [run[1][0] for run in runs],
                    "greedy_s": tg,
                    "greedy_modelled_ms": mg * 1e3,
                    "solver_s": ts,
                    "solver_modelled_ms": ms * 1e3,
                    "solver": planner,
                }
            )
    if args.out:
        _results.write_json(
            args.out, rows, reference_lp_s=reference_lp_s, mesh={"data": 2, "model": 4}, batch=8, seq=2048
        )


if __name__ == "__main__":
    main()
