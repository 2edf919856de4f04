"""Sequence-parallel attention: TFLOP/s per GPU of each context-parallel variant against our
single-GPU kernel, in one run.

    python benchmarks/context.py                       # 32k, 64k, 128k tokens on every GPU
    python benchmarks/context.py --seq 65536 --variants zigzag,ulysses
    python benchmarks/context.py --cpu-check           # the same code on 8 simulated CPUs, tiny
    python benchmarks/context.py --train --seq 65536   # the 1b preset's training step per variant
    python benchmarks/context.py --profile zigzag --seq 65536 --out-dir DIR   # overlap, one step

Causal attention, batch 1, the heads of a model preset (1b: 16 q heads over 8 kv heads, head
dim 128), q / k / v split along the sequence over {context: N}, forward + backward
(`jax.value_and_grad`) under `sf.parallelize`, for each variant of `attention(context=...,
layout=...)`: ring (contiguous blocks), zigzag and striped (a ring over tokens in that order),
ulysses (re-split by heads), all_gather (K/V gathered, queries split contiguously),
zigzag-all_gather and striped-all_gather (the ring's steps over tokens in that order, K/V
gathered once and the dK/dV sums passed home: `context="all_gather"` with the layout). The
baseline is the same attention on one GPU at the same sequence length; a variant's ratio is
its per-GPU TFLOP/s over the baseline's TFLOP/s (ideal 1.0). FLOPs: 4 S^2 H D / 2 forward, x3.5 forward + backward.
Times: wall clock of --steps calls after --warmup, ended by one block_until_ready.

--train: the preset's `shardflow train` step (strategy cp: the sequence over {context: N}
everywhere, batch 1, AdamW) with ``model.context`` set to each variant: tokens/s and MFU.
--profile VARIANT: --steps traced attention steps of that variant, dispatched back to back as
the timed ones are; per GPU and step, the time from its first to its last kernel, the time no
kernel runs, the time NCCL kernels (the ring's collectives) run and how much of it overlaps an
attention kernel.
"""

from __future__ import annotations

import argparse
import os
import time

import _checkout  # noqa: F401

VARIANTS = ("ring", "zigzag", "striped", "ulysses", "all_gather", "zigzag-all_gather", "striped-all_gather")


def flops(seq: int, heads: int, head_dim: int) -> float:
    return 4 * seq * seq * heads * head_dim / 2 * 3.5


def measure(fn, args, steps: int, warmup: int) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    out = None
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def qkv(seq: int, heads: int, kv_heads: int, head_dim: int):
    """Random bf16 q, k, v of batch 1."""
    import jax.numpy as jnp
    import numpy as np

    r = np.random.default_rng(0)
    return tuple(
        jnp.asarray(r.standard_normal((1, seq, h, head_dim)) * 0.5, jnp.bfloat16) for h in (heads, kv_heads, kv_heads)
    )


def step_fn(variant: str, n: int, causal: bool, backend: str):
    """(value_and_grad of the attention under ``variant`` on {context: n}, the q / k / v
    sharding it takes: inputs are placed before timing, as the one-device baseline's are)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import shardflow as sf
    from shardflow.attention import Layout, attention

    kind, _, gathered = variant.partition("-")
    layout = Layout(kind, n) if kind in ("zigzag", "striped") else None
    context = gathered or ("ring" if layout is not None else variant)

    def loss(q, k, v):
        return jnp.sum(
            attention(q, k, v, causal=causal, backend=backend, context=context, layout=layout).astype(jnp.float32)
        )

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    if n == 1:
        return jax.jit(fn), jax.devices()[0]
    seq = P(None, "context")
    mesh = sf.make_mesh({"context": n})
    return (
        sf.parallelize(fn, mesh=mesh, in_specs=seq, out_specs=(P(), (seq, seq, seq))),
        jax.sharding.NamedSharding(mesh, seq),
    )


def train_rows(preset: str, seq: int, n: int, variants, remat: str, steps: int, warmup: int) -> list[dict]:
    """The preset's training step on {data: devices / n, context: n}, a sequence of ``seq``
    tokens per data replica, per variant."""
    import jax
    import train_mfu

    from shardflow.train import config, metrics

    replicas = jax.device_count() // n  # the trainer takes every device: the rest on `data`
    rows = []
    for variant in variants:
        row = {"seq": seq, "variant": variant, "train": True, "remat": remat}
        try:
            cfg = config.Config(
                mesh={"data": replicas, "context": n},
                strategy="cp",
                batch_size=replicas,
                steps=warmup + steps,
                eval_every=0,
                compute_dtype="bfloat16",
            )
            cfg.model = {"preset": preset, "remat": remat, "attention_impl": "ops", "context": variant}
            cfg.data.seq_len = seq
            run, seconds, out, compiled = train_mfu.time_steps(cfg, replicas, seq, steps, warmup)
            peak = metrics.peak_flops(jax.devices()[0])
            tok_s = replicas * seq / seconds
            mfu = (
                tok_s * metrics.flops_per_token(run.model_cfg, run.n_params, seq) / (peak * jax.device_count())
                if peak
                else None
            )
            row.update(
                status="ok",
                ms=seconds * 1e3,
                tokens_per_s=tok_s,
                mfu=mfu,
                loss=float(out["loss"]),
                compiled_gb=compiled / 1e9,
            )
        except Exception as e:  # noqa: BLE001 - report and go on (e.g. out of memory)
            row.update(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        rows.append(row)
        print(
            f"{seq:7d} {variant:11s} train "
            + (
                f"{row['ms']:9.1f} ms {row['tokens_per_s']:9,.0f} tok/s  MFU "
                + (f"{100 * row['mfu']:.1f} %" if row["mfu"] else "n/a")
                + f"  compiled {row['compiled_gb']:.2f} GB per device"
                if row["status"] == "ok"
                else row["status"]
            ),
            flush=True,
        )
        jax.clear_caches()
    return rows


def overlap(trace_dir: str, devices: int) -> list[dict]:
    """Per GPU of a perfetto trace: NCCL kernel time, attention kernel time, and the NCCL time
    during which an attention kernel runs (on another stream)."""
    import glob
    import gzip
    import json
    import re

    from scaling import merged

    path = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = {
        e["pid"]: int(m.group(1))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
        for m in [re.search(r"GPU:(\d+)$", e["args"]["name"])]
        if m
    }

    def covered(spans, others):
        """Length of ``spans`` covered by the union of ``others`` (both lists of (start, end))."""
        union = merged(others)
        return sum(max(0.0, min(b, y) - max(a, x)) for a, b in spans for x, y in union)

    def union(spans):
        return sum(b - a for a, b in merged(spans))

    rows = []
    for g in range(devices):
        kernels = [
            (e["name"].lower(), e["ts"], e["ts"] + e.get("dur", 0))
            for e in events
            if e.get("ph") == "X" and gpu.get(e.get("pid")) == g
        ]
        nccl = [(a, b) for name, a, b in kernels if "nccl" in name]
        attn = [
            (a, b)
            for name, a, b in kernels
            if "nccl" not in name and any(w in name for w in ("attention", "flash", "mosaic", "_fwd", "_bwd"))
        ]
        compute = [(a, b) for name, a, b in kernels if "nccl" not in name]
        by_name = {}
        for name, a, b in kernels:
            by_name[name[:60]] = by_name.get(name[:60], 0.0) + (b - a) / 1e3
        span = (max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)) / 1e3 if kernels else 0.0
        rows.append(
            {
                "gpu": g,
                "top_kernels_ms": sorted(by_name.items(), key=lambda x: -x[1])[:12],
                "span_ms": span,
                "compute_ms": union(compute) / 1e3,
                "idle_ms": span - union([(a, b) for _, a, b in kernels]) / 1e3,
                "nccl_ms": sum(b - a for a, b in nccl) / 1e3,
                "attention_ms": sum(b - a for a, b in attn) / 1e3,
                "nccl_under_attention_ms": covered(nccl, attn) / 1e3,
            }
        )
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", default="32768,65536,131072", help="total tokens, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cpu-check", action="store_true", help="8 simulated CPUs, tiny shapes")
    parser.add_argument("--train", action="store_true", help="the preset's training step per variant")
    parser.add_argument("--remat", default="none", help="--train: the model's remat policy")
    parser.add_argument(
        "--profile", metavar="VARIANT", help="trace --steps attention steps of VARIANT (or one-device: the baseline)"
    )
    parser.add_argument("--out-dir", default="/tmp/context_profile", help="--profile: where the trace goes")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown {sorted(set(variants) - set(VARIANTS))}; choose from {VARIANTS}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from shardflow.train import configure_host_platform

    configure_host_platform()  # on a CPU-only machine: simulated devices for --cpu-check
    import jax

    from shardflow import models

    cfg = models.preset(args.preset)
    heads, kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    seqs = [int(s) for s in args.seq.split(",")]
    backend = "auto"
    if args.cpu_check:
        heads, kv_heads, head_dim, seqs, backend = 8, 4, 16, [256], "xla"
    n = 4 if args.cpu_check else jax.device_count()
    if jax.device_count() < n:
        parser.error(f"--cpu-check needs {n} devices, JAX has {jax.device_count()}")
    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"{heads} q heads / {kv_heads} kv heads x {head_dim}, context axis of {n}"
    )
    if args.train:
        preset = "tiny" if args.cpu_check else args.preset
        rows = [
            row for seq in seqs for row in train_rows(preset, seq, n, variants, args.remat, args.steps, args.warmup)
        ]
        return _written(rows, args)
    if args.profile:
        one = args.profile == "one-device"
        fn, sharding = step_fn("ring" if one else args.profile, 1 if one else n, True, backend)
        n = 1 if one else n
        q, k, v = jax.device_put(qkv(seqs[0], heads, kv_heads, head_dim), sharding)
        measure(fn, (q, k, v), 1, args.warmup)
        with jax.profiler.trace(args.out_dir, create_perfetto_trace=True):
            wall = measure(fn, (q, k, v), args.steps, 0)  # dispatched as the timed steps are
        rows = overlap(args.out_dir, n)
        print(f"{args.steps} steps traced back to back, {wall * 1e3:.2f} ms a step by the wall clock; per step:")
        for row in rows:
            for key in ("span_ms", "compute_ms", "idle_ms", "nccl_ms", "attention_ms", "nccl_under_attention_ms"):
                row[key] /= args.steps
            row["top_kernels_ms"] = [(name, ms / args.steps) for name, ms in row["top_kernels_ms"]]
        for row in rows:
            print(
                f"GPU{row['gpu']}: first to last kernel {row['span_ms']:.2f} ms: compute kernels "
                f"{row['compute_ms']:.2f} ms (attention {row['attention_ms']:.2f}), no kernel "
                f"{row['idle_ms']:.2f} ms; NCCL {row['nccl_ms']:.2f} ms, {row['nccl_under_attention_ms']:.2f} "
                f"of it while an attention kernel runs"
            )
        print("  top kernels: " + "; ".join(f"{name} {ms:.2f}" for name, ms in rows[0]["top_kernels_ms"]))
        return rows
    rows = []
    for seq in seqs:
        q, k, v = qkv(seq, heads, kv_heads, head_dim)
        work = flops(seq, heads, head_dim)
        base = None
        for variant in ["one device"] + variants:
            row = {"seq": seq, "variant": variant}
            try:
                fn, sharding = step_fn(
                    "ring" if variant == "one device" else variant, 1 if variant == "one device" else n, True, backend
                )
                seconds = measure(fn, jax.device_put((q, k, v), sharding), args.steps, args.warmup)
                per_gpu = work / seconds / 1e12 / (1 if variant == "one device" else n)
                row.update(status="ok", ms=seconds * 1e3, tflops_per_gpu=per_gpu)
                if variant == "one device":
                    base = per_gpu
                row["ratio"] = per_gpu / base if base else None
            except Exception as e:  # noqa: BLE001 - report and go on (e.g. out of memory)
                row.update(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            rows.append(row)
            print(
                f"{seq:7d} {variant:11s} "
                + (
                    f"{row['ms']:9.2f} ms {row['tflops_per_gpu']:7.1f} TFLOP/s/GPU  x{row['ratio']:.3f}"
                    if row["status"] == "ok"
                    else row["status"]
                ),
                flush=True,
            )
    return _written(rows, args)


def _written(rows, args):
    if args.out:
        import scaling

        scaling.write_json(args.out, rows, args)
    return rows


if __name__ == "__main__":
    main()
