"""Pipeline parallelism: tokens/s, MFU and peak memory per schedule against FSDP, in one run.

    python benchmarks/pipeline.py                          # 1b on every GPU of the machine
    python benchmarks/pipeline.py --preset tiny            # end-to-end check on 8 simulated CPUs
    python benchmarks/pipeline.py --preset 7b --schedules 1f1b,zb-h1 --out pipeline.json
    python benchmarks/pipeline.py --preset 3b --schedules 1f1b-fused --profile   # + measured bubble

On N = jax.device_count() devices the `shardflow train` step (fp32 master weights, bf16
compute, AdamW + clipping; benchmarks/scaling.py's measurement) runs under FSDP on {data: N}
and, for each schedule, pipelined on {pipe: N} and on {pipe: N/2, data: 2} with the same global
batch, the stages replicated over data (dp) or their weights and optimizer state split over it
(fsdp: gathered once a step). Per row: tokens/s, MFU, its ratio to FSDP's, the compiled step's memory per device (XLA's
memory_analysis), the bubble the schedule's table predicts for its lockstep execution
(shardflow.schedules.bubble_fraction of the split-backward table the executor runs, lockstep,
F = B = W = 1 but B = 2 where it recomputes its forward, remat "full") with the ratio to FSDP it
alone would leave (1 - bubble, FSDP's step taken as the ideal), and with --profile the measured
bubble: one more step traced, per GPU the fraction of it spent in waits of 1 ms or more with no
kernel but a collective running, and all such gaps as "idle" (averaged over the GPUs; per GPU
in the JSON). `--remat` sets the pipelined rows' remat policy, `--fsdp-remat` FSDP's (both
default to the preset's): a stage holds 1/p of the layers, so it may fit keeping what FSDP must
recompute — each row records its policy, and MFU counts no recomputation. Where the layers do
not divide into the schedule's virtual stages (3b's 28 in 4 stages x 2 chunks) they are split
as evenly as they go (`pipeline.layers_per_stage`, the padding skipped), recorded in the row.
benchmarks/pipeline_hosts.py turns a result into a prediction across hosts.
"""

from __future__ import annotations

import argparse
import gc
import os
import re

import _checkout  # noqa: F401

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import scaling  # noqa: E402  (after the NCCL setting)

from shardflow.models.config import PRESETS, REMAT_POLICIES  # noqa: E402

CASES = {
    "1b": (64, 2048, "none"),
    "3b": (32, 2048, "full"),
    "7b": (32, 2048, "full"),
    "tiny": (16, 128, "none"),
}  # preset -> (global batch, seq, remat)
SCHEDULES = ("gpipe", "1f1b", "1f1b-fused", "zb-h1", "interleaved", "zb-v", "zb-fused")


def configs(n: int, schedules, microbatches: int):
    """(name, mesh, strategy, pipeline) per measured configuration."""
    out = [("fsdp", {"data": n}, "fsdp", None)]
    for pipe in sorted({n, n // 2} - {0, 1}, reverse=True):
        mesh = {"pipe": pipe} if pipe == n else {"pipe": pipe, "data": n // pipe}
        # with a data axis: replicated stages (dp), or their weights and Adam state split over it (fsdp)
        for name, strategy in [("", "pp")] if pipe == n else [("dp", "pp_dp"), ("fsdp", "fsdp")]:
            for schedule in schedules:
                out.append(
                    (
                        f"pp{pipe}" + (f"x{name}{n // pipe}" if name else "") + f" {schedule}",
                        mesh,
                        strategy,
                        {"stages": pipe, "microbatches": microbatches, "schedule": schedule},
                    )
                )
    return out


def train_config(preset, mesh, strategy, pipeline, batch, seq, remat, **fields):
    """The `shardflow train` config of one measured configuration (``fields``: more Config fields)."""
    from shardflow.train import config

    cfg = config.Config(mesh=mesh, strategy=strategy, engine="shardflow", batch_size=batch, eval_every=0, **fields)
    cfg.model = {"preset": preset, "remat": remat, "attention_impl": "ops"}
    cfg.data.seq_len = seq
    for key, value in (pipeline or {}).items():
        setattr(cfg.pipeline, key, value)
    return cfg


def measure(preset, name, mesh, strategy, pipeline, batch, seq, remat, args):
    import jax

    from shardflow import schedules, train
    from shardflow.train import config

    if pipeline:
        table = schedules.with_split_backward(
            schedules.by_name(pipeline["schedule"], pipeline["stages"], pipeline["microbatches"])
        )
        n_layers, parts = PRESETS[preset]["n_layers"], table.stages * table.chunks
        if n_layers % parts and n_layers > parts:  # e.g. 3b's 28 layers in 4 stages x 2 chunks: 4 or 3 a virtual stage
            pipeline = dict(
                pipeline, layers_per_stage=[n_layers // parts + (k < n_layers % parts) for k in range(parts)]
            )
    row = {
        "preset": preset,
        "config": name,
        "mesh": mesh,
        "strategy": strategy,
        "global_batch": batch,
        "seq": seq,
        "remat": remat,
        "pipeline": pipeline,
    }
    if pipeline:
        costs = {"F": 1, "B": 2 if remat == "full" else 1, "W": 1}  # B recomputes its forward under remat
        row["predicted_bubble"] = float(schedules.bubble_fraction(table, costs, lockstep=True))  # equal stages
    cfg = train_config(
        preset, mesh, strategy, pipeline, batch, seq, remat, steps=args.warmup + args.steps, peak_flops=args.peak_flops
    )
    try:
        run = train.setup(cfg)
    except config.ConfigError as e:
        return {**row, "status": f"skip: {e}"}
    row = scaling.time_steps(run, row, batch, seq, args, traced=profiled_bubble if args.profile else None)
    gc.collect()
    jax.clear_caches()
    return row


WAIT_NS = 1_000_000  # a gap this long is a device waiting for work, not a kernel launch


def idle_fraction(kernels, min_gap: float = 0) -> float:
    """Of one device's step, from its first kernel's start to its last one's end, the fraction in
    which no kernel but a collective runs, counting only gaps of at least ``min_gap``:
    ``kernels`` are (start, end, name), NCCL's named so. With ``min_gap`` = ``WAIT_NS`` the
    pipeline's bubble — a stage waiting for its neighbour, an action's length — and not the
    microsecond gaps between kernel launches, which any step has (FSDP's 2 % of its step)."""
    spans = sorted((start, end) for start, end, name in kernels if "nccl" not in name.lower())
    first, last = min(k[0] for k in kernels), max(k[1] for k in kernels)
    idle, reached = 0, first
    for start, end in spans + [(last, last)]:
        gap = start - reached
        if gap > 0 and gap >= min_gap:
            idle += gap
        reached = max(reached, end)
    return idle / (last - first)


def profiled_bubble(step_fn, params, opt_state, data) -> dict:
    """One traced step: per GPU, the bubble (``idle_fraction`` counting waits of at least
    ``WAIT_NS``) and all its idle time, from the profiler's stream lines; None where the trace
    has no GPU (CPU runs)."""
    per_gpu = [
        (idle_fraction(kernels, WAIT_NS), idle_fraction(kernels))
        for kernels in scaling.traced_kernels(step_fn, params, opt_state, data)
    ]
    mean = lambda k: sum(g[k] for g in per_gpu) / len(per_gpu) if per_gpu else None
    return {
        "measured_bubble_per_gpu": [g[0] for g in per_gpu] or None,
        "measured_bubble": mean(0),
        "idle_per_gpu": [g[1] for g in per_gpu] or None,
        "idle": mean(1),
    }


def print_table(rows) -> None:
    base = {r["preset"]: r for r in rows if r["config"] == "fsdp" and r["status"] == "ok"}
    header = (
        "preset",
        "config",
        "remat",
        "tokens/s",
        "MFU",
        "x fsdp",
        "x fsdp, bubble only",
        "compiled GB",
        "predicted bubble",
        "measured bubble",
        "idle",
    )
    lines = [header]
    for r in rows:
        ok, b = r["status"] == "ok", base.get(r["preset"])
        lines.append(
            (
                r["preset"],
                r["config"],
                r["remat"],
                f"{r['tokens_per_s']:,.0f}" if ok else r["status"].split(":")[0],
                scaling.pct(r["mfu"]) if ok else "-",
                f"{r['tokens_per_s'] / b['tokens_per_s']:.3f}" if ok and b else "-",
                f"{1 - r['predicted_bubble']:.3f}" if r.get("predicted_bubble") is not None else "-",
                f"{r['compiled_gb_per_device']:.1f}" if ok and r.get("compiled_gb_per_device") else "-",
                scaling.pct(r.get("predicted_bubble")) if r.get("predicted_bubble") is not None else "-",
                *(scaling.pct(r.get(k)) if r.get(k) is not None else "-" for k in ("measured_bubble", "idle")),
            )
        )
    scaling.print_columns(lines, left=2)
    for r in rows:
        if r["status"].startswith(("skip", "error")):
            print(f"{r['preset']} {r['config']}: {r['status']}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(CASES), help="default: 1b")
    parser.add_argument("--schedules", default="gpipe,1f1b,zb-h1", help="comma-separated")
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--batch", type=int, help="global batch (sequences)")
    parser.add_argument("--seq", type=int)
    parser.add_argument(
        "--remat",
        choices=sorted(REMAT_POLICIES),
        help="the pipelined rows' remat policy (default: the preset's, CASES): a "
        "stage holds 1/p of the layers, so a policy that keeps more may fit",
    )
    parser.add_argument(
        "--fsdp-remat", choices=sorted(REMAT_POLICIES), help="the FSDP row's remat policy (default: the preset's)"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-flops", type=float)
    parser.add_argument("--device-memory-gb", type=float)
    parser.add_argument("--only", help="run only the configs whose name matches this regular expression (re.search)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="trace one more step per config: the measured bubble, per GPU the fraction "
        "of the step with no kernel but a collective running",
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    schedules = args.schedules.split(",")
    if set(schedules) - set(SCHEDULES):
        parser.error(f"unknown {sorted(set(schedules) - set(SCHEDULES))}; choose from {SCHEDULES}")
    n = scaling.devices()
    rows = []
    for preset in args.preset or ["1b"]:
        batch, seq, remat = CASES[preset]
        batch, seq = args.batch or batch, args.seq or seq
        for name, mesh, strategy, pipeline in configs(n, schedules, args.microbatches):
            if args.only and not re.search(args.only, name):
                continue
            policy = (args.remat if pipeline else args.fsdp_remat) or remat
            row = measure(preset, name, mesh, strategy, pipeline, batch, seq, policy, args)
            rows.append(row)
            done = (
                f"{row['tokens_per_s']:,.0f} tokens/s, loss {row['loss']:.3f}"
                if row["status"] == "ok"
                else row["status"]
            )
            print(f"{preset:5s} {name:22s} {done}", flush=True)
    print()
    print_table(rows)
    if args.out:
        scaling.write_json(args.out, rows, args)
    return rows


if __name__ == "__main__":
    main()
