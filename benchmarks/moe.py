"""Mixture-of-experts kernels and layers on one GPU, each against its dense baseline, same run.

    python benchmarks/moe.py [--tokens 16384] [--out results.json]
    python benchmarks/moe.py --tokens 256 --shapes tiny   # end-to-end check on CPU

Per expert shape (the moe-1b and moe-8x1b presets' layers, bf16):

* gemm: the experts' grouped GEMM, ``jax.lax.ragged_dot`` of the T*k routed rows [embed] by the
  experts' [embed, ffn] weights, forward and forward+backward (both gradients), rows spread
  evenly over the experts, against one dense GEMM [T*k, embed] x [embed, ffn] of the same
  flops: TFLOP/s of each and their ratio.
* layer: the dropless MoE layer (router, top-k, ``shardflow.experts.routed_experts``, gated
  combine) forward+backward against a dense SwiGLU layer of the same active flops (hidden dim
  k * expert ffn): milliseconds of each and their ratio.

Each timing is the median of --repeats runs of --iters calls after two untimed calls
(compilation), on random inputs resident on the device.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _checkout  # noqa: F401
import _results

SHAPES = {  # name -> (embed, experts, k, expert ffn)
    "moe-1b": (2048, 16, 4, 1408),
    "moe-8x1b": (2048, 8, 2, 5632),
    "tiny": (64, 8, 2, 32),
}


def timed(fn, *args, iters: int, repeats: int) -> float:
    """Median seconds per call of ``fn(*args)``."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - start) / iters)
    return statistics.median(runs)


def gemm_rows(name, tokens, iters, repeats):
    import jax
    import jax.numpy as jnp

    d, n_experts, k, f = SHAPES[name]
    rows = tokens * k
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
    experts_w = jax.random.normal(keys[1], (n_experts, d, f), jnp.bfloat16) * d**-0.5
    dense_w = jax.random.normal(keys[2], (d, f), jnp.bfloat16) * d**-0.5
    sizes = jnp.full((n_experts,), rows // n_experts, jnp.int32).at[-1].add(rows % n_experts)

    def grouped(lhs, w):
        return jax.lax.ragged_dot(lhs, w, sizes)

    def dense(lhs, w):
        return lhs @ w

    def both_grads(fn):
        return jax.jit(jax.grad(lambda lhs, w: jnp.sum(fn(lhs, w).astype(jnp.float32) ** 2), (0, 1)))

    flops = 2.0 * rows * d * f
    out = []
    for mode, wrap, passes in (("fwd", jax.jit, 1), ("fwd+bwd", both_grads, 3)):
        t_grouped = timed(wrap(grouped), lhs, experts_w, iters=iters, repeats=repeats)
        t_dense = timed(wrap(dense), lhs, dense_w, iters=iters, repeats=repeats)
        out.append(
            {
                "bench": "gemm",
                "shape": name,
                "mode": mode,
                "rows": rows,
                "grouped_tflops": passes * flops / t_grouped / 1e12,
                "dense_tflops": passes * flops / t_dense / 1e12,
                "ratio": t_dense / t_grouped,
            }
        )
    return out


def layer_row(name, tokens, iters, repeats):
    import jax
    import jax.numpy as jnp

    from shardflow.models import moe

    d, n_experts, k, f = SHAPES[name]
    keys = jax.random.split(jax.random.key(1), 8)
    x = jax.random.normal(keys[0], (tokens // 1024 or 1, min(tokens, 1024), d), jnp.bfloat16)

    def weights(key, *shape):
        return jax.random.normal(key, shape, jnp.bfloat16) * shape[-2] ** -0.5

    router = weights(keys[1], d, n_experts).astype(jnp.float32)
    experts_w = tuple(weights(key, n_experts, *shape) for key, shape in zip(keys[2:5], ((d, f), (d, f), (f, d))))
    dense_w = (weights(keys[5], d, k * f), weights(keys[6], d, k * f), weights(keys[7], k * f, d))

    def moe_layer(x, router, w):
        gates, experts, _ = moe.route(jnp.einsum("bsd,de->bse", x.astype(jnp.float32), router), k)
        return moe.dropless_experts(x, gates, experts, *w)

    def dense_layer(x, w):
        return (jax.nn.silu(x @ w[0]) * (x @ w[1])) @ w[2]

    def fwd_bwd(layer, argnums):
        return jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32) ** 2), argnums))

    t_moe = timed(fwd_bwd(moe_layer, (0, 1, 2)), x, router, experts_w, iters=iters, repeats=repeats)
    t_dense = timed(fwd_bwd(dense_layer, (0, 1)), x, dense_w, iters=iters, repeats=repeats)
    return {
        "bench": "layer",
        "shape": name,
        "mode": "fwd+bwd",
        "tokens": x.shape[0] * x.shape[1],
        "moe_ms": 1e3 * t_moe,
        "dense_ms": 1e3 * t_dense,
        "ratio": t_moe / t_dense,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="moe-1b,moe-8x1b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    import jax

    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    rows = []
    for name in args.shapes.split(","):
        rows += gemm_rows(name, args.tokens, args.iters, args.repeats)
        rows.append(layer_row(name, args.tokens, args.iters, args.repeats))
    print(f"\n{'bench':6s} {'shape':9s} {'mode':8s} {'grouped/moe':>12s} {'dense':>10s} {'ratio':>6s}")
    for r in rows:
        if r["bench"] == "gemm":
            print(
                f"gemm   {r['shape']:9s} {r['mode']:8s} {r['grouped_tflops']:8.1f} TF/s {r['dense_tflops']:6.1f} TF/s"
                f" {r['ratio']:6.3f}"
            )
        else:
            times = f"{r['moe_ms']:9.3f} ms {r['dense_ms']:7.3f} ms"
            print(f"layer  {r['shape']:9s} {r['mode']:8s} {times} {r['ratio']:6.3f}")
    if args.out:
        _results.write_json(args.out, rows, tokens=args.tokens, iters=args.iters, repeats=args.repeats)
    return rows


if __name__ == "__main__":
    main()
