"""The training step's plan: planned on abstract arguments (``plan_step``) and shown by
`shardflow explain` without allocating, compiling or writing anything."""

from __future__ import annotations

import sys
import warnings

from shardflow.train import run_setup
from shardflow.train.memory import device_memory, gib, params_text


def abstract_step_args(run: run_setup.Run):
    """(params, opt_state, batch) of the training step as ShapeDtypeStructs: what the planner
    plans for, without allocating anything."""
    import jax
    import jax.numpy as jnp

    params, opt_state = jax.eval_shape(lambda: run_setup.init_state(run))
    counts = run.cfg.replica_microbatches
    if counts:  # uneven micro-batches: every replica's slots, and the rows' weights
        slots = (run.replica_slots, len(counts) * (run.cfg.batch_size // sum(counts)))
        tokens = jax.ShapeDtypeStruct(slots + (run.cfg.data.seq_len,), jnp.int32)
        return (
            params,
            opt_state,
            {"inputs": tokens, "targets": tokens, "weights": jax.ShapeDtypeStruct(slots, jnp.float32)},
        )
    micro = run.cfg.batch_size // run.cfg.grad_accum
    tokens = jax.ShapeDtypeStruct((run.cfg.grad_accum, micro, run.cfg.data.seq_len), jnp.int32)
    return params, opt_state, {"inputs": tokens, "targets": tokens}


def plan_step(run: run_setup.Run, step_fn):
    """The Plan of the training step under the shardflow engine (the step's compile is cached:
    running it afterwards plans nothing again). A mesh axis the plan splits nothing over is one
    warning line in the trainer's terms."""
    import shardflow as sf

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", sf.ReplicatedAxisWarning)
        plan = step_fn.explain(*abstract_step_args(run))
    for w in caught:
        if not issubclass(w.category, sf.ReplicatedAxisWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        for axis, size in w.message.axes:
            print(
                f"warning: mesh axis {axis!r} ({size} devices) splits nothing under strategy "
                f"{run.cfg.strategy!r}: every device along it repeats the same work on the "
                "same data. Use a strategy that names it, or leave it out of the mesh",
                file=sys.stderr,
            )
    return plan


def explain(cfg) -> str:
    """`shardflow explain`: the training step's plan — collectives, modelled time and memory per
    device — without allocating, compiling or writing anything."""
    from shardflow.train.config import ConfigError

    if cfg.engine != "shardflow":
        raise ConfigError(
            f"shardflow explain shows the plan of engine 'shardflow'; this config "
            f"runs engine {cfg.engine!r} (jax.jit plans its own): --set "
            "engine=shardflow"
        )
    run = run_setup.setup(cfg)
    cfg = run.cfg  # with a cluster block, its plan's settings
    plan = plan_step(run, run.train_step())
    available, what = device_memory()
    fits = (
        ""
        if available is None
        else f"; fits in {what}"
        if plan.memory_bytes <= available
        else f"; does NOT fit in {what}"
    )
    pl = run.pipeline
    pipeline_note = f" | pipeline {pl.schedule} {pl.stages} stages x {pl.microbatches} micro-batches" if pl else ""
    return "\n".join(
        ([run.cluster_plan.describe(), ""] if run.cluster_plan else [])
        + [
            f"model {cfg.model} {params_text(run.n_params)} params | mesh {dict(run.mesh.shape)} "
            f"strategy {cfg.strategy} planner {cfg.planner}{pipeline_note} | batch "
            f"{cfg.batch_size}x{cfg.data.seq_len} (accum {cfg.grad_accum}) | compute {cfg.compute_dtype}",
            "",
            str(plan),
            "",
            f"step time, modelled: {plan.modelled_seconds * 1e3:,.3f} ms ({plan.total_seconds * 1e3:,.3f} "
            f"ms of collectives + {plan.work_seconds * 1e3:,.3f} ms of local work - "
            f"{plan.hidden_seconds * 1e3:,.3f} ms the layer loop hides)",
            f"memory per device, modelled: {gib(plan.memory_bytes)} ({gib(plan.input_bytes)} of "
            f"parameters, optimizer state and batch + {gib(plan.loop_bytes)} the loops hold; "
            f"other intermediates not counted){fits}",
        ]
    )
