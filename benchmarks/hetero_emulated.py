"""Emulated heterogeneity: chosen data replicas made slower by a calibrated, predicated extra
load, and the heterogeneous planner's gain over an even split, predicted and measured in one run.

    python benchmarks/hetero_emulated.py                  # every GPU; the second half slow
    python benchmarks/hetero_emulated.py --preset tiny --seq 128 --batch 16 --kind H100 --steps 1
                                                          # the path on 8 simulated CPU devices

The step is `shardflow train`'s data-parallel step with uneven micro-batch counts per replica
(``replica_microbatches``, shardflow/train/uneven.py): every replica runs the busiest one's
number of micro-batch slots, a slot of padding skipped by predication. A slow replica also runs,
beside each of its real slots, the slot's forward and backward once more on the first
``--extra`` of each sequence: ``sf.predicated`` on the slot's weights times the slow replicas'
rows, so the other replicas, and a slow replica's padding slots, skip it. Its loss enters the
step times zero: the step computes what it computes without the load (tested).

1. Calibrate: a one-device step with and without the load: the measured slowdown ``s``.
2. Plan: the devices as two kinds of one host, their own (``--kind``, default the catalogue's
   name for them) and the same at 1/s of its matmul rate and memory bandwidth
   (``hetero.search`` with the trainer's fitted constants, cluster_plan.FRAMEWORK), among the
   data-parallel plans of the global batch on every device (one stage each, no tensor
   parallelism: the plans the emulation loads faithfully), and the even split of the same
   micro-batches. Predicted gain: the even plan's simulated step time over the planner's.
3. Measure both plans' steps, the slow replicas loaded: the measured gain, and its ratio to the
   predicted one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import unittest.mock

import _checkout  # noqa: F401
import _results
import train_mfu

from shardflow.train import configure_host_platform

CASES = {"1b": (32, 2048, "none"), "125m": (64, 1024, "none"), "tiny": (16, 128, "none")}  # batch, seq, remat


@contextlib.contextmanager
def loaded(slow_rows, extra: float):
    """Within it, ``sf.predicated`` as the uneven step calls it also runs ``fn`` on the first
    ``extra`` of each sequence of the rows ``slow_rows`` (bool [rows] of the step's batch)
    marks, where the slot's weights are nonzero, its result added times zero."""
    import jax.numpy as jnp

    import shardflow as sf

    predicated = sf.predicated

    def with_load(fn, weights, params, inputs, targets):
        out = predicated(fn, weights, params, inputs, targets)
        tokens = max(1, round(inputs.shape[-1] * extra))
        burn = predicated(
            fn, weights * jnp.asarray(slow_rows, weights.dtype), params, *(a[..., :tokens] for a in (inputs, targets))
        )
        return out + 0.0 * burn

    with unittest.mock.patch.object(sf, "predicated", with_load):
        yield


def slow_rows(replicas: int, rows_per_replica: int, slow: set) -> list[bool]:
    """A replica's rows are a consecutive block of the step's batch (uneven.slots)."""
    return [r in slow for r in range(replicas) for _ in range(rows_per_replica)]


def setup(preset, seq, remat, devices, counts, micro_batch):
    import jax

    from shardflow import train
    from shardflow.train import config

    cfg = config.Config()
    cfg.model = {"preset": preset, "remat": remat}
    cfg.mesh, cfg.strategy, cfg.compute_dtype = {"data": len(devices)}, "dp", "bfloat16"
    cfg.batch_size, cfg.data.seq_len, cfg.replica_microbatches = micro_batch * sum(counts), seq, list(counts)
    if jax.default_backend() != "gpu":
        cfg.compute_dtype = "float32"
    with (
        unittest.mock.patch.object(jax, "devices", lambda *_: list(devices)),
        unittest.mock.patch.object(jax, "device_count", lambda *_: len(devices)),
    ):
        return train.setup(cfg)


def batch_of(run, seed=0):
    """The step's batch, random tokens, in the replicas' slots (uneven.slots)."""
    import jax
    import numpy as np

    from shardflow.train import uneven

    counts, rows = run.cfg.replica_microbatches, run.cfg.batch_size // sum(run.cfg.replica_microbatches)
    index, weights = uneven.slots(counts, rows, run.replica_slots)
    tokens = np.random.default_rng(seed).integers(
        0, run.model_cfg.vocab_size, (run.cfg.batch_size, run.cfg.data.seq_len + 1)
    )
    arrays = {"inputs": tokens[index, :-1], "targets": tokens[index, 1:], "weights": weights}
    arrays = {k: a.astype(np.int32) if k != "weights" else a for k, a in arrays.items()}
    shardings = run.shardings(run.step_batch_specs())
    return {k: jax.device_put(a, shardings[k]) for k, a in arrays.items()}


def timed_step(run, slow: set, extra: float, steps: int, warmup: int):
    """(seconds per step, the last step's loss, its gradient norm) of ``run``'s train step with
    the replicas ``slow`` loaded."""

    from shardflow import train

    counts = run.cfg.replica_microbatches
    rows = run.cfg.batch_size // sum(counts)
    with loaded(slow_rows(len(counts), rows, slow), extra):
        seconds, (_, _, out) = train_mfu.run_steps(
            run.train_step(), *train.init_state(run), batch_of(run), steps, warmup
        )
    return seconds, float(out["loss"]), float(out["grad_norm"])


def plans(run_cfg, kind, slowdown, replicas, slow, global_batch, micro_batch):
    """(the planner's data-parallel plan on the emulated cluster, the even split of as many
    micro-batches, each Prediction) — the slow kind named ``kind/s``."""
    from shardflow import hetero
    from shardflow.train import cluster_plan, config

    fast = hetero.device_kind(kind)
    slower = fast.replace(
        name=f"{fast.name}/{slowdown:.2f}",
        peak={p: v / slowdown for p, v in fast.peak.items() if v},
        memory_bandwidth=fast.memory_bandwidth / slowdown,
    )
    link = fast.nvlink or fast.pcie
    n_slow = len(slow)
    nodes = [hetero.Node(fast, replicas - n_slow, link, link)] + (
        [hetero.Node(slower, n_slow, link, link)] if n_slow else []
    )
    cluster = hetero.Cluster(tuple(n for n in nodes if n.devices))
    model = cluster_plan.transformer_of(config.model_config(run_cfg), run_cfg.data.seq_len)
    framework = hetero.Framework(**cluster_plan.FRAMEWORK)
    remat = run_cfg.model.get("remat", "none")
    result = hetero.search(
        model,
        cluster,
        global_batch,
        framework,
        precision=cluster_plan.precision_of(run_cfg),
        remat_options=({"none": False}.get(remat, remat),),
        top=200,
    )
    data_parallel = [
        c
        for c in result.candidates
        if c.plan.micro_batch == micro_batch
        and len(c.plan.pipelines) == replicas
        and all(len(p.stages) == 1 and p.stages[0].tp == 1 for p in c.plan.pipelines)
    ]
    if not data_parallel:
        raise SystemExit(
            f"no data-parallel plan of micro-batch {micro_batch} on all {replicas} devices among the search's best"
        )
    best = data_parallel[0].plan
    total = sum(p.microbatches for p in best.pipelines)
    if total % replicas:
        raise SystemExit(f"the plan's {total} micro-batches do not split evenly over {replicas} replicas")
    even = dataclasses.replace(
        best, pipelines=tuple(dataclasses.replace(p, microbatches=total // replicas) for p in best.pipelines)
    )
    predict = {
        "plan": hetero.simulate(model, cluster, best, framework),
        "even": hetero.simulate(model, cluster, even, framework),
    }

    def counts(plan):
        """Per replica (slow ones those in ``slow``), the micro-batches of a pipeline of its kind."""
        by_kind = {}
        for p in plan.pipelines:
            by_kind.setdefault(p.stages[0].kind, []).append(p.microbatches)
        return [by_kind[slower.name if r in slow else fast.name].pop() for r in range(replicas)]

    return {"plan": counts(best), "even": counts(even)}, predict


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1b", choices=sorted(CASES))
    parser.add_argument("--batch", type=int, help="global batch (sequences); default the preset's")
    parser.add_argument("--seq", type=int, help="sequence length; default the preset's")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--slow", help="comma-separated data replicas to slow down; default the second half")
    parser.add_argument("--extra", type=float, default=0.5, help="the load: this fraction of each sequence again")
    parser.add_argument("--kind", help="the devices' catalogue kind (default: theirs)")
    parser.add_argument("--devices", type=int, help="default: every device")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    configure_host_platform()
    import jax

    from shardflow.hetero.devices import catalogue_kind

    devices = jax.devices()[: args.devices]
    n = len(devices)
    if n < 2:
        raise SystemExit("emulated heterogeneity needs two devices or more")
    batch, seq, remat = CASES[args.preset]
    batch, seq = args.batch or batch, args.seq or seq
    slow = set(range(n // 2, n)) if args.slow is None else {int(r) for r in args.slow.split(",")}
    kind = args.kind or catalogue_kind(devices[0].device_kind)
    if kind is None:
        raise SystemExit(f"no catalogue kind for {devices[0].device_kind!r}: give --kind")
    print(f"jax {jax.__version__}, {n} x {devices[0].device_kind} (as {kind}); slow replicas {sorted(slow)}")

    # 1. calibrate on one device: its step, every slot loaded and not
    one = setup(args.preset, seq, remat, devices[:1], [batch // args.micro_batch], args.micro_batch)
    plain_s, _, _ = timed_step(one, set(), args.extra, args.steps, args.warmup)
    loaded_s, _, _ = timed_step(one, {0}, args.extra, args.steps, args.warmup)
    slowdown = loaded_s / plain_s
    print(f"calibration: one device {1e3 * plain_s:.1f} ms, loaded {1e3 * loaded_s:.1f} ms: slowdown {slowdown:.3f}")

    # 2. plan on the emulated cluster
    counts, predicted = plans(one.cfg, kind, slowdown, n, slow, batch, args.micro_batch)

    # 3. measure both, the slow replicas loaded
    rows = []
    for name in ("even", "plan"):
        run = setup(args.preset, seq, remat, devices, counts[name], args.micro_batch)
        seconds, loss, grad_norm = timed_step(run, slow, args.extra, args.steps, args.warmup)
        rows.append(
            {
                "plan": name,
                "replica_microbatches": counts[name],
                "measured_s": seconds,
                "predicted_s": predicted[name].seconds,
                "loss": loss,
                "grad_norm": grad_norm,
            }
        )
        times = f"measured {1e3 * seconds:8.1f} ms  predicted {1e3 * predicted[name].seconds:8.1f} ms"
        print(f"{name:5s} {counts[name]}  {times}")
    even, plan = rows
    measured_gain, predicted_gain = even["measured_s"] / plan["measured_s"], even["predicted_s"] / plan["predicted_s"]
    print(
        f"\ngain over the even split: measured {measured_gain:.3f}, predicted {predicted_gain:.3f}; "
        f"measured / predicted {measured_gain / predicted_gain:.3f}"
    )
    summary = {
        "slowdown": slowdown,
        "calibration_ms": {"plain": 1e3 * plain_s, "loaded": 1e3 * loaded_s},
        "measured_gain": measured_gain,
        "predicted_gain": predicted_gain,
    }
    if args.out:
        _results.write_json(
            args.out,
            rows,
            **summary,
            preset=args.preset,
            batch=batch,
            seq=seq,
            micro_batch=args.micro_batch,
            slow=sorted(slow),
            extra=args.extra,
            kind=kind,
        )
    return rows, summary


if __name__ == "__main__":
    main()
