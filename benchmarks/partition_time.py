"""Partitioning cost vs depth: a scan over stacked layers is partitioned once, whatever its length.

    python benchmarks/partition_time.py            # 8 simulated CPU devices

Prints, for a Llama-style train step (scan over L layers, AdamW) under FSDP and 2-D DP x TP:
the time shardflow spends from trace to boxed program, the time of jit lowering + XLA
compilation, and the ratio of the 32-layer to the 2-layer figures.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import _results  # noqa: E402
import jax  # noqa: E402
import programs as pg  # noqa: E402

import shardflow as sf  # noqa: E402


def measure(layers, strategy, mesh):
    cfg = pg.Cfg(layers=layers)
    fn, args, in_specs, out_specs = pg.case_scan(strategy, mesh, cfg)
    f = sf.parallelize(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    t0 = time.perf_counter()
    f.program(*args)  # trace, inline, propagate, boxing, build shard_map
    t1 = time.perf_counter()
    f.lower(*args).compile()  # JAX lowering + XLA
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(f.explain(*args).collectives)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the rows as JSON to this file")
    args = parser.parse_args()
    mesh = sf.make_mesh({"data": 2, "model": 4})
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
    print(f"{'strategy':8} {'layers':>6} {'shardflow s':>11} {'xla s':>7} {'collectives':>11}")
    measure(1, "dp", mesh)  # warm JAX's own caches so the first row is not charged for them
    out = []
    for strategy in ("fsdp", "2d"):
        rows = {}
        for layers in (2, 32):
            rows[layers] = measure(layers, strategy, mesh)
            sf_s, xla_s, n = rows[layers]
            print(f"{strategy:8} {layers:>6} {sf_s:>11.2f} {xla_s:>7.2f} {n:>11}")
            out.append({"strategy": strategy, "layers": layers, "shardflow_s": sf_s, "xla_s": xla_s, "collectives": n})
        print(f"{strategy:8} {'32/2':>6} {rows[32][0] / rows[2][0]:>11.2f} {rows[32][1] / rows[2][1]:>7.2f}")
    if args.out:
        _results.write_json(args.out, out, mesh={"data": 2, "model": 4})


if __name__ == "__main__":
    main()
