"""Scaling: tokens/s and MFU per parallelism strategy on all devices, shardflow vs plain jit.

    python benchmarks/scaling.py                      # 1b and 7b on every GPU of the machine
    python benchmarks/scaling.py --preset tiny        # end-to-end check on 8 simulated CPUs
    python benchmarks/scaling.py --preset 1b --strategies dp,fsdp --out scaling.json

For each preset, on N = jax.device_count() devices, the `shardflow train` step (fp32 master
weights, bf16 compute, AdamW + clipping) runs under each strategy of docs/reference/config.md with two
engines: "shardflow" (sf.parallelize) and "jit" (jax.jit with the same specs as
NamedShardings); `--engines shardflow-solver` adds shardflow with the whole-program solver
(`sf.passes.SOLVER`, no one-device row of its own), `shardflow-unrolled` shardflow with its layer
loops unrolled where their bodies communicate too (`passes.unroll.UNROLL_COLLECTIVES`: the A/B
that decides it). Meshes: dp, fsdp {data: N}; tp, tp_sp {data: 1, model: N}; 2d
{data: N/M, model: M} (M = --model-2d, default 2). When the model's dimensions do not divide by
the model axis (tiny's 4 kv heads on 8 devices), the model axis shrinks to the largest divisor
of N that fits and the rest goes to data; the printed mesh says so.

Weak scaling: the batch is per data-parallel replica (global batch = batch x mesh["data"]),
and each engine also runs one device with one replica's batch under dp. Weak-scaling
efficiency = tokens/s on N devices / (N x tokens/s on one device), per engine; under tp the
N devices share one replica's batch, so there it is the parallel efficiency of the same work.

Per-replica batch x seq, remat (CASES): 1b 8 x 4096, no remat (train_mfu.py's 1b row).
7b 4 x 4096 with full remat: configs/7b-2d.yaml's micro-batch per data replica; fp32 weights,
gradients and Adam moments are 16 bytes/param (107 GB for 6.7 B), so 7b under dp and on one
device needs more than an 80 GB GPU holds. Such configs are skipped before compiling when the
estimated per-device weights + gradients + Adam state + bf16 copy exceed the device's memory;
whatever still runs out of memory is reported as OOM and the run goes on. (On GPU, jax reports
the memory it may use: XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 of the card by default.)

Attention: the shardflow engine uses shardflow.attention.attention (Pallas kernels on GPU). The jit
engine uses jax.nn.dot_product_attention (cuDNN on GPU), which GSPMD can partition, whereas a
Pallas custom call under jax.jit would be replicated. The shardflow/jit ratio therefore
includes the attention-kernel difference (benchmarks/train_mfu.py's shardflow-cudnn engine
separates it). MFU = tokens/s x shardflow.train.metrics.flops_per_token / (peak x devices); the peak
comes from the device kind (n/a on CPU unless --peak-flops). Only steady-state steps after
--warmup steps are timed.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gc
import math
import os
import time
import traceback
import unittest.mock

import _checkout  # noqa: F401
import _results
import train_mfu

from shardflow.train import configure_host_platform

# NVLink multicast off (the device machines' KINDS.md); NCCL reads it when JAX creates its
# communicators, long after this line.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

CASES = {  # preset -> (batch per data-parallel replica, seq, remat)
    "1b": (8, 4096, "none"),
    "7b": (4, 4096, "full"),
    "tiny": (2, 256, "none"),
}
STRATEGIES = ("dp", "fsdp", "tp", "tp_sp", "2d")
ENGINES = ("shardflow", "jit")
# Engine names beside the defaults: shardflow with the whole-program solver (passes.solve), and
# shardflow with its layer loops unrolled even where their bodies communicate
# (passes.unroll.UNROLL_COLLECTIVES, off until this A/B is measured on several GPUs).
PLANNED = {"shardflow-solver": ("shardflow", "solver"), "shardflow-unrolled": ("shardflow", "greedy")}


def candidate_meshes(strategy: str, n: int, model_2d: int) -> list[dict]:
    """Meshes to try, preferred first (the model axis shrinks only if the model needs it)."""
    if strategy in ("dp", "fsdp") or n == 1:
        return [{"data": n}] if strategy in ("dp", "fsdp") else [{"data": 1, "model": 1}]
    largest = n if strategy in ("tp", "tp_sp") else min(model_2d, n)
    return [{"data": n // m, "model": m} for m in range(largest, 1, -1) if n % m == 0]


def device_bytes(shapes, shardings) -> int:
    import jax
    import numpy as np

    sizes = jax.tree.map(lambda x, s: math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize, shapes, shardings)
    return sum(jax.tree.leaves(sizes))


def failure(e: Exception) -> str:
    msg = str(e)
    if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
        return "OOM"
    traceback.print_exc()
    return f"error: {type(e).__name__}: {(msg.splitlines() or [''])[0][:160]}"


def measure(preset, strategy, meshes, engine, batch, seq, remat, args, one_device=False):
    """One config: a result row (status "ok", "OOM", "skip: ..." or "error: ...")."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from shardflow import train
    from shardflow.train import config

    jit_attention = "cudnn" if jax.default_backend() == "gpu" else "jax"
    row = {
        "preset": preset,
        "strategy": strategy,
        "engine": engine,
        "mesh": {"data": 1} if one_device else meshes[0] if meshes else {},
        "batch_per_replica": batch,
        "seq": seq,
        "remat": remat,
    }
    error = "no mesh of this shape fits the device count"
    for mesh in meshes:  # train.setup checks that the model's split dimensions divide
        base, planner = PLANNED.get(engine, (engine, "greedy"))
        cfg = config.Config(
            mesh=mesh,
            strategy=strategy,
            engine=base,
            planner=planner,
            batch_size=batch * mesh["data"],
            steps=args.warmup + args.steps,
            eval_every=0,
            peak_flops=args.peak_flops,
        )
        cfg.model = {
            "preset": preset,
            "remat": remat,
            "attention_impl": "ops" if base == "shardflow" else jit_attention,
        }
        cfg.data.seq_len = seq
        try:
            run = train.setup(cfg)
            break
        except config.ConfigError as e:
            error = e
    else:
        return {**row, "status": f"skip: {error}"}
    if one_device:  # dp specs hold on a 1-device mesh: one replica's batch on one device
        run = dataclasses.replace(run, mesh=Mesh(np.asarray(jax.devices()[:1]), ("data",)))
    from shardflow.passes import unroll

    with unittest.mock.patch.object(
        unroll, "UNROLL_COLLECTIVES", engine == "shardflow-unrolled" or unroll.UNROLL_COLLECTIVES
    ):
        return time_steps(
            run, row, batch * run.mesh.shape["data"], seq, args, traced=kernel_time if args.profile else None
        )


KINDS = (
    ("nccl", ("nccl",)),
    ("attention", ("attention", "flash", "mosaic", "fmha", "cudnn")),
    ("matmul", ("gemm", "cublas", "nvjet", "cutlass", "xmma", "matmul")),
)


def merged(spans) -> list[list]:
    """The union of (start, end) spans, as sorted disjoint spans."""
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def covered(spans, start, end) -> int:
    """How much of [start, end) the sorted disjoint ``spans`` cover."""
    first = max(bisect.bisect_left(spans, [start]) - 1, 0)
    return sum(max(0, min(b, end) - max(a, start)) for a, b in spans[first : bisect.bisect_left(spans, [end])])


def traced_kernels(step_fn, params, opt_state, data) -> list[list[tuple]]:
    """One traced step: per GPU (in device order), its kernels as (start ns, end ns, name), from
    the profiler's stream lines; [] without a GPU (CPU runs)."""
    import glob
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        jax.block_until_ready(step_fn(params, opt_state, data))
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        profile = jax.profiler.ProfileData.from_file(path)
    per_gpu = [
        [(e.start_ns, e.end_ns, e.name) for line in plane.lines if line.name.startswith("Stream") for e in line.events]
        for plane in sorted(profile.planes, key=lambda p: p.name)
        if plane.name.startswith("/device:GPU:")
    ]
    return [kernels for kernels in per_gpu if kernels]


NCCL_KINDS = ("AllGather", "ReduceScatter", "AllReduce", "SendRecv", "AllToAll", "Broadcast")


def nccl_kind(name: str) -> str:
    """The collective an NCCL kernel runs (NCCL_KINDS), from its name."""
    return next((k for k in NCCL_KINDS if k.lower() in name.lower()), name[:40])


def kernel_time(step_fn, params, opt_state, data) -> dict:
    """One traced step, per GPU: its span, the milliseconds of kernels of each kind (KINDS, then
    "other"), the time no kernel runs, the largest "other" kernels, the NCCL kernels' time by
    collective (``nccl_ms_by_kind``, from the kernel names) and the time an NCCL kernel runs
    with no other kernel beside it (``nccl_exposed_ms``; by collective ``nccl_exposed_ms_by_kind``);
    {} without a GPU."""
    import collections

    per_gpu = []
    for kernels in traced_kernels(step_fn, params, opt_state, data):
        ms, other, nccl = collections.Counter(), collections.Counter(), collections.Counter()
        for start, end, name in kernels:
            kind = next((k for k, words in KINDS if any(w in name.lower() for w in words)), "other")
            ms[kind] += (end - start) / 1e6
            if kind == "other":
                other[name[:50]] += (end - start) / 1e6
            if kind == "nccl":
                nccl[nccl_kind(name)] += (end - start) / 1e6
        busy = sum(b - a for a, b in merged((start, end) for start, end, _ in kernels))
        compute = merged((start, end) for start, end, name in kernels if "nccl" not in name.lower())
        computing = sum(b - a for a, b in compute)
        exposed = collections.Counter()  # per collective: its time with no compute kernel beside it
        for start, end, name in kernels:
            if "nccl" in name.lower():
                exposed[nccl_kind(name)] += (end - start - covered(compute, start, end)) / 1e6
        span = (max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)) / 1e6
        per_gpu.append(
            {
                "span_ms": span,
                "no_kernel_ms": span - busy / 1e6,
                **{f"{k}_ms": v for k, v in ms.items()},
                "nccl_exposed_ms": (busy - computing) / 1e6,
                "top_other_ms": other.most_common(8),
                "nccl_ms_by_kind": dict(nccl.most_common()),
                "nccl_exposed_ms_by_kind": dict(exposed.most_common()),
            }
        )
    if per_gpu:
        g = per_gpu[0]
        print(
            "  GPU0: "
            + ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in g.items() if isinstance(v, float))
            + "; other: "
            + "; ".join(f"{n} {t:.1f}" for n, t in g["top_other_ms"])
            + "; nccl: "
            + "; ".join(
                f"{n} {t:.1f} ({g['nccl_exposed_ms_by_kind'].get(n, 0):.1f} exposed)"
                for n, t in g["nccl_ms_by_kind"].items()
            ),
            flush=True,
        )
    return {"kernel_time_per_gpu": per_gpu} if per_gpu else {}


def time_steps(run, row, global_batch, seq, args, traced=None):
    """``row`` with the run's measured tokens/s, step time, loss and MFU (or a status saying why
    not): --warmup untimed steps, then --steps timed ones; then, where ``traced`` is given, the
    entries ``traced(step_fn, params, opt_state, data)`` returns (e.g. from a profiled step)."""
    import jax
    import numpy as np

    from shardflow import train
    from shardflow.train import metrics

    row["mesh"] = dict(run.mesh.shape)
    row["devices"] = run.mesh.size
    row["params"] = run.n_params

    params_shape, opt_shape = jax.eval_shape(lambda: train.init_state(run))
    param_bytes = device_bytes(params_shape, run.shardings(run.param_specs))
    state = param_bytes * 2.5 + device_bytes(opt_shape, run.shardings(run.opt_specs))
    row["state_gb_per_device"] = state / 1e9  # weights + fp32 grads + bf16 copy + Adam
    limit = (
        args.device_memory_gb * 1e9
        if args.device_memory_gb
        else (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    )
    if limit and state > limit:
        return {
            **row,
            "status": f"skip: needs >= {state / 1e9:.3g} GB/device of state, device has {limit / 1e9:.3g} GB",
        }
    try:
        params, opt_state = train.init_state(run)
        step_fn = run.train_step()
        tokens = np.random.default_rng(0).integers(0, run.model_cfg.vocab_size, (1, global_batch, seq + 1))
        sharding = run.shardings(run.batch_spec)
        data = {
            "inputs": jax.device_put(tokens[..., :-1].astype(np.int32), sharding),
            "targets": jax.device_put(tokens[..., 1:].astype(np.int32), sharding),
        }
        for i in range(args.warmup):
            params, opt_state, out = step_fn(params, opt_state, data)
            if i == 0:  # from the same state and batch in every engine: the losses to compare
                row["first_loss"] = float(out["loss"])
        jax.block_until_ready((params, opt_state, out))
        start = time.perf_counter()
        for _ in range(args.steps):
            params, opt_state, out = step_fn(params, opt_state, data)
        jax.block_until_ready((params, opt_state, out))
        elapsed = time.perf_counter() - start
        loss = float(out["loss"])
        row["compiled_gb_per_device"] = train_mfu.compiled_bytes(step_fn, params, opt_state, data) / 1e9
        if hasattr(step_fn, "program"):  # shardflow's: which planner ran, and how long it took
            row["planner"] = step_fn.program(params, opt_state, data).planner
        if traced is not None:
            row.update(traced(step_fn, params, opt_state, data))
    except Exception as e:  # noqa: BLE001 - report the config and go on with the others
        return {**row, "status": failure(e)}
    tok_s = args.steps * global_batch * seq / elapsed
    peak = metrics.peak_flops(jax.devices()[0], args.peak_flops)
    flops = metrics.flops_per_token(run.model_cfg, run.n_params, seq)
    return {
        **row,
        "status": "ok",
        "global_batch": global_batch,
        "tokens_per_s": tok_s,
        "step_s": elapsed / args.steps,
        "loss": loss,
        "mfu": tok_s * flops / (peak * run.mesh.size) if peak else None,
    }


def fmt_mesh(mesh: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in mesh.items())


def devices() -> int:
    """The number of devices, after simulating CPU devices where there is no accelerator; the
    run's header line (jax version, devices, NCCL setting) printed."""
    configure_host_platform()
    import jax

    n = jax.device_count()
    print(
        f"jax {jax.__version__}, {n} x {jax.devices()[0].device_kind}, "
        f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}"
    )
    return n


def pct(x) -> str:
    return f"{100 * x:.1f} %" if x is not None else "n/a"


def print_table(rows) -> None:
    header = ("preset", "strategy", "mesh", "engine", "tokens/s", "MFU", "weak-scaling eff.", "shardflow/jit")
    lines = [header]
    for r in rows:
        ok = r["status"] == "ok"
        ratio = r.get("shardflow_over_jit")
        lines.append(
            (
                r["preset"],
                r["strategy"],
                fmt_mesh(r["mesh"]),
                r["engine"],
                f"{r['tokens_per_s']:,.0f}" if ok else r["status"].split(":")[0],
                pct(r["mfu"]) if ok else "-",
                pct(r.get("weak_scaling_eff")) if ok and r["devices"] > 1 else "-",
                f"{ratio:.3f}" if ratio is not None else "-",
            )
        )
    print_columns(lines, left=4)
    for r in rows:
        if r["status"].startswith(("skip", "error")):
            print(f"{r['preset']} {r['strategy']} {r['engine']}: {r['status']}")


def print_columns(lines, left: int) -> None:
    """``lines[0]`` a header, the rest rows of cells: aligned columns, the first ``left`` to the
    left, the numbers to the right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for i, line in enumerate(lines):
        print("  ".join(c.ljust(w) if j < left else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--preset", action="append", choices=sorted(CASES), help="model preset (repeatable); default: 1b and 7b"
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    parser.add_argument("--batch", type=int, help="sequences per data-parallel replica")
    parser.add_argument("--seq", type=int, help="sequence length")
    parser.add_argument("--model-2d", type=int, default=2, help="model-axis size of the 2d mesh")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    parser.add_argument("--peak-flops", type=float, help="per-device peak (default: known GPUs)")
    parser.add_argument(
        "--device-memory-gb", type=float, help="per-device memory for the fit check (default: what jax reports)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="trace one more step per config: per GPU, kernel time by kind (matmul, "
        "attention, NCCL, other) and the time no kernel runs",
    )
    parser.add_argument("--out", help="write all rows as JSON to this file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step compiles)")
    strategies, engines = args.strategies.split(","), args.engines.split(",")
    for name, allowed in ((strategies, STRATEGIES), (engines, ENGINES + tuple(PLANNED))):
        if set(name) - set(allowed):
            parser.error(f"unknown {sorted(set(name) - set(allowed))}; choose from {allowed}")
    n = devices()
    import jax

    rows = []
    for preset in args.preset or ["1b", "7b"]:
        batch, seq, remat = CASES[preset]
        batch, seq = args.batch or batch, args.seq or seq
        configs = [("1-device", [{"data": n}], engine, True) for engine in engines if engine not in PLANNED]
        configs += [(s, candidate_meshes(s, n, args.model_2d), e, False) for s in strategies for e in engines]
        for strategy, meshes, engine, one in configs:
            row = measure(preset, "dp" if one else strategy, meshes, engine, batch, seq, remat, args, one_device=one)
            row["strategy"] = strategy
            rows.append(row)
            gc.collect()
            jax.clear_caches()
            done = (
                f"{row['tokens_per_s']:,.0f} tokens/s, loss {row['first_loss']:.4f} first, {row['loss']:.3f} last"
                if row["status"] == "ok"
                else row["status"]
            )
            print(f"{preset:5s} {strategy:8s} {fmt_mesh(row['mesh']):16s} {engine:9s} {done}", flush=True)

    ok = {(r["preset"], r["strategy"], r["engine"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        base = ok.get((r["preset"], "1-device", PLANNED.get(r["engine"], (r["engine"],))[0]))
        if r["status"] == "ok" and base and r["strategy"] != "1-device":
            r["weak_scaling_eff"] = r["tokens_per_s"] / (r["devices"] * base["tokens_per_s"])
        jit = ok.get((r["preset"], r["strategy"], "jit"))
        if r["status"] == "ok" and r["engine"] != "jit" and jit:
            r["shardflow_over_jit"] = r["tokens_per_s"] / jit["tokens_per_s"]
    print()
    print_table(rows)
    if args.out:
        write_json(args.out, rows, args)
    return rows


def write_json(path, rows, args) -> None:
    """``rows`` with this run's meta (_results.run_meta) and its step counts."""
    _results.write_json(path, rows, steps=args.steps, warmup=args.warmup)


if __name__ == "__main__":
    main()
