"""Training throughput and MFU: shardflow vs a plain-JAX reference of the same model, same run.

    python benchmarks/train_mfu.py                  # 1b at 8x4096, then 3b with remat (GPU)
    python benchmarks/train_mfu.py --preset tiny    # end-to-end check on CPU

shardflow: the `shardflow train` step (fp32 master weights, bf16 compute, AdamW + clipping,
attention through shardflow.attention.attention) run by ``sf.parallelize``.
reference: the same model and optimizer as one ``jax.jit`` program — scan over layers, cuDNN
attention called directly (``jax.nn.dot_product_attention(implementation="cudnn")`` on GPU),
optax: a plain-JAX program of the same training step.
shardflow-cudnn (optional): the shardflow engine with the reference's cuDNN attention, which
separates what the compiler costs from what the attention kernel costs.
shardflow-plain-loss (optional): the shardflow engine with the models' loss written plainly,
the [tokens, vocab] float32 logits materialised, which prices the fused chunked cross-entropy.
shardflow-fp8 (optional): the shardflow engine with ``model.fp8: true`` (models/fp8.py: the
projections and dense MLPs the size rule admits in FP8); its ratio to shardflow is printed.

MoE presets (dropless routing): the reference's expert layer is written as MaxText writes its
GPU path (``sparse_matmul`` without megablox): the token choices sorted by expert with a gather,
the experts as three ``jax.lax.ragged_dot`` grouped GEMMs, the results unsorted with a second
gather and combined by their gates. shardflow runs ``shardflow.experts.routed_experts`` (our
grouped-GEMM kernels on Hopper). Same router, same weights, same numbers up to rounding.

Both run on the same random token batch, resident on device; the first steps (compilation)
are not timed. MFU = tokens/s · FLOPs per token / (peak · devices), with FLOPs per token from
shardflow.train.metrics.flops_per_token (6·N + causal attention).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import traceback
import unittest.mock

import _checkout  # noqa: F401
import _results

from shardflow.train import configure_host_platform

CASES = {  # preset -> (batch, seq, remat)
    "1b": (8, 4096, "none"),
    "3b": (8, 4096, "dots"),
    "7b": (4, 4096, "full"),  # fits one H200 (141 GB) with float32 Adam state, not an 80 GB GPU
    "moe-1b": (2, 4096, "dots"),  # at 4 neither engine fits one 80 GB GPU (train_mfu.md, 2026-12-07)
    "tiny": (16, 256, "none"),
    "moe-tiny": (16, 256, "none"),
}


def maxtext_style_experts(x, gates, experts, w_gate, w_up, w_down):
    """The dropless expert layer as MaxText's GPU path computes it: sort, ragged_dot, unsort."""
    import jax
    import jax.numpy as jnp

    k, d = experts.shape[-1], x.shape[-1]
    flat = experts.reshape(-1)
    by_expert = jnp.argsort(flat)
    rows = x.reshape(-1, d)[by_expert // k]
    sizes = jnp.bincount(flat, length=w_gate.shape[0])
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, w_gate, sizes)) * jax.lax.ragged_dot(rows, w_up, sizes)
    out = jax.lax.ragged_dot(hidden, w_down, sizes)[jnp.argsort(by_expert)]
    return jnp.einsum("...k,...kd->...d", gates.astype(x.dtype), out.reshape(*experts.shape, d))


def materialised_cross_entropy(hidden, weight, targets):
    """The models' loss as most programs write it: the whole float32 logits, then optax."""
    import jax.numpy as jnp
    import optax

    logits = jnp.einsum("...d,dv->...v", hidden, weight, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def measure(preset: str, batch: int, seq: int, remat: str, engine: str, steps: int, warmup: int, peak: float | None):
    import jax

    from shardflow.train import config, metrics

    on_gpu = jax.default_backend() == "gpu"
    cfg = config.Config()
    reference_attention = "cudnn" if on_gpu else "jax"
    cfg.model = {
        "preset": preset,
        "remat": remat,
        "attention_impl": reference_attention if engine in ("reference", "shardflow-cudnn") else "ops",
    }
    if engine == "shardflow-fp8":
        cfg.model["fp8"] = True
    if preset.startswith("moe"):
        cfg.model["routing"] = "dropless"
    cfg.engine = "jit" if engine == "reference" else "shardflow"
    cfg.batch_size, cfg.data.seq_len, cfg.steps = batch, seq, warmup + steps
    cfg.strategy, cfg.compute_dtype = "dp", "bfloat16"
    with contextlib.ExitStack() as stack:
        if engine == "reference":
            stack.enter_context(unittest.mock.patch("shardflow.models.moe.dropless_experts", maxtext_style_experts))
        if engine == "shardflow-plain-loss":
            stack.enter_context(
                unittest.mock.patch("shardflow.models.pipeline.linear_cross_entropy", materialised_cross_entropy)
            )
        run, step_s, out, _ = time_steps(cfg, batch, seq, steps, warmup)
    tok_s = batch * seq / step_s
    flops = metrics.flops_per_token(run.model_cfg, run.n_params, seq)
    peak = metrics.peak_flops(jax.devices()[0], peak)
    mfu = tok_s * flops / (peak * jax.device_count()) if peak else None
    return {"tokens_per_s": tok_s, "mfu": mfu, "loss": float(out["loss"]), "params": run.n_params, "step_s": step_s}


def compiled_bytes(step_fn, *args) -> int:
    """Per device, XLA's own account of a compiled step (the allocator's peak is process-wide,
    and JAX preallocates): arguments + outputs not aliased to them + temporaries."""
    memory = step_fn.lower(*args).compile().memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def time_steps(cfg, batch: int, seq: int, steps: int, warmup: int):
    """(the set-up run, seconds per step, the last step's metrics, the compiled step's bytes per
    device) of ``cfg``'s training step on one random token batch resident on the devices, after
    ``warmup`` untimed steps."""
    import jax
    import numpy as np

    from shardflow import train

    run = train.setup(cfg)
    params, opt_state = train.init_state(run)
    step_fn = run.train_step()
    tokens = np.random.default_rng(0).integers(0, run.model_cfg.vocab_size, (1, batch, seq + 1))
    sharding = run.shardings(run.batch_spec)
    data = {
        "inputs": jax.device_put(tokens[..., :-1].astype(np.int32), sharding),
        "targets": jax.device_put(tokens[..., 1:].astype(np.int32), sharding),
    }
    seconds, (params, opt_state, out) = run_steps(step_fn, params, opt_state, data, steps, warmup)
    return run, seconds, out, compiled_bytes(step_fn, params, opt_state, data)


def run_steps(step_fn, params, opt_state, data, steps: int, warmup: int):
    """(seconds per step of ``steps`` timed steps after ``warmup`` untimed ones, the last step's
    (params, opt_state, metrics))."""
    import jax

    for _ in range(warmup):
        params, opt_state, _ = step_fn(params, opt_state, data)
    jax.block_until_ready(params)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, out = step_fn(params, opt_state, data)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps, (params, opt_state, out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--preset", action="append", choices=sorted(CASES), help="model preset (repeatable); default: 1b and 3b"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    parser.add_argument("--batch", type=int, help="override the preset's batch")
    parser.add_argument("--seq", type=int, help="override the preset's sequence length")
    parser.add_argument("--peak-flops", type=float, help="per-device peak (default: known GPUs)")
    parser.add_argument(
        "--engines",
        default="reference,shardflow",
        help="comma-separated: reference, shardflow, shardflow-cudnn, shardflow-plain-loss, shardflow-fp8",
    )
    parser.add_argument("--out", help="write all rows as JSON to this file")
    args = parser.parse_args(argv)
    configure_host_platform()
    import jax

    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    rows = []
    for preset in args.preset or ["1b", "3b"]:
        batch, seq, remat = CASES[preset]
        batch, seq = args.batch or batch, args.seq or seq
        results = {}
        for engine in args.engines.split(","):
            try:
                results[engine] = measure(preset, batch, seq, remat, engine, args.steps, args.warmup, args.peak_flops)
            except Exception as e:  # report and go on: the other engine's number still counts
                traceback.print_exc()
                results[engine] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(f"\n{preset}  batch {batch} x {seq}  remat {remat}")
        for engine, r in results.items():
            if "error" in r:
                print(f"  {engine:20s} FAILED  {r['error']}")
                continue
            mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "n/a"
            print(
                f"  {engine:20s} {r['tokens_per_s']:12,.0f} tokens/s  MFU {mfu:>7s}  "
                f"step {1e3 * r['step_s']:8.1f} ms  loss {r['loss']:.3f}  "
                f"params {r['params'] / 1e6:,.1f} M"
            )
        reference = results.get("reference", {})
        for engine, r in results.items():
            if engine != "reference" and "error" not in r and "error" not in reference and reference:
                ratio = r["tokens_per_s"] / reference["tokens_per_s"]
                print(f"  ratio {engine} / reference: {ratio:.3f}")
        fp8, bf16 = results.get("shardflow-fp8", {}), results.get("shardflow", {})
        if fp8 and bf16 and "error" not in fp8 and "error" not in bf16:
            print(f"  ratio shardflow-fp8 / shardflow: {fp8['tokens_per_s'] / bf16['tokens_per_s']:.3f}")
        rows += [
            {"preset": preset, "batch": batch, "seq": seq, "remat": remat, "engine": engine, **r}
            for engine, r in results.items()
        ]
    if args.out:
        _results.write_json(args.out, rows, steps=args.steps, warmup=args.warmup)
    return rows


if __name__ == "__main__":
    main()
