"""What the link model predicts for pipelining across hosts, from a one-host measurement.

    python benchmarks/pipeline.py --preset 7b --schedules 1f1b-fused --out pp7b.json    # on GPUs
    python benchmarks/pipeline_hosts.py pp7b.json --hosts 2 --gpus-per-host 4          # anywhere

Pipelining is meant to pay where data parallelism's collectives cross hosts. This takes a
benchmarks/pipeline.py result measured on one host (FSDP and a pipelined configuration of
``--hosts`` stages, at some tokens per GPU) and predicts both on ``--hosts`` hosts of
``--gpus-per-host`` GPUs, FSDP over all of them and the pipeline with one stage per host and
its data axis inside a host. The bytes are shardflow's own plans of the two train steps
(``explain`` on simulated devices, the same shapes); the time per byte is a bandwidth per GPU:
``--nic-gbps`` across hosts (a 400 Gb/s NIC per GPU: 50 GB/s), ``--nvlink-gbs`` inside one.

- FSDP: each GPU's gathers and reduce-scatters cross hosts (a ring over every GPU). They
  overlap the layers' matmuls, as on one host, so the step lasts as long as the longer of
  the measured step and the collectives at NIC speed.
- Pipeline: the collectives on the pipe axis (hand-offs between stages, the head's sums) cross
  hosts and, in lockstep, overlap nothing: their time is added to the measured step; so is the
  data axis' (inside a host: the stage's gradients, after the last step) where the measured
  configuration had none.

At fewer tokens per GPU (``--tokens-per-gpu``) both measured steps are scaled down with the
tokens and the activations' collectives with them, the weights' collectives not; where a
micro-batch would be under one sequence the pipeline runs fewer, one sequence each, and its
step grows with the lockstep bubble, (m + p - 1) / m. That assumes the same MFU at smaller
micro-batches, which flatters the pipeline. A model, not a measurement: nothing here ran across
hosts.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import _checkout  # noqa: F401
import pipeline as pipeline_script
import scaling


def collective_bytes(preset, mesh, strategy, pipeline, batch, seq, remat) -> dict:
    """Per GPU and step, bytes sent by the train step's plan on ``mesh``, by mesh axis."""
    import jax
    import numpy as np

    from shardflow import train

    run = train.setup(pipeline_script.train_config(preset, mesh, strategy, pipeline, batch, seq, remat))
    state = jax.eval_shape(lambda: train.init_state(run))
    tokens = jax.ShapeDtypeStruct((1, batch, seq), np.int32)
    plan = run.train_step().explain(*state, {"inputs": tokens, "targets": tokens})
    by_axis: dict = {}
    for c in plan.collectives:
        for axis in c.axes:  # a collective over several axes is charged to each (none here)
            by_axis[axis] = by_axis.get(axis, 0) + c.bytes * c.count
    return by_axis


def predict(
    measured: dict,
    fsdp_bytes: float,
    pipe_bytes: float,
    inhost_bytes: float,
    *,
    tokens_per_gpu: float,
    nic: float,
    nvlink: float,
    had_data_axis: bool,
) -> dict:
    """Step seconds of FSDP and of the pipeline across hosts at ``tokens_per_gpu``; bytes as
    measured at ``measured['tokens_per_gpu']`` (the weights' FSDP bytes do not scale)."""
    scale = tokens_per_gpu / measured["tokens_per_gpu"]
    p, m = measured["stages"], measured["microbatches"]
    fewer = max(1, min(m, math.floor(tokens_per_gpu * p / measured["seq"])))  # one sequence each at least
    lockstep = ((fewer + p - 1) / fewer) / ((m + p - 1) / m)
    t_fsdp = max(measured["fsdp_step_s"] * scale, fsdp_bytes / nic)
    t_pp = measured["pp_step_s"] * scale * lockstep + pipe_bytes * scale * (1 / nic - 1 / nvlink)
    if not had_data_axis:
        t_pp += inhost_bytes / nvlink
    return {
        "tokens_per_gpu": tokens_per_gpu,
        "microbatches": fewer,
        "fsdp_s": t_fsdp,
        "pp_s": t_pp,
        "pp_x_fsdp": t_fsdp / t_pp,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="benchmarks/pipeline.py --out JSON measured on one host")
    parser.add_argument("--config", help="the pipelined row (default: the fastest with --hosts stages)")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--gpus-per-host", type=int, default=4)
    parser.add_argument("--nic-gbps", default="400,200", help="per GPU, across hosts, comma-separated")
    parser.add_argument(
        "--nvlink-gbs",
        type=float,
        default=200.0,
        help="per GPU inside a host (benchmarks/links.py measures it per kind)",
    )
    parser.add_argument("--tokens-per-gpu", default="", help="comma-separated; the measured one always")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # explain only: simulated devices, any machine
    scaling.configure_host_platform(args.hosts * args.gpus_per_host)

    rows = json.load(open(args.results))["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    fsdp = next(r for r in ok if r["config"] == "fsdp")
    pps = [
        r
        for r in ok
        if r["pipeline"]
        and r["pipeline"]["stages"] == args.hosts
        and (args.config is None or r["config"] == args.config)
    ]
    if not pps:
        raise SystemExit(f"{args.results}: no measured pipelined row with {args.hosts} stages")
    pp = max(pps, key=lambda r: r["tokens_per_s"])
    preset, seq, remat = fsdp["preset"], fsdp["seq"], fsdp["remat"]
    per_gpu = lambda r: r["global_batch"] * seq / r["devices"]
    measured = {
        "tokens_per_gpu": per_gpu(fsdp),
        "fsdp_step_s": fsdp["step_s"],
        "pp_step_s": pp["step_s"],
        "seq": seq,
        "stages": pp["pipeline"]["stages"],
        "microbatches": pp["pipeline"]["microbatches"],
    }
    if not math.isclose(per_gpu(pp), per_gpu(fsdp)):
        raise SystemExit("the FSDP and pipelined rows ran different tokens per GPU")

    n = args.hosts * args.gpus_per_host
    batch = round(measured["tokens_per_gpu"] * n / seq)
    fsdp_bytes = collective_bytes(preset, {"data": n}, "fsdp", None, batch, seq, remat).get("data", 0)
    pipeline = dict(pp["pipeline"])
    strategy = "fsdp" if pp.get("strategy") == "fsdp" else "pp_dp"  # the data axis inside a host
    pp_by_axis = collective_bytes(
        preset, {"pipe": args.hosts, "data": args.gpus_per_host}, strategy, pipeline, batch, seq, remat
    )
    print(
        f"{preset}, measured on one host: {pp['config']} at {pp['tokens_per_s'] / fsdp['tokens_per_s']:.3f}x "
        f"FSDP, {measured['tokens_per_gpu']:,.0f} tokens per GPU a step ({pp['devices']} GPUs)"
    )
    print(
        f"predicted on {args.hosts} hosts x {args.gpus_per_host} GPUs: FSDP over {n} sends "
        f"{fsdp_bytes / 1e9:.2f} GB per GPU a step; pipe {args.hosts} x data {args.gpus_per_host} sends "
        f"{pp_by_axis.get('pipe', 0) / 1e9:.3f} GB across hosts, {pp_by_axis.get('data', 0) / 1e9:.2f} GB inside"
    )
    tokens = sorted(
        {measured["tokens_per_gpu"], *(float(t) for t in args.tokens_per_gpu.split(",") if t)}, reverse=True
    )
    out, lines = [], [("NIC", "tokens / GPU", "micro-batches", "FSDP step s", "pipeline step s", "pipeline x FSDP")]
    for gbps in (float(g) for g in args.nic_gbps.split(",")):
        for t in tokens:
            row = predict(
                measured,
                fsdp_bytes,
                pp_by_axis.get("pipe", 0),
                pp_by_axis.get("data", 0),
                tokens_per_gpu=t,
                nic=gbps / 8 * 1e9,
                nvlink=args.nvlink_gbs * 1e9,
                had_data_axis="data" in pp["mesh"],
            )
            out.append({"nic_gbps": gbps, **row})
            lines.append(
                (
                    f"{gbps:g} Gb/s",
                    f"{t:,.0f}",
                    str(row["microbatches"]),
                    f"{row['fsdp_s']:.3f}",
                    f"{row['pp_s']:.3f}",
                    f"{row['pp_x_fsdp']:.2f}",
                )
            )
    scaling.print_columns(lines, left=2)
    return out


if __name__ == "__main__":
    main()
