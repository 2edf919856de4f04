"""Sequence-parallel attention: TFLOP/s per GPU of each context-parallel variant against our
single-GPU kernel, in one run.

    python benchmarks/context.py                       # 32k, 64k, 128k tokens on every GPU
    python benchmarks/context.py --seq 65536 --variants zigzag,ulysses
    python benchmarks/context.py --cpu-check           # the same code on 8 simulated CPUs, tiny

Causal attention, batch 1, the heads of a model preset (1b: 32 q heads over 8 kv heads, head
dim 64), q / k / v split along the sequence over {context: N}, forward + backward
(`jax.value_and_grad`) under `sf.parallelize`, for each variant of `attention(context=...,
layout=...)`: ring (contiguous blocks), zigzag and striped (a ring over tokens in that order),
ulysses (re-split by heads), all_gather (K/V gathered). The baseline is the same attention on
one GPU at the same sequence length; a variant's ratio is its per-GPU TFLOP/s over the
baseline's TFLOP/s (ideal 1.0). FLOPs: 4 S^2 H D / 2 forward, x3.5 forward + backward. Times:
wall clock of --steps calls after --warmup, ended by one block_until_ready.
"""
from __future__ import annotations

import argparse
import os
import time

import _checkout  # noqa: F401

VARIANTS = ("ring", "zigzag", "striped", "ulysses", "all_gather")


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


def step_fn(variant: str, n: int, causal: bool, backend: str):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import shardflow as sf
    from shardflow.ops import Layout, attention

    layout = Layout(variant, n) if variant in ("zigzag", "striped") else None
    context = "ring" if layout is not None else variant

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, causal=causal, backend=backend, context=context,
                                 layout=layout).astype(jnp.float32))

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    if n == 1:
        return jax.jit(fn)
    seq = P(None, "context")
    return sf.parallelize(fn, mesh=sf.make_mesh({"context": n}), in_specs=seq,
                          out_specs=(P(), (seq, seq, seq)))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", default="32768,65536,131072", help="total tokens, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cpu-check", action="store_true", help="8 simulated CPUs, tiny shapes")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown {sorted(set(variants) - set(VARIANTS))}; choose from {VARIANTS}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from shardflow.train import configure_host_platform
    configure_host_platform()          # on a CPU-only machine: simulated devices for --cpu-check
    import jax
    import jax.numpy as jnp
    import numpy as np

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
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, "
          f"{heads} q heads / {kv_heads} kv heads x {head_dim}, context axis of {n}")
    rows = []
    for seq in seqs:
        r = np.random.default_rng(0)
        q, k, v = (jnp.asarray(r.standard_normal((1, seq, h, head_dim)) * 0.5, jnp.bfloat16)
                   for h in (heads, kv_heads, kv_heads))
        work = flops(seq, heads, head_dim)
        base = None
        for variant in ["one device"] + variants:
            row = {"seq": seq, "variant": variant}
            try:
                fn = step_fn("ring" if variant == "one device" else variant,
                             1 if variant == "one device" else n, True, backend)
                seconds = measure(fn, (q, k, v), args.steps, args.warmup)
                per_gpu = work / seconds / 1e12 / (1 if variant == "one device" else n)
                row.update(status="ok", ms=seconds * 1e3, tflops_per_gpu=per_gpu)
                if variant == "one device":
                    base = per_gpu
                row["ratio"] = per_gpu / base if base else None
            except Exception as e:  # noqa: BLE001 - report and go on (e.g. out of memory)
                row.update(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            rows.append(row)
            print(f"{seq:7d} {variant:11s} " + (f"{row['ms']:9.2f} ms {row['tflops_per_gpu']:7.1f} TFLOP/s/GPU"
                                                 f"  x{row['ratio']:.3f}" if row["status"] == "ok" else row["status"]),
                  flush=True)
    if args.out:
        import scaling
        scaling.write_json(args.out, rows, args)
    return rows


if __name__ == "__main__":
    main()
