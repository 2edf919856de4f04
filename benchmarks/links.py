"""Calibrate the link model: each collective's time against the bytes a device sends, per kind and
per mesh axis, fitted to α + bytes / β (shardflow.LinkModel's form).

    NCCL_NVLS_ENABLE=0 python benchmarks/links.py [--mesh '{"data": 2, "model": 2}'] [--sizes-mb 1 4 16 64 256]

Per mesh axis, per kind — all_reduce, all_gather, reduce_scatter, all_to_all, ppermute (a ring
shift) — and per size (the bf16 block each device holds): one jit(shard_map) runs the collective
``--iters`` times in a fori_loop (launch overhead amortised), timed in ``--rounds`` rounds (median).
"Sent" is the per-device bytes shardflow.conversion prices (ring formulas: all_reduce 2(n-1)/n of
the block, all_gather (n-1)/n of its result, reduce_scatter and all_to_all (n-1)/n of the block,
ppermute the block). Per (axis, kind) the least-squares α and β of time = α + sent / β, beside
the default LinkModel's. The fit is what the planner would price; the table is what ran.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _checkout  # noqa: E402,F401
import _results  # noqa: E402

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")


def sent_bytes(kind: str, block: int, n: int) -> float:
    """Per-device bytes sent by ``kind`` over ``n`` devices, each holding ``block`` bytes."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n * block
    if kind == "all_gather":
        return (n - 1) * block  # (n-1)/n of the n-block result
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n * block
    return block  # ppermute


def collective(kind: str, axis: str, n: int):
    """The per-device body: x -> x after ``kind`` over ``axis`` (shape kept, so it loops)."""
    import jax.numpy as jnp
    from jax import lax

    if kind == "all_reduce":
        return lambda x: lax.psum(x, axis)
    if kind == "all_gather":  # gather n blocks, keep one: the loop's carry stays a block
        return lambda x: lax.all_gather(x, axis, tiled=True)[: x.shape[0]]
    if kind == "reduce_scatter":  # scatter the block, tile it back (local)
        return lambda x: jnp.tile(lax.psum_scatter(x, axis, tiled=True), (n, 1))
    if kind == "all_to_all":
        return lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True)
    return lambda x: lax.ppermute(x, axis, [(j, (j + 1) % n) for j in range(n)])


def measure(mesh, axis: str, kind: str, mb: float, iters: int, rounds: int) -> float:
    """Seconds per collective: median over rounds of one jitted loop of ``iters``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape[axis]
    cols = 1024
    rows = max(n, int(mb * 2**20 / 2 / cols) // n * n)  # bf16, divisible by n
    body = collective(kind, axis, n)
    others = tuple(a for a in mesh.axis_names if a != axis)
    spec = P((axis, *others) if others else axis)
    fn = jax.jit(
        jax.shard_map(
            lambda x: lax.fori_loop(0, iters, lambda _, v: body(v), x),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=False,
        )
    )
    x = jax.device_put(
        jnp.asarray(np.random.default_rng(0).standard_normal((rows * mesh.size, cols)), jnp.bfloat16),
        NamedSharding(mesh, spec),
    )
    jax.block_until_ready(fn(x))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def fit(points):
    """(α, β) of the least-squares line time = α + sent / β over (sent, seconds) points."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, (1 / slope if slope > 0 else float("inf"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", default=None, help='JSON axis sizes (default: {"data": all devices})')
    parser.add_argument(
        "--sizes-mb", type=float, nargs="*", default=[1, 4, 16, 64, 256], help="per-device block sizes, MB of bf16"
    )
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write every point and fit as JSON")
    args = parser.parse_args(argv)

    import jax

    from shardflow import LinkModel, make_mesh

    shape = json.loads(args.mesh) if args.mesh else {"data": jax.device_count()}
    mesh = make_mesh(shape)
    default = LinkModel()
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, mesh {shape}")
    print(f"default LinkModel: alpha {default.alpha * 1e6:.1f} us, beta {default.beta / 1e9:.0f} GB/s\n")
    print("| axis | kind | " + " | ".join(f"{mb:g} MB ms" for mb in args.sizes_mb) + " | alpha us | beta GB/s |")
    print("|---|---|" + "---|" * (len(args.sizes_mb) + 2))
    results = []
    for axis in shape:
        n = shape[axis]
        if n < 2:
            continue
        for kind in args.kinds.split(","):
            points = []
            for mb in args.sizes_mb:
                seconds = measure(mesh, axis, kind, mb, args.iters, args.rounds)
                points.append((sent_bytes(kind, int(mb * 2**20), n), seconds))
            alpha, beta = fit(points)
            results.append(
                {
                    "axis": axis,
                    "size": n,
                    "kind": kind,
                    "alpha_s": alpha,
                    "beta_Bps": beta,
                    "points": [
                        {"block_mb": mb, "sent_bytes": s, "seconds": t} for mb, (s, t) in zip(args.sizes_mb, points)
                    ],
                }
            )
            print(
                f"| {axis} ({n}) | {kind} | "
                + " | ".join(f"{t * 1e3:.3f}" for _, t in points)
                + f" | {alpha * 1e6:.1f} | {beta / 1e9:.1f} |",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": _results.run_meta(mesh=shape), "fits": results}, indent=1))


if __name__ == "__main__":
    main()
