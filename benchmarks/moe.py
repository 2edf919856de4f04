"""Mixture-of-experts kernels and layers on one GPU, each against its dense baseline, same run.

    python benchmarks/moe.py [--check] [--tokens 16384] [--variants simple,ws] [--out results.json]
    python benchmarks/moe.py --tokens 256 --shapes tiny   # end-to-end check on CPU

Per expert shape (the moe-1b and moe-8x1b presets' layers, bf16):

* gemm: the experts' grouped GEMM of the T*k routed rows [embed] by the experts' [embed, ffn]
  weights, forward and forward+backward (both gradients), rows spread evenly over the
  experts, by ``jax.lax.ragged_dot`` and by our kernels (``kernels/grouped_matmul_mgpu.py``,
  on Hopper), against one dense GEMM [T*k, embed] x [embed, ffn] of the same flops: TFLOP/s of
  each, and the faster grouped one's over the dense one's.
* ep (with several devices): the layer with expert parallelism over all of them, by shardflow
  and by ``jax.jit`` on the same shardings, against a dense layer of the same active flops on
  one device's share of the tokens: milliseconds, ours over the dense one's, jit's over ours.
* check (``--check``): our kernels against ``jax.lax.ragged_dot`` in float32, forward and both
  gradients, on even and skewed groups (one empty): relative error.
* ``--variants``: our kernels' variants (tilings, weight-gradient blocks) each checked and timed
  in the gemm and layer rows.
* layer: the dropless MoE layer (router, top-k, ``shardflow.experts.routed_experts``, gated
  combine) forward+backward against a dense SwiGLU layer of the same active flops (hidden dim
  k * expert ffn): milliseconds of each and their ratio; twice, the backward recomputing the
  experts' gate and up projections and taking them from the forward (``keep_activations``).

* ``--profile`` (GPU): instead of the rows, the layer's kernels (activations kept) and the dense
  layer's, each kernel's device milliseconds per call from a profiler trace, longest first.

Each timing is the median of --repeats runs of --iters calls after two untimed calls
(compilation), on random inputs resident on the device.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import _checkout  # noqa: F401
import _results


@contextlib.contextmanager
def variant(name):
    """Our kernels run as variant ``name`` inside the block."""
    from shardflow.kernels import grouped_matmul_mgpu as mgpu

    saved = mgpu.PREFERRED, mgpu.WEIGHT_GRAD_BLOCK_K
    mgpu.PREFERRED, mgpu.WEIGHT_GRAD_BLOCK_K = mgpu.VARIANTS[name]
    try:
        yield
    finally:
        mgpu.PREFERRED, mgpu.WEIGHT_GRAD_BLOCK_K = saved


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


def _grouped_inputs(name, tokens, sizes_of, seed=0):
    """Random bf16 rows and expert weights of shape ``name``, the rows in ``sizes_of(rows,
    experts)`` groups, and the dense weight of the same flops per row."""
    import jax
    import jax.numpy as jnp

    d, n_experts, k, f = SHAPES[name]
    rows = tokens * k
    keys = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
    experts_w = jax.random.normal(keys[1], (n_experts, d, f), jnp.bfloat16) * d**-0.5
    dense_w = jax.random.normal(keys[2], (d, f), jnp.bfloat16) * d**-0.5
    return lhs, experts_w, dense_w, jnp.asarray(sizes_of(rows, n_experts), jnp.int32)


def _even(rows, n_experts):
    import numpy as np

    sizes = np.full(n_experts, rows // n_experts)
    sizes[-1] += rows % n_experts
    return sizes


def _skewed(rows, n_experts):
    """One expert empty, one with a quarter of the rows, the rest shared unevenly."""
    import numpy as np

    weights = np.random.default_rng(0).random(n_experts) + 0.1
    weights[0], weights[1] = 0.0, weights.sum() / 3
    sizes = np.floor(rows * weights / weights.sum()).astype(int)
    sizes[-1] += rows - sizes.sum()
    return sizes


def _kernel_matmul(sizes, rows):
    """(grouped GEMM by our kernel on rows sorted by group, the rows' tile-aligned layout)."""
    from shardflow.kernels import grouped_matmul_mgpu as mgpu

    layout = mgpu.tile_layout(sizes, rows)

    def matmul(lhs, w):
        return mgpu.gmm(lhs, w, layout.tile_groups, layout.group_tiles)

    return matmul, layout


def _tiled(lhs, layout):
    """``lhs`` (rows sorted by group) in ``layout``, and each row's place there."""
    import jax.numpy as jnp

    return jnp.zeros((layout.rows, lhs.shape[1]), lhs.dtype).at[layout.placed].set(lhs), layout.placed


def check_kernels(name, tokens) -> list:
    """Our grouped GEMM kernels against ``jax.lax.ragged_dot`` in float32 on the same bf16
    inputs, forward and both gradients, even and skewed groups: ||ours - ref|| / ||ref||."""
    import jax
    import jax.numpy as jnp

    out = []
    for sizes_of in (_even, _skewed):
        lhs, w, _, sizes = _grouped_inputs(name, tokens, sizes_of, seed=7)
        matmul, layout = _kernel_matmul(sizes, lhs.shape[0])
        tiled, dest = _tiled(lhs, layout)
        probe = jax.random.normal(jax.random.key(3), (lhs.shape[0], w.shape[2]), jnp.float32)

        def ours(lhs_tiled, w):
            return (matmul(lhs_tiled, w)[dest].astype(jnp.float32) * probe).sum()

        def ref(lhs, w):
            return (jax.lax.ragged_dot(lhs, w, sizes, preferred_element_type=jnp.float32) * probe).sum()

        got = jax.jit(jax.value_and_grad(ours, (0, 1)))(tiled, w)
        want = jax.jit(jax.value_and_grad(ref, (0, 1)))(lhs.astype(jnp.float32), w.astype(jnp.float32))
        got_out = jax.jit(matmul)(tiled, w)[dest].astype(jnp.float32)
        want_out = jax.lax.ragged_dot(lhs.astype(jnp.float32), w.astype(jnp.float32), sizes)

        def error(a, b):
            return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

        errors = {
            "fwd": error(got_out, want_out),
            "d_lhs": error(got[1][0][dest].astype(jnp.float32), want[1][0]),
            "d_rhs": error(got[1][1].astype(jnp.float32), want[1][1]),
        }
        out.append({"bench": "check", "shape": name, "groups": sizes_of.__name__.strip("_"), **errors})
    return out


def gemm_rows(name, tokens, iters, repeats, kernel: bool, variants=()):
    import jax
    import jax.numpy as jnp

    lhs, experts_w, dense_w, sizes = _grouped_inputs(name, tokens, _even)
    d, n_experts, k, f = SHAPES[name]
    rows = lhs.shape[0]

    def grouped(lhs, w):
        return jax.lax.ragged_dot(lhs, w, sizes)

    def dense(lhs, w):
        return lhs @ w

    def both_grads(fn):
        return jax.jit(jax.grad(lambda lhs, w: jnp.sum(fn(lhs, w).astype(jnp.float32) ** 2), (0, 1)))

    flops = 2.0 * rows * d * f
    out = []
    for mode, wrap, passes in (("fwd", jax.jit, 1), ("fwd+bwd", both_grads, 3)):
        t_dense = timed(wrap(dense), lhs, dense_w, iters=iters, repeats=repeats)
        t_grouped = timed(wrap(grouped), lhs, experts_w, iters=iters, repeats=repeats)
        row = {
            "bench": "gemm",
            "shape": name,
            "mode": mode,
            "rows": rows,
            "dense_tflops": passes * flops / t_dense / 1e12,
            "ragged_dot_tflops": passes * flops / t_grouped / 1e12,
        }
        for v in variants if kernel else ():
            matmul, layout = _kernel_matmul(sizes, rows)
            tiled, _ = _tiled(lhs, layout)
            with variant(v):
                try:
                    t_kernel = timed(wrap(matmul), tiled, experts_w, iters=iters, repeats=repeats)
                except Exception as e:  # a variant that does not build is reported, not fatal
                    row[f"kernel_error[{v}]"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    continue
            row[f"kernel_tflops[{v}]"] = passes * flops / t_kernel / 1e12
            print(
                f"gemm {name} {mode} {v}: {row[f'kernel_tflops[{v}]']:.1f} TF/s, dense {row['dense_tflops']:.1f}",
                flush=True,
            )
        kernels = [v for key, v in row.items() if key.startswith("kernel_tflops")]
        if kernels:
            row["kernel_tflops"] = max(kernels)
        out.append(row)
    return out


def _layers(name, rows: int, seq: int, seed: int, keep_activations: bool = False):
    """bf16 tokens [rows, seq, embed] and the weights of shape ``name``'s MoE layer and of its
    dense equivalent (hidden k x ffn), with the two layers' gradient functions:
    ``moe_grads(x, router, experts_w)`` and ``dense_grads(x, dense_w)``. ``keep_activations``:
    the MoE layer's backward takes its forward's gate and up projections (the trainer's choice
    where no mesh axis splits the experts) rather than recomputing them."""
    import jax
    import jax.numpy as jnp

    from shardflow.experts import routed_experts
    from shardflow.models import moe

    d, n_experts, k, f = SHAPES[name]
    keys = jax.random.split(jax.random.key(seed), 8)

    def weights(key, *shape):
        return jax.random.normal(key, shape, jnp.bfloat16) * shape[-2] ** -0.5

    x = jax.random.normal(keys[0], (rows, seq, d), jnp.bfloat16)
    router = weights(keys[1], d, n_experts).astype(jnp.float32)
    experts_w = tuple(weights(key, n_experts, *shape) for key, shape in zip(keys[2:5], ((d, f), (d, f), (f, d))))
    dense_w = (weights(keys[5], d, k * f), weights(keys[6], d, k * f), weights(keys[7], k * f, d))

    def moe_loss(x, router, w):
        gates, experts, _ = moe.route(jnp.einsum("bsd,de->bse", x.astype(jnp.float32), router), k)
        h = routed_experts(x, experts, *w, keep_activations=keep_activations)
        return jnp.sum(jnp.einsum("...k,...kd->...d", gates.astype(x.dtype), h).astype(jnp.float32) ** 2)

    def dense_loss(x, w):
        return jnp.sum(((jax.nn.silu(x @ w[0]) * (x @ w[1])) @ w[2]).astype(jnp.float32) ** 2)

    moe_grads, dense_grads = jax.grad(moe_loss, (0, 1, 2)), jax.grad(dense_loss, (0, 1))
    return (x, router, experts_w, dense_w), moe_grads, dense_grads


def layer_rows(name, tokens, iters, repeats, variant_name=None):
    """The layer's rows, its backward recomputing the forward's activations and taking them."""
    import jax

    seq = min(tokens, 1024)
    out = []
    for keep in (False, True):
        (x, router, experts_w, dense_w), moe_grads, dense_grads = _layers(name, max(1, tokens // seq), seq, 1, keep)
        with variant(variant_name) if variant_name else contextlib.nullcontext():
            t_moe = timed(jax.jit(moe_grads), x, router, experts_w, iters=iters, repeats=repeats)
        t_dense = timed(jax.jit(dense_grads), x, dense_w, iters=iters, repeats=repeats)
        activations = "kept" if keep else "recomputed"
        print(f"layer {name} {variant_name} {activations}: {1e3 * t_moe:.2f} ms, dense {1e3 * t_dense:.2f} ms")
        out.append(
            {
                "bench": "layer",
                "shape": name,
                "mode": "fwd+bwd",
                "variant": variant_name or "-",
                "activations": activations,
                "tokens": x.shape[0] * x.shape[1],
                "moe_ms": 1e3 * t_moe,
                "dense_ms": 1e3 * t_dense,
                "ratio": t_moe / t_dense,
            }
        )
    return out


def profile_rows(name, tokens, iters, variant_name=None, top=25):
    """Device ms per call of each kernel of the layer (activations kept) and of its dense
    equivalent, from a profiler trace of ``iters`` calls."""
    import jax
    from attention_timing import kernel_times

    seq = min(tokens, 1024)
    (x, router, experts_w, dense_w), moe_grads, dense_grads = _layers(name, max(1, tokens // seq), seq, 1, True)
    out = []
    with variant(variant_name) if variant_name else contextlib.nullcontext():
        for layer, fn, args in (
            ("moe", jax.jit(moe_grads), (x, router, experts_w)),
            ("dense", jax.jit(dense_grads), (x, dense_w)),
        ):
            jax.block_until_ready(fn(*args))
            kernels = kernel_times(fn, args, iters=iters)
            total = sum(ms for _, ms in kernels)
            print(
                f"\nprofile {name} {layer} {variant_name or '-'}: {total:.3f} device ms a call, {len(kernels)} kernels"
            )
            for kernel, ms in kernels[:top]:
                print(f"  {ms:7.3f} ms  {100 * ms / total:5.1f} %  {kernel[:110]}")
            out.append(
                {
                    "bench": "profile",
                    "shape": name,
                    "layer": layer,
                    "variant": variant_name or "-",
                    "device_ms": total,
                    "kernels": kernels,
                }
            )
    return out


def ep_row(name, tokens, iters, repeats):
    """Expert parallelism over every device (mesh {expert: n}): the dropless layer's
    forward+backward with the tokens and the experts split over the axis, by shardflow and by
    ``jax.jit`` on the same shardings (XLA's partitioner), against a dense layer of the same
    active flops on one device's tokens alone (the EP=1 dense equivalent)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardflow as sf

    n = jax.device_count()
    seq = min(tokens, 1024)
    (x, router, experts_w, dense_w), moe_grads, dense_grads = _layers(name, n * max(1, tokens // seq), seq, seed=2)

    mesh = sf.make_mesh({"expert": n})
    specs = (P("expert"), P(), (P("expert"),) * 3)
    shardflow_step = sf.parallelize(moe_grads, mesh=mesh, in_specs=specs, out_specs=specs)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda v: isinstance(v, P))
    jit_step = jax.jit(moe_grads, in_shardings=shardings, out_shardings=shardings)
    args = jax.device_put((x, router, experts_w), shardings)
    t_shardflow = timed(shardflow_step, *args, iters=iters, repeats=repeats)
    t_jit = timed(jit_step, *args, iters=iters, repeats=repeats)
    one = jax.devices()[0]
    local = jax.device_put((x[: x.shape[0] // n], dense_w), one)
    t_dense = timed(jax.jit(dense_grads), *local, iters=iters, repeats=repeats)
    plan = shardflow_step.explain(*args)
    routed = sum(c.bytes * c.count for c in plan.collectives if c.kind == "all_to_all")
    return {
        "bench": "ep",
        "shape": name,
        "mode": "fwd+bwd",
        "devices": n,
        "tokens_per_device": int(np.prod(x.shape[:2])) // n,
        "shardflow_ms": 1e3 * t_shardflow,
        "jit_ms": 1e3 * t_jit,
        "dense_one_device_ms": 1e3 * t_dense,
        "ratio": t_shardflow / t_dense,
        "vs_jit": t_jit / t_shardflow,
        "all_to_all_bytes": routed,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="moe-1b,moe-8x1b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="our kernels against ragged_dot first (GPU)")
    parser.add_argument("--no-kernel", action="store_true", help="leave our grouped GEMM kernels out")
    parser.add_argument(
        "--variants",
        default="simple",
        help="our kernels' variants to time, comma-separated (kernels/grouped_matmul_mgpu.py VARIANTS)",
    )
    parser.add_argument("--profile", action="store_true", help="per-kernel device time of the layers (GPU)")
    parser.add_argument("--out", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    import jax

    if args.profile:
        rows = [
            r
            for name in args.shapes.split(",")
            for v in args.variants.split(",")
            for r in profile_rows(name, args.tokens, args.iters, v if jax.default_backend() == "gpu" else None)
        ]
        if args.out:
            _results.write_json(args.out, rows, tokens=args.tokens, iters=args.iters)
        return rows

    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    kernel = not args.no_kernel and jax.default_backend() == "gpu"
    rows = []
    variants = args.variants.split(",")
    for name in args.shapes.split(","):
        for variant_name in variants if args.check and kernel else ():
            with variant(variant_name):
                try:
                    rows += [{**r, "variant": variant_name} for r in check_kernels(name, args.tokens)]
                except Exception as e:  # a variant that does not build is reported, not fatal
                    print(f"check {name} {variant_name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        rows += gemm_rows(name, args.tokens, args.iters, args.repeats, kernel, variants)
        for variant_name in variants if kernel else [None]:
            try:
                rows += layer_rows(name, args.tokens, args.iters, args.repeats, variant_name)
            except Exception as e:  # a variant that does not build is reported, not fatal
                print(f"layer {name} {variant_name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        if jax.device_count() > 1:
            rows.append(ep_row(name, args.tokens, args.iters, args.repeats))
    print(f"\n{'bench':6s} {'shape':9s} {'mode':8s} {'dense':>10s} {'ragged_dot':>11s} {'kernel':>11s}  ratio")
    for r in rows:
        if r["bench"] == "check":
            errors = f"fwd {r['fwd']:.1e}  d_lhs {r['d_lhs']:.1e}  d_rhs {r['d_rhs']:.1e}"
            print(f"check  {r['shape']:9s} {r['groups']:8s} {errors}  {r['variant']}")
        elif r["bench"] == "gemm":
            best = max(r["ragged_dot_tflops"], r.get("kernel_tflops", 0.0))
            kernel_tflops = f"{r['kernel_tflops']:6.1f} TF/s" if "kernel_tflops" in r else "          -"
            rates = f"{r['dense_tflops']:5.1f} TF/s {r['ragged_dot_tflops']:6.1f} TF/s {kernel_tflops}"
            print(f"gemm   {r['shape']:9s} {r['mode']:8s} {rates}  {best / r['dense_tflops']:.3f}")
            for key, value in r.items():
                if key.startswith("kernel_tflops["):
                    print(f"         {key[14:-1]:16s} {value:6.1f} TF/s  {value / r['dense_tflops']:.3f}")
                elif key.startswith("kernel_error["):
                    print(f"         {key[13:-1]:16s} {value}")
        elif r["bench"] == "ep":
            times = f"{r['dense_one_device_ms']:7.3f} ms {r['shardflow_ms']:8.3f} ms  jit {r['jit_ms']:.3f} ms"
            ratios = f"{r['ratio']:.3f} (jit/ours {r['vs_jit']:.3f})"
            print(f"ep={r['devices']:<3d} {r['shape']:9s} {r['mode']:8s} {times}  {ratios}")
        else:
            times = f"{r['dense_ms']:7.3f} ms {r['moe_ms']:8.3f} ms {r['variant']:>11s} {r['activations']}"
            print(f"layer  {r['shape']:9s} {r['mode']:8s} {times}  {r['ratio']:.3f}")
    if args.out:
        _results.write_json(args.out, rows, tokens=args.tokens, iters=args.iters, repeats=args.repeats)
    return rows


if __name__ == "__main__":
    main()
