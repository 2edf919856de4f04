"""Attention on the GPU: correctness of our Pallas kernels, and TFLOP/s against cuDNN and JAX's
Pallas Triton `mha`, all in one process.

  python benchmarks/attention.py            # the table (fwd and fwd+bwd, ratios); --out FILE.json
  python benchmarks/attention.py --check    # compiled kernels vs an fp32 reference
  python benchmarks/attention.py --sweep    # per-kernel times over block-size choices
  python benchmarks/attention.py --bwd      # the two backwards alone: Mosaic GPU vs Triton
  python benchmarks/attention.py --fwd      # the two forwards alone
  python benchmarks/attention.py --bwd --variants base=kernels/flash_attention_mgpu.py \
      new=/tmp/edited.py                    # source variants of a kernel, against each other
  python benchmarks/attention.py --profile  # device time per kernel of ours' and cuDNN's fwd+bwd
  python benchmarks/attention.py --paths    # backend="auto" against the Triton kernels, per path
  python benchmarks/attention.py --xla --variants old=/tmp/attention_xla.py --shapes 1,4096,4,2,64
                                            # the XLA attention against a source variant (any backend)

FLOPs: 4*B*S^2*H*D forward (H = q heads), half when causal, x3.5 for forward+backward.
Times: device time, the sum of a call's kernel durations in a profiler trace of --iters calls,
median of 3 interleaved rounds, after --warmup calls. The table also gives wall-clock ratios:
calls dispatched 10 at a time and ended by one block_until_ready, so the host's dispatch and
sync latency is not counted per call. Wall clock can favour whichever contender is compiled
first (by up to 11 % on our kernels, not on cuDNN's); device time does not move with the
order.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from functools import partial
from pathlib import Path

import _checkout  # noqa: F401,E402
import _results  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from attention_timing import (  # noqa: E402
    ROUNDS,
    device_ms_samples,
    interleaved_medians,
    kernel_times,
    median_seconds,
    time_samples,
)

from shardflow.attention import attention  # noqa: E402
from shardflow.kernels import flash_attention_gpu, flash_attention_mgpu  # noqa: E402

# (batch, seq, heads_q, heads_kv, head_dim); the last is GQA 32 q heads over 8 kv heads.
ANCHOR_SHAPES = [
    (4, 4096, 16, 16, 128),
    (1, 16384, 16, 16, 128),
    (8, 2048, 32, 32, 64),
    (2, 4096, 32, 8, 128),
]


def attention_flops(batch, seq, heads_q, head_dim, causal):
    flops = 4.0 * batch * seq * seq * heads_q * head_dim
    return flops / 2 if causal else flops


def random_inputs(batch, seq, heads_q, heads_kv, head_dim, dtype=jnp.bfloat16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads_q, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq, heads_kv, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq, heads_kv, head_dim), dtype)
    dout = jax.random.normal(keys[3], q.shape, dtype)
    return q, k, v, dout


def implementations(causal, group):
    """name -> attention(q, k, v) for the three contenders."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_triton

    def ours(q, k, v):
        return attention(q, k, v, causal=causal, backend="pallas")

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    def triton_mha(q, k, v):
        # mha has no GQA: it gets K/V repeated per q head.
        k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
        return pallas_triton.mha(q, k, v, segment_ids=None, causal=causal, sm_scale=q.shape[-1] ** -0.5)

    # The baseline first: the first-listed contender can measure faster whatever its code (up to
    # 11 % on our kernels by wall clock), so any such bias works against us here.
    return {"cudnn": cudnn, "ours": ours, "triton_mha": triton_mha}


def fwd_and_fwd_bwd(fn):
    fwd = jax.jit(fn)

    @jax.jit
    def fwd_bwd(q, k, v, dout):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(dout)

    return fwd, fwd_bwd


def run_table(args):
    rows = []
    for batch, seq, heads_q, heads_kv, head_dim in args.shapes:
        q, k, v, dout = random_inputs(batch, seq, heads_q, heads_kv, head_dim)
        for causal in args.causal:
            flops = attention_flops(batch, seq, heads_q, head_dim, causal)
            row = {"shape": f"{batch},{seq},{heads_q}/{heads_kv},{head_dim}", "causal": causal}
            # Contenders are timed in interleaved rounds so that drifting clocks hit all of them.
            timed = {}
            for name, fn in implementations(causal, heads_q // heads_kv).items():
                fwd, fwd_bwd = fwd_and_fwd_bwd(fn)
                try:
                    for _ in range(args.warmup):
                        jax.block_until_ready(fwd(q, k, v))
                        jax.block_until_ready(fwd_bwd(q, k, v, dout))
                    timed[name] = (fwd, fwd_bwd)
                except Exception as e:  # report and go on: one failing contender must not hide the rest
                    print(
                        f"{name} failed on {row['shape']} causal={causal}: {type(e).__name__}: {str(e)[:300]}",
                        flush=True,
                    )
                    row[name] = {"fwd": float("nan"), "fwd_bwd": float("nan")}
            calls = {}
            for name, (fwd, fwd_bwd) in timed.items():
                calls[name, "fwd"] = fwd, (q, k, v)
                calls[name, "fwd_bwd"] = fwd_bwd, (q, k, v, dout)
            device_ms = interleaved_medians(calls, partial(device_ms_samples, iters=args.iters))
            seconds = interleaved_medians(calls, partial(time_samples, iters=args.iters))
            for name in timed:  # TFLOP/s: from device time, and from wall clock ("wall_")
                row[name] = {
                    "fwd": flops / device_ms[name, "fwd"] / 1e9,
                    "fwd_bwd": 3.5 * flops / device_ms[name, "fwd_bwd"] / 1e9,
                    "wall_fwd": flops / seconds[name, "fwd"] / 1e12,
                    "wall_fwd_bwd": 3.5 * flops / seconds[name, "fwd_bwd"] / 1e12,
                }
            print(row, flush=True)
            rows.append(row)

    header = (
        "| shape B,S,Hq/Hkv,D | causal | ours fwd | cuDNN fwd | mha fwd | ours/cuDNN fwd | "
        "ours fwd+bwd | cuDNN fwd+bwd | mha fwd+bwd | ours/cuDNN f+b | ours/mha f+b | "
        "wall clock: ours/cuDNN fwd | f+b |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        o, c, m = r["ours"], r["cudnn"], r["triton_mha"]
        wall = lambda x, key: x.get("wall_" + key, np.nan)
        lines.append(
            f"| {r['shape']} | {'yes' if r['causal'] else 'no'} | {o['fwd']:.0f} | "
            f"{c['fwd']:.0f} | {m['fwd']:.0f} | {o['fwd'] / c['fwd']:.2f} | "
            f"{o['fwd_bwd']:.0f} | {c['fwd_bwd']:.0f} | {m['fwd_bwd']:.0f} | "
            f"{o['fwd_bwd'] / c['fwd_bwd']:.2f} | {o['fwd_bwd'] / m['fwd_bwd']:.2f} | "
            f"{wall(o, 'fwd') / wall(c, 'fwd'):.2f} | "
            f"{wall(o, 'fwd_bwd') / wall(c, 'fwd_bwd'):.2f} |"
        )
    print("\nTFLOP/s from device time, bf16, " + jax.devices()[0].device_kind + ", jax " + jax.__version__)
    print("\n".join(lines))
    if args.out:
        finite = lambda x: x if not isinstance(x, float) or np.isfinite(x) else None
        _results.write_json(
            args.out,
            [
                {
                    key: ({k: finite(v) for k, v in value.items()} if isinstance(value, dict) else value)
                    for key, value in r.items()
                }
                for r in rows
            ],
            warmup=args.warmup,
            iters=args.iters,
            units="TFLOP/s",
        )


# ------------------------------------------------------------------------------------------


def reference(q, k, v, *, causal, scale, segment_ids, q_offset, kv_offset):
    """Dense fp32 attention on the device (exact fp32 matmuls)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    mask = jnp.ones(s.shape[-2:], bool)[None, None]
    if causal:
        mask = mask & ((q_offset + jnp.arange(q.shape[1]))[:, None] >= (kv_offset + jnp.arange(k.shape[1]))[None, :])
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest"), lse


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def case_inputs(case, *, seed):
    """(q, k, v, dout, attention keywords) of a CHECK_CASES / PATH_CASES row."""
    batch, q_len, kv_len, hq, hkv, dim, dtype, causal, segments, (q_off, kv_off) = case
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (batch, q_len, hq, dim), dtype)
    k = jax.random.normal(keys[1], (batch, kv_len, hkv, dim), dtype)
    v = jax.random.normal(keys[2], (batch, kv_len, hkv, dim), dtype)
    dout = jax.random.normal(keys[3], q.shape, dtype)
    segment_ids = jnp.sort(jax.random.randint(keys[4], (batch, q_len), 0, 4), -1) if segments else None
    kw = dict(causal=causal, scale=dim**-0.5, segment_ids=segment_ids, q_offset=q_off, kv_offset=kv_off)
    return q, k, v, dout, kw


CHECK_CASES = [
    # batch, q_len, kv_len, heads_q, heads_kv, head_dim, dtype, causal, segments, offsets
    (2, 1024, 1024, 8, 8, 128, jnp.bfloat16, False, False, (0, 0)),
    (2, 1024, 1024, 8, 8, 128, jnp.bfloat16, True, False, (0, 0)),
    (2, 1000, 1000, 8, 2, 64, jnp.bfloat16, True, False, (0, 0)),
    (1, 777, 1300, 8, 1, 128, jnp.float16, True, False, (600, 100)),
    (2, 512, 512, 4, 4, 96, jnp.float32, False, False, (0, 0)),
    (2, 640, 640, 4, 2, 64, jnp.bfloat16, True, True, (0, 0)),
    (1, 256, 512, 4, 4, 64, jnp.bfloat16, True, False, (0, 300)),  # rows with no visible key
    (1, 384, 384, 32, 4, 128, jnp.bfloat16, False, True, (0, 0)),
    (1, 2048, 2048, 16, 4, 64, jnp.bfloat16, True, False, (0, 0)),
    (2, 512, 512, 4, 1, 128, jnp.float16, False, False, (0, 0)),
    (1, 256, 256, 2, 2, 128, jnp.bfloat16, True, False, (7, 7)),
    (2, 512, 512, 8, 2, 128, jnp.bfloat16, False, False, (0, 0)),
    (1, 768, 768, 4, 4, 64, jnp.float16, False, False, (0, 0)),
    # The Mosaic forward's schedule: long rows, causal and not, and an odd number of causal
    # tiles (taken one by one, not in pairs).
    (1, 4608, 4608, 4, 2, 128, jnp.bfloat16, True, False, (0, 0)),
    (1, 4352, 4352, 2, 2, 64, jnp.float16, False, False, (0, 0)),
    (1, 384, 384, 3, 3, 64, jnp.bfloat16, True, False, (0, 0)),
    # The backward's grid: causal GQA with enough CTAs per kv head to run per kv head.
    (4, 4096, 4096, 12, 3, 64, jnp.bfloat16, True, False, (0, 0)),
]


def run_check(args):
    failures = 0
    print("| case | fwd/bwd kernel | out | lse | dq | dk | dv | bound | ok |\n|---|---|---|---|---|---|---|---|---|")
    for seed, case in enumerate(CHECK_CASES):
        batch, q_len, kv_len, hq, hkv, dim, dtype, causal, segments, (q_off, kv_off) = case
        q, k, v, dout, kw = case_inputs(case, seed=100 + seed)
        segment_ids = kw["segment_ids"]
        ours = jax.jit(
            lambda q, k, v: jax.vjp(
                lambda q, k, v: attention(q, k, v, return_lse=True, backend="pallas", **kw), q, k, v
            )
        )
        (out, lse), vjp = ours(q, k, v)
        grads = vjp((dout, jnp.zeros_like(lse)))
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        (out_ref, lse_ref), vjp_ref = jax.vjp(lambda q, k, v: reference(q, k, v, **kw), *f32)
        grads_ref = vjp_ref((dout.astype(jnp.float32), jnp.zeros_like(lse_ref)))
        finite = np.isfinite(np.asarray(lse_ref))
        lse_ok = np.array_equal(np.isfinite(np.asarray(lse)), finite)
        lse_err = rel_err(np.asarray(lse)[finite], np.asarray(lse_ref)[finite]) if lse_ok else 1.0
        errs = [rel_err(out, out_ref), lse_err] + [rel_err(g, r) for g, r in zip(grads, grads_ref)]
        bound = 1e-3 if dtype == jnp.float32 else 1e-2
        ok = all(e < bound for e in errs)
        failures += not ok
        name = (
            f"{batch},{q_len}x{kv_len},{hq}/{hkv},{dim},{jnp.dtype(dtype).name}"
            f"{',causal' if causal else ''}{',segments' if segments else ''}"
            f"{f',off={q_off}/{kv_off}' if (q_off, kv_off) != (0, 0) else ''}"
        )
        kernels = "/".join(
            "mosaic" if supports(q, k, segment_ids, q_off - kv_off, causal=causal, scale=dim**-0.5) else "triton"
            for supports in (flash_attention_mgpu.supports, flash_attention_mgpu.supports_backward)
        )
        print(
            f"| {name} | {kernels} | " + " | ".join(f"{e:.1e}" for e in errs) + f" | {bound:.0e} | "
            f"{'yes' if ok else 'NO'} |",
            flush=True,
        )
    print(f"check: {len(CHECK_CASES) - failures}/{len(CHECK_CASES)} cases passed")
    return failures


# ------------------------------------------------------------------------------------------
# The attention paths that ran on the deprecated Pallas Triton kernels before the Mosaic GPU
# kernels took them: backend="auto" (Mosaic GPU, or the XLA blockwise attention where those do
# not apply) against the Triton kernels, forward + backward, by device time, with errors.

PATH_CASES = {
    # name: batch, q_len, kv_len, heads_q, heads_kv, head_dim, dtype, causal, segments, (q_offset, kv_offset)
    "shift+100 d64": (2, 2048, 2048, 16, 8, 64, jnp.bfloat16, True, False, (100, 0)),
    "shift+100 d128": (2, 2048, 2048, 16, 8, 128, jnp.bfloat16, True, False, (100, 0)),
    "unequal d64": (2, 1024, 2048, 16, 8, 64, jnp.bfloat16, True, False, (1024, 0)),
    "unequal d128": (2, 1024, 2048, 16, 8, 128, jnp.bfloat16, True, False, (1024, 0)),
    "segments d64": (2, 2048, 2048, 16, 8, 64, jnp.bfloat16, True, True, (0, 0)),
    "segments d128": (2, 2048, 2048, 16, 8, 128, jnp.bfloat16, True, True, (0, 0)),
    "causal d32": (2, 2048, 2048, 16, 8, 32, jnp.bfloat16, True, False, (0, 0)),
    "causal d256": (2, 2048, 2048, 16, 8, 256, jnp.bfloat16, True, False, (0, 0)),
    "causal fp32 d64": (2, 2048, 2048, 16, 8, 64, jnp.float32, True, False, (0, 0)),
    "causal fp32 d128": (2, 2048, 2048, 16, 8, 128, jnp.float32, True, False, (0, 0)),
    "causal d80": (2, 2048, 2048, 16, 8, 80, jnp.bfloat16, True, False, (0, 0)),
    "causal d96": (2, 2048, 2048, 16, 8, 96, jnp.bfloat16, True, False, (0, 0)),
    "shift-1 d128": (2, 2048, 2048, 16, 8, 128, jnp.bfloat16, True, False, (0, 1)),
    "causal d64": (2, 2048, 2048, 16, 8, 64, jnp.bfloat16, True, False, (0, 0)),
    "causal d128": (2, 2048, 2048, 16, 8, 128, jnp.bfloat16, True, False, (0, 0)),
}


def triton_attention(causal, scale, segment_ids, offset_delta):
    """attention(q, k, v) by the Pallas Triton kernels alone, forward and backward."""

    @jax.custom_vjp
    def f(q, k, v):
        return fwd(q, k, v)[0]

    def fwd(q, k, v):
        out, lse = flash_attention_gpu.forward(
            q, k, v, segment_ids, offset_delta, causal=causal, scale=scale, allow_mosaic=False
        )
        return out, (q, k, v, out, lse)

    def bwd(res, dout):
        q, k, v, out, lse = res
        return flash_attention_gpu.backward(
            q, k, v, segment_ids, offset_delta, out, lse, dout, causal=causal, scale=scale, allow_mosaic=False
        )

    f.defvjp(fwd, bwd)
    return f


def kernel_kind(fn, *args) -> str:
    """Which kernels a jitted call runs: mosaic, triton, both or xla (neither)."""
    text = fn.lower(*args).as_text()
    kinds = [k for k in ("mosaic_gpu", "triton") if k in text]
    return "+".join(k.split("_")[0] for k in kinds) or "xla"


def run_paths(args):
    names = [n for n in PATH_CASES if not args.cases or n in args.cases]
    print(
        "forward + backward, device ms (median of interleaved rounds); errors against dense fp32\n"
        "| case | auto runs | auto ms | triton ms | triton / auto | auto err out, dq, dk, dv | triton err |\n"
        "|---|---|--:|--:|--:|---|---|",
        flush=True,
    )
    rows = []
    for seed, name in enumerate(names):
        *_, dim, dtype, causal, _, (q_off, kv_off) = PATH_CASES[name]
        q, k, v, dout, kw = case_inputs(PATH_CASES[name], seed=200 + seed)
        segment_ids, scale = kw["segment_ids"], kw["scale"]
        contenders = {
            "auto": lambda q, k, v: attention(q, k, v, backend="auto", **kw),
            "triton": triton_attention(causal, scale, segment_ids, q_off - kv_off),
        }
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        out_ref, vjp_ref = jax.vjp(lambda q, k, v: reference(q, k, v, **kw)[0], *f32)
        wanted = (out_ref, *vjp_ref(dout.astype(jnp.float32)))
        calls, errors, ran = {}, {}, "?"
        for contender, fn in contenders.items():
            _, fwd_bwd = fwd_and_fwd_bwd(fn)
            try:
                out, grads = fwd_bwd(q, k, v, dout)
                errors[contender] = [rel_err(a, b) for a, b in zip((out, *grads), wanted)]
                calls[contender] = (fwd_bwd, (q, k, v, dout))
                if contender == "auto":
                    ran = kernel_kind(fwd_bwd, q, k, v, dout)
            except Exception as e:  # the Triton kernels take no fp32 head of 256, say
                print(f"{name}: {contender} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        for fn, a in calls.values():
            for _ in range(args.warmup):
                jax.block_until_ready(fn(*a))
        ms = interleaved_medians(calls, partial(device_ms_samples, iters=args.iters), rounds=args.rounds)
        auto_ms, triton_ms = ms.get("auto", float("nan")), ms.get("triton", float("nan"))
        err = {c: ", ".join(f"{e:.1e}" for e in errors[c]) if c in errors else "-" for c in contenders}
        print(
            f"| {name} | {ran} | {auto_ms:.3f} | {triton_ms:.3f} | {triton_ms / auto_ms:.2f} | {err['auto']} | "
            f"{err['triton']} |",
            flush=True,
        )
        rows.append(
            dict(
                case=name,
                shape=PATH_CASES[name][:6],
                dtype=jnp.dtype(dtype).name,
                auto_runs=ran,
                auto_ms=auto_ms,
                triton_ms=triton_ms,
                errors=errors,
            )
        )
    return rows


SWEEP = {
    # (block_q, block_k, warps, stages)
    "fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4)],
    "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2)],
    "dkv": [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
}


def run_sweep(args):
    """Times each kernel alone over block-size choices (block_q, block_k, warps, stages)."""
    shapes = [(4, 4096, 16, 16, 128), (8, 2048, 32, 32, 64)]
    for batch, seq, hq, hkv, dim in shapes:
        q, k, v, dout = random_inputs(batch, seq, hq, hkv, dim)
        for causal in (False, True):
            flops = attention_flops(batch, seq, hq, dim, causal)
            base = flash_attention_gpu.default_block_sizes(dim, causal, q.dtype)
            fwd = jax.jit(
                lambda q, k, v: flash_attention_gpu.forward(
                    q, k, v, None, 0, causal=causal, scale=dim**-0.5, allow_mosaic=False
                )
            )
            out, lse = fwd(q, k, v)
            mosaic = jax.jit(
                lambda q, k, v: flash_attention_gpu.forward(q, k, v, None, 0, causal=causal, scale=dim**-0.5)
            )
            t = median_seconds(mosaic, (q, k, v), warmup=2, iters=args.iters)
            print(
                f"sweep {batch},{seq},{hq},{dim} causal={causal} fwd default (mosaic if supported): "
                f"{t * 1e3:.3f} ms {flops / t / 1e12:.0f} TFLOP/s",
                flush=True,
            )
            for kernel, choices in SWEEP.items():
                for bq, bk, warps, stages in choices:
                    bs = dataclasses.replace(
                        base,
                        **{
                            f"{kernel}_block_q": bq,
                            f"{kernel}_block_k": bk,
                            f"{kernel}_num_warps": warps,
                            f"{kernel}_num_stages": stages,
                        },
                    )
                    if kernel == "fwd":
                        fn = jax.jit(
                            lambda q, k, v, bs=bs: flash_attention_gpu.forward(
                                q, k, v, None, 0, causal=causal, scale=dim**-0.5, block_sizes=bs
                            )
                        )
                        kernel_args, kernel_flops = (q, k, v), flops
                    else:
                        # The whole backward (both kernels) is timed; 2.5x the forward's FLOPs.
                        fn = jax.jit(
                            lambda q, k, v, out, lse, dout, bs=bs: flash_attention_gpu.backward(
                                q, k, v, None, 0, out, lse, dout, causal=causal, scale=dim**-0.5, block_sizes=bs
                            )
                        )
                        kernel_args, kernel_flops = (q, k, v, out, lse, dout), 2.5 * flops
                    try:
                        t = median_seconds(fn, kernel_args, warmup=2, iters=args.iters)
                        print(
                            f"sweep {batch},{seq},{hq},{dim} causal={causal} {kernel} "
                            f"bq={bq} bk={bk} w={warps} s={stages}: {t * 1e3:.3f} ms "
                            f"{kernel_flops / t / 1e12:.0f} TFLOP/s" + (" (whole backward)" if kernel != "fwd" else ""),
                            flush=True,
                        )
                    except Exception as e:
                        print(
                            f"sweep {kernel} bq={bq} bk={bk} w={warps} s={stages} failed: "
                            f"{type(e).__name__}: {str(e)[:200]}",
                            flush=True,
                        )


def load_kernel_variant(name, path):
    """A source variant of a kernels/ module (e.g. an edited copy of flash_attention_mgpu.py),
    loaded as a module of shardflow.kernels so that its relative imports resolve."""
    import types

    module = types.ModuleType(f"shardflow.kernels.variant_{name}")
    module.__package__ = "shardflow.kernels"
    exec(compile(Path(path).read_text(), str(path), "exec"), module.__dict__)
    return module


def run_kernel_variants(args):
    """Times one pass alone on the anchor shapes, in interleaved rounds: with --bwd the backward
    (2.5x the forward's FLOPs), the fused Mosaic GPU kernel against the split Triton pair; with
    --fwd the forward, Mosaic GPU against Triton. With --variants, that pass of each given source
    variant instead of the shipped Mosaic kernel. Diffs are against the Triton kernels'."""
    pass_name = "backward" if args.bwd else "forward"

    def shipped(*arrays, **kw):
        """flash_attention_gpu's pass with a variant's signature (no segment ids, no offset)."""
        q, k, v, *rest = arrays
        return getattr(flash_attention_gpu, pass_name)(q, k, v, None, 0, *rest, **kw)

    contenders = {
        name: getattr(load_kernel_variant(name, path), pass_name)
        for name, path in (v.split("=", 1) for v in args.variants)
    }
    contenders = contenders or {"mosaic": shipped}
    names = list(contenders) + ["triton"]
    outputs = "dq,dk,dv" if args.bwd else "out,lse"
    print(
        f"{pass_name} alone (wall ms: interleaved rounds, biased towards the first-listed; "
        f"device ms: profiler kernel time, the arbiter)\n| shape | causal | "
        + " | ".join(f"{n} wall ms | device ms | device TFLOP/s" for n in names)
        + f" | max rel diff {outputs} vs triton |\n|---|---|"
        + "---|---|---|" * len(names)
        + "---|"
    )
    for batch, seq, hq, hkv, dim in args.shapes:
        q, k, v, dout = random_inputs(batch, seq, hq, hkv, dim)
        for causal in args.causal:
            flops = (2.5 if args.bwd else 1.0) * attention_flops(batch, seq, hq, dim, causal)
            kw = dict(causal=causal, scale=dim**-0.5)
            args_ = (q, k, v)
            if args.bwd:
                out, lse = jax.jit(lambda q, k, v: flash_attention_gpu.forward(q, k, v, None, 0, **kw))(q, k, v)
                args_ = (q, k, v, out, lse, dout)
            triton = jax.jit(lambda *a: shipped(*a, allow_mosaic=False, **kw))
            fns, diffs = {}, {}
            reference = triton(*args_)
            for name, kernel in contenders.items():
                fn = jax.jit(lambda *a, kernel=kernel: kernel(*a, **kw))
                try:
                    diffs[name] = max(rel_err(a, b) for a, b in zip(fn(*args_), reference))
                    fns[name] = fn
                except Exception as e:  # report and go on
                    print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            fns["triton"] = triton
            for fn in fns.values():
                for _ in range(args.warmup):
                    jax.block_until_ready(fn(*args_))
            calls = {name: (fn, args_) for name, fn in fns.items()}
            seconds = interleaved_medians(calls, partial(time_samples, iters=args.iters), rounds=args.rounds)
            device_ms = interleaved_medians(calls, partial(device_ms_samples, iters=args.iters), rounds=args.rounds)
            cells = []
            for name in names:
                t, ms = seconds.get(name, float("nan")), device_ms.get(name, float("nan"))
                cells.append(f"{t * 1e3:.2f} | {ms:.3f} | {flops / ms / 1e9:.0f}")
            print(
                f"| {batch},{seq},{hq}/{hkv},{dim} | {'yes' if causal else 'no'} | "
                + " | ".join(cells)
                + " | "
                + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items())
                + " |",
                flush=True,
            )


def run_xla_variants(args):
    """The XLA blockwise attention's forward + backward (kernels/attention_xla.py) against source
    variants of it (--variants NAME=FILE, e.g. the previous commit's), wall clock in interleaved
    rounds on whatever backend runs (CPU included), with the largest difference from this tree's
    results. Shapes from --shapes, fp32 (B,S,HQ,HKV,D)."""
    from shardflow.kernels import attention_xla

    contenders = {"this tree": attention_xla}
    contenders.update(
        {name: load_kernel_variant(name, path) for name, path in (v.split("=", 1) for v in args.variants)}
    )
    names = list(contenders)
    print(
        "attention_xla forward + backward, fp32, wall ms (median of interleaved rounds)\n| shape | causal | "
        + " | ".join(f"{n} ms" for n in names)
        + " | "
        + " | ".join(f"{n} / this tree" for n in names[1:])
        + " | max abs diff |\n|---|---|"
        + "--:|" * (2 * len(names) - 1)
        + "--:|"
    )
    for batch, seq, hq, hkv, dim in args.shapes:
        q, k, v, dout = random_inputs(batch, seq, hq, hkv, dim, dtype=jnp.float32)
        for causal in args.causal:
            kw = dict(causal=causal, scale=dim**-0.5)

            def fwd_bwd(q, k, v, dout, module):
                out, lse = module.forward(q, k, v, None, 0, **kw)
                return out, lse, module.backward(q, k, v, None, 0, out, lse, dout, **kw)

            calls = {n: (jax.jit(partial(fwd_bwd, module=m)), (q, k, v, dout)) for n, m in contenders.items()}
            results = {n: jax.block_until_ready(fn(*a)) for n, (fn, a) in calls.items()}
            diff = (
                max(
                    float(jnp.max(jnp.abs(x - y)))
                    for n in names[1:]
                    for x, y in zip(jax.tree.leaves(results[n]), jax.tree.leaves(results[names[0]]))
                )
                if len(names) > 1
                else 0.0
            )
            seconds = interleaved_medians(calls, partial(time_samples, iters=args.iters), rounds=args.rounds)
            base = seconds[names[0]]
            print(
                f"| {batch},{seq},{hq}/{hkv},{dim} | {'yes' if causal else 'no'} | "
                + " | ".join(f"{seconds[n] * 1e3:.1f}" for n in names)
                + " | "
                + " | ".join(f"{seconds[n] / base:.2f}" for n in names[1:])
                + f" | {diff:.1e} |",
                flush=True,
            )


def run_profile(args):
    """Where forward+backward spends its device time, kernel by kernel, ours against cuDNN."""
    for batch, seq, hq, hkv, dim in args.shapes:
        q, k, v, dout = random_inputs(batch, seq, hq, hkv, dim)
        for causal in args.causal:
            flops = 3.5 * attention_flops(batch, seq, hq, dim, causal)
            print(f"\n{batch},{seq},{hq}/{hkv},{dim} causal={causal}", flush=True)
            for name, fn in implementations(causal, hq // hkv).items():
                if name == "triton_mha":
                    continue
                fwd_bwd = fwd_and_fwd_bwd(fn)[1]
                for _ in range(args.warmup):
                    jax.block_until_ready(fwd_bwd(q, k, v, dout))
                times = kernel_times(fwd_bwd, (q, k, v, dout), iters=args.iters)
                total = sum(t for _, t in times)
                print(f"  {name}: {total:.3f} ms on the device, {flops / total / 1e9:.0f} TFLOP/s")
                for kernel, t in times:
                    print(f"    {t:8.3f} ms  {kernel[:110]}")


def _patched_attention_mgpu():
    """JAX's Mosaic GPU attention with its float16-only shared-memory buffers made dtype-generic
    (jax 0.11.2 allocates them as float16, so bfloat16 inputs fail). Probe only."""
    import types

    from jax.experimental.pallas.ops.gpu import attention_mgpu

    source = Path(attention_mgpu.__file__).read_text()
    source = source.replace("head_dim), jnp.float16,", "head_dim), dtype,")
    module = types.ModuleType("attention_mgpu_patched")
    module.__file__ = attention_mgpu.__file__
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(source, "attention_mgpu_patched", "exec"), module.__dict__)
    return module


def run_probe_mgpu(args):
    """JAX's own Mosaic GPU (FA3-style) kernel, to see what that lowering reaches here."""
    attention_mgpu = _patched_attention_mgpu()
    for dtype in (jnp.float16, jnp.bfloat16):
        for batch, seq, hq, hkv, dim in [(4, 4096, 16, 16, 128), (8, 2048, 32, 32, 64)]:
            q, k, v, dout = random_inputs(batch, seq, hq, hkv, dim, dtype)
            for causal in (False, True):
                flops = attention_flops(batch, seq, hq, dim, causal)
                config = attention_mgpu.TuningConfig(
                    block_q=64,
                    block_kv=128,
                    max_concurrent_steps=2,
                    causal=causal,
                    block_q_dkv=64,
                    block_kv_dkv=64,
                    block_q_dq=64,
                    block_kv_dq=64,
                )
                fn = lambda q, k, v, config=config: attention_mgpu.attention(q, k, v, config)
                fwd, fwd_bwd = fwd_and_fwd_bwd(fn)
                msg = ""
                try:
                    small = [x[:1, :1024] for x in (q, k, v)]
                    ref, _ = reference(
                        *small, causal=causal, scale=dim**-0.5, segment_ids=None, q_offset=0, kv_offset=0
                    )
                    msg += f"err {rel_err(fwd(*small), ref):.1e}"
                    t = median_seconds(fwd, (q, k, v), warmup=2, iters=args.iters)
                    msg += f", fwd {flops / t / 1e12:.0f} TFLOP/s"
                    if not causal:
                        t = median_seconds(fwd_bwd, (q, k, v, dout), warmup=2, iters=args.iters)
                        msg += f", fwd+bwd {3.5 * flops / t / 1e12:.0f}"
                except Exception as e:
                    msg += f" failed: {type(e).__name__}: {str(e)[:300]}"
                print(f"mgpu {jnp.dtype(dtype).name} {batch},{seq},{hq},{dim} causal={causal}: {msg}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--probe-mgpu", action="store_true")
    parser.add_argument("--bwd", action="store_true")
    parser.add_argument("--fwd", action="store_true")
    parser.add_argument(
        "--causal",
        choices=("both", "yes", "no"),
        default="both",
        help="with the table, --bwd, --fwd or --profile: which rows",
    )
    parser.add_argument(
        "--shapes",
        nargs="*",
        default=None,
        metavar="B,S,HQ,HKV,D",
        help="with the table, --bwd, --fwd or --profile: these shapes instead of the anchors",
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="with --bwd or --fwd: interleaved timing rounds")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--paths", action="store_true", help="backend='auto' against the Triton kernels on PATH_CASES")
    parser.add_argument("--cases", nargs="*", default=[], help="with --paths: these PATH_CASES only")
    parser.add_argument(
        "--xla", action="store_true", help="kernels/attention_xla.py against --variants of it, on any backend"
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        metavar="NAME=FILE",
        help="with --bwd or --fwd: time these source variants of a kernels/ "
        "module's `backward` or `forward` (e.g. edited copies of "
        "flash_attention_mgpu.py); judge by device ms: wall ms has "
        "favoured the first listed by up to 7 %% whatever its code",
    )
    parser.add_argument("--table", action="store_true", help="the benchmark table (default)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", help="with the table: write its rows as JSON to this file")
    args = parser.parse_args()
    args.causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    args.shapes = [tuple(int(n) for n in s.split(",")) for s in args.shapes] if args.shapes else ANCHOR_SHAPES
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    failures = 0
    if args.check:
        failures = run_check(args)
    if args.sweep:
        run_sweep(args)
    if args.probe_mgpu:
        run_probe_mgpu(args)
    if args.xla:
        run_xla_variants(args)
    elif args.bwd or args.fwd:
        run_kernel_variants(args)
    if args.profile:
        run_profile(args)
    if args.paths:
        rows = run_paths(args)
        if args.out:
            _results.write_json(args.out, rows)
    if args.table or not (
        args.check or args.sweep or args.probe_mgpu or args.bwd or args.fwd or args.profile or args.paths or args.xla
    ):
        run_table(args)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
