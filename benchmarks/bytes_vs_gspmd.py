"""Collective bytes of shardflow's plan vs XLA GSPMD's, for the same model, specs and mesh.

    python benchmarks/bytes_vs_gspmd.py [--preset tiny] [--batch 16] [--seq 128]

Builds the `shardflow train` step for each strategy twice — engine "shardflow" (sf.parallelize)
and engine "jit" (jax.jit with the same NamedShardings, partitioned by GSPMD) — compiles both
and reads the collectives out of the compiled HLO with shardflow.hlo (per device, per static
occurrence: a collective inside the scan over layers counts once in both). Runs on 8 simulated
CPU devices. XLA:CPU widens bf16 all-reduces to f32, equally for both engines.
"""
from __future__ import annotations

import argparse

from shardflow.train import configure_host_platform

STRATEGIES = ("dp", "fsdp", "tp", "tp_sp", "2d")


def hlo_bytes(engine, strategy, mesh, preset, batch, seq):
    import numpy as np

    from shardflow import config, hlo, train

    cfg = config.Config()
    cfg.model = {"preset": preset}
    cfg.engine, cfg.strategy, cfg.mesh = engine, strategy, mesh
    cfg.batch_size, cfg.data.seq_len = batch, seq
    run = train.setup(cfg)
    params, opt_state = train.init_state(run)
    step = run.train_step()
    tokens = np.zeros((1, batch, seq), np.int32)
    text = step.lower(params, opt_state, {"inputs": tokens, "targets": tokens}).compile().as_text()
    return hlo.total_bytes(text), len(hlo.collectives(text))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    configure_host_platform()
    import jax

    mesh = {"data": 2, "model": 4}
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, mesh {mesh}, "
          f"preset {args.preset}, batch {args.batch} x seq {args.seq}")
    print(f"{'strategy':8} {'shardflow B':>12} {'n':>4} {'GSPMD B':>12} {'n':>4} {'ratio':>6}")
    for strategy in STRATEGIES:
        ours, n_ours = hlo_bytes("shardflow", strategy, mesh, args.preset, args.batch, args.seq)
        theirs, n_theirs = hlo_bytes("jit", strategy, mesh, args.preset, args.batch, args.seq)
        print(f"{strategy:8} {ours:>12,} {n_ours:>4} {theirs:>12,} {n_theirs:>4} {ours / theirs:>6.2f}")


if __name__ == "__main__":
    main()
