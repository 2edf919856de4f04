"""`shardflow train`: pretrain a language model from a config.

    shardflow train                                   # tiny Llama on the stdlib, 8 CPU devices
    shardflow train --config configs/1b.yaml --set optimizer.lr=3e-4 --steps 1000 --out runs/1b
    python -m shardflow.train ...                     # the same

The training step is an ordinary single-device function of (params, opt_state, batch). The
parallelism lives outside it: the strategy's rules table turns the model's logical axes into a
PartitionSpec per parameter, and the engine runs the step as one SPMD program —
``shardflow.parallelize`` with those specs, or ``jax.jit`` with the same specs as
NamedShardings (the baseline the benchmarks compare against).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

from shardflow._compat import backends_are_initialized

SIMULATED_CPU_DEVICES = 8


def configure_host_platform(n_devices: int = SIMULATED_CPU_DEVICES) -> None:
    """On a CPU-only machine, simulate n devices, unless the user has chosen a count.

    XLA reads this flag when JAX first creates its backends, so this must run before anything
    asks JAX for devices; once backends exist it changes nothing.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags or not _platform_is_cpu() or backends_are_initialized():
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n_devices}".strip()


def _platform_is_cpu() -> bool:
    chosen = os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME")
    if chosen:
        return chosen.split(",")[0].strip().lower() == "cpu"
    accelerator_plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
    return not any(importlib.util.find_spec(name) for name in accelerator_plugins)


def maybe_initialize_distributed() -> None:
    """jax.distributed.initialize() when the environment describes a multi-process job: a
    cluster JAX detects by itself (SLURM, Open MPI, ...), or JAX_COORDINATOR_ADDRESS with
    JAX_NUM_PROCESSES and JAX_PROCESS_ID, which JAX itself does not read."""
    env = os.environ
    multi_process = (
        "JAX_COORDINATOR_ADDRESS" in env
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
        or int(env.get("JAX_NUM_PROCESSES", "1")) > 1
    )
    if multi_process:
        import jax

        given = {"num_processes": env.get("JAX_NUM_PROCESSES"), "process_id": env.get("JAX_PROCESS_ID")}
        jax.distributed.initialize(**{k: int(v) for k, v in given.items() if v is not None})


# --- the pieces of a run -----------------------------------------------------------------


def build_optimizer(ocfg, total_steps: int, decay_mask):
    import optax

    warmup = min(ocfg.warmup_steps, total_steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=ocfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=ocfg.lr * ocfg.min_lr_ratio,
    )
    adamw = optax.adamw(
        schedule, b1=ocfg.beta1, b2=ocfg.beta2, eps=ocfg.eps, weight_decay=ocfg.weight_decay, mask=decay_mask
    )
    clip = optax.clip_by_global_norm(ocfg.clip_norm) if ocfg.clip_norm > 0 else optax.identity()
    return optax.chain(clip, adamw), schedule


def make_loss_fn(graphdef, compute_dtype, pipeline=None):
    """(params, inputs, targets) -> mean next-token cross-entropy, fp32: the model's ``loss``,
    its stacked layers run by ``sf.pipeline`` where ``pipeline`` (a models.PipelineConfig)
    is given."""
    import jax
    from flax import nnx

    def loss_fn(params, inputs, targets):
        # fp32 master weights; the forward (and backward) run on a compute_dtype copy.
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
        return model.loss(inputs, targets, pipeline=pipeline)

    return loss_fn


def make_train_step(graphdef, optimizer, compute_dtype, grad_accum: int, pipeline=None):
    """(params, opt_state, batch) -> (params, opt_state, {"loss", "grad_norm"}).

    batch["inputs"/"targets"] are [grad_accum, micro_batch, seq]; gradients of the
    micro-batches are summed in fp32 by a scan, then averaged. With ``pipeline``, each
    micro-batch's loss and gradients come from the pipeline's schedule.
    """
    import jax
    import jax.numpy as jnp
    import optax

    grad_fn = jax.value_and_grad(make_loss_fn(graphdef, compute_dtype, pipeline))

    def train_step(params, opt_state, batch):
        if grad_accum == 1:
            loss, grads = grad_fn(params, batch["inputs"][0], batch["targets"][0])
        else:

            def accumulate(total, micro):
                loss, grads = grad_fn(params, micro["inputs"], micro["targets"])
                return jax.tree.map(jnp.add, total, (loss, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, zeros, batch)
            loss, grads = jax.tree.map(lambda x: x / grad_accum, (loss, grads))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return train_step


def make_eval_step(graphdef, compute_dtype, pipeline=None):
    """(params, batch) -> mean loss over the batch's tokens (batch as in train_step). With
    ``pipeline``, the pipelined loss (its layers stay on their stages; the schedule's backward
    runs too, as sf.pipeline computes the loss with its gradient)."""
    loss_fn = make_loss_fn(graphdef, compute_dtype, pipeline)

    def eval_step(params, batch):
        return loss_fn(params, batch["inputs"][0], batch["targets"][0])

    return eval_step


def parallelize_step(
    step_fn, engine: str, mesh, rules, in_specs, out_specs, donate: tuple = (0, 1), planner: str = "greedy"
):
    """Run step_fn as one SPMD program on mesh with the engine (and shardflow's planner) the
    config names."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from shardflow.models import activation_sharding
    from shardflow.models import sharding as model_sharding

    if engine == "shardflow":
        import shardflow as sf

        pin = sf.constrain
    else:
        pin = model_sharding.jit_pin(mesh)

    def step_with_activation_rules(*args):
        with activation_sharding(rules, pin):
            return step_fn(*args)

    if engine == "shardflow":
        return sf.parallelize(
            step_with_activation_rules,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            donate_argnums=donate,
            passes=sf.passes.SOLVER if planner == "solver" else None,
        )
    to_sharding = lambda tree: jax.tree.map(  # noqa: E731
        lambda s: NamedSharding(mesh, s if s is not None else PartitionSpec()),
        tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
    )
    return jax.jit(
        step_with_activation_rules,
        in_shardings=to_sharding(in_specs),
        out_shardings=to_sharding(out_specs),
        donate_argnums=donate,
    )


class _CtrlC:
    """While installed, Ctrl-C (SIGINT) sets ``pressed``, which the training loop reads before
    each step: it stops there and lets the save under way finish. A KeyboardInterrupt raised
    wherever Python happened to be could be swallowed (in a garbage-collection callback, say)
    or leave a save half-written. A second Ctrl-C raises KeyboardInterrupt at once."""

    def __init__(self):
        self.pressed = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._press)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _press(self, signum, frame) -> None:
        self.pressed = True
        self.uninstall()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training, once the save under way (if any) has finished or failed."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step  # the last step run; the resumed step (or 0) before any


def last_checkpoint_line(cfg) -> str:
    """Which step a resume of ``cfg``'s run would start from: the newest step on disk whose
    save finished (its checksums written)."""
    from shardflow.train.checkpoint import CHECKSUMS
    from shardflow.train.config import checkpoint_steps

    directory = Path(cfg.out).absolute() / "checkpoints"
    finished = [s for s in checkpoint_steps(directory) if (directory / str(s) / CHECKSUMS).is_file()]
    if finished:
        return f"last checkpoint: step {finished[-1]} in {directory}"
    return f"no checkpoint in {directory}" if cfg.checkpoint.every else "checkpointing is off"


@dataclasses.dataclass
class Run:
    """Everything a training run needs, built (and checked) before any step compiles."""

    cfg: object
    model_cfg: object
    mesh: object
    rules: dict
    graphdef: object
    param_specs: dict
    opt_specs: object
    batch_spec: object
    optimizer: object
    schedule: object
    n_params: int
    data: object
    val_data: object
    pipeline: object = None  # models.PipelineConfig, or None

    def shardings(self, specs):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    def train_step(self, engine: str | None = None):
        """The config's training step, (params, opt_state, batch) -> (params, opt_state,
        metrics), run by ``engine`` (default: the config's) with the run's specs."""
        step = make_train_step(
            self.graphdef, self.optimizer, self.cfg.compute_dtype, self.cfg.grad_accum, self.pipeline
        )
        return parallelize_step(
            step,
            engine or self.cfg.engine,
            self.mesh,
            self.rules,
            in_specs=(self.param_specs, self.opt_specs, self.batch_spec),
            out_specs=(self.param_specs, self.opt_specs, None),
            planner=self.cfg.planner,
        )


def setup(cfg) -> Run:
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec

    from shardflow import models
    from shardflow.models import sharding as model_sharding
    from shardflow.train import config as config_lib
    from shardflow.train import data as data_lib

    mesh_shape = config_lib.validate(cfg, jax.device_count())
    model_cfg = config_lib.model_config(cfg)
    data_dir = cfg.data.path or data_lib.default_corpus_dir()
    data = data_lib.TokenFile(data_dir)
    val_data = data_lib.TokenFile(data_dir, "val") if cfg.eval_every else None
    for tokens in (data, val_data):
        if tokens is not None:
            tokens.check_fits(cfg.data.seq_len)
    if data.vocab_size > model_cfg.vocab_size:
        raise config_lib.ConfigError(
            f"the data's vocabulary ({data.vocab_size}, {data_dir}) is larger than "
            f"model.vocab_size ({model_cfg.vocab_size}); --set model.vocab_size=N with N >= "
            f"{data.vocab_size} (a multiple of 128 keeps the matmuls aligned)"
        )
    if cfg.pipeline.stages is not None and cfg.pipeline.axis in mesh_shape:
        # The pipeline's axis outermost: each stage a block of consecutive devices (Megatron's
        # order), so a stage's data / model groups sit on neighbouring devices.
        mesh_shape = {
            cfg.pipeline.axis: mesh_shape[cfg.pipeline.axis],
            **{a: n for a, n in mesh_shape.items() if a != cfg.pipeline.axis},
        }
    mesh = Mesh(np.asarray(jax.devices()).reshape(tuple(mesh_shape.values())), tuple(mesh_shape))
    rules = config_lib.rules_for(cfg)
    if model_cfg.layout is not None:  # a ring of as many blocks as the sequence is split into
        seq_axes = model_sharding.mesh_axes_of(rules.get("seq"))
        model_cfg = dataclasses.replace(model_cfg, context_blocks=math.prod(mesh_shape[a] for a in seq_axes))

    abstract_model = nnx.eval_shape(lambda: models.build(model_cfg, cfg.seed))
    graphdef, abstract_params = nnx.split(abstract_model)
    if isinstance(cfg.strategy, dict):
        try:
            model_sharding.check_logical_names(cfg.strategy, model_sharding.model_logical_axes(abstract_model))
        except ValueError as e:
            raise config_lib.ConfigError(f"strategy {cfg.strategy}: {e}") from None
    try:
        param_specs = models.param_specs(abstract_model, rules, mesh)
    except ValueError as e:
        raise config_lib.ConfigError(f"strategy {cfg.strategy!r} on mesh {mesh_shape}: {e}") from None
    axes_tree, unannotated = models.param_logical_axes(abstract_model)
    if unannotated and jax.process_index() == 0:
        print(f"note: parameters without logical axes (replicated): {unannotated}")
    # Weight decay on matrices only: dims other than the stacked-layers one, at least two.
    decay_mask = jax.tree.map(
        lambda axes: sum(a != model_sharding.STACKED_AXIS for a in axes) >= 2,
        axes_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    optimizer, schedule = build_optimizer(cfg.optimizer, cfg.steps, decay_mask)
    params_shape = nnx.to_pure_dict(abstract_params)
    opt_shape = jax.eval_shape(optimizer.init, params_shape)
    opt_specs = optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        opt_shape,
        param_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    batch_spec = model_sharding.spec_for((None, "batch", None), rules)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params_shape))
    return Run(
        cfg,
        model_cfg,
        mesh,
        rules,
        graphdef,
        param_specs,
        opt_specs,
        batch_spec,
        optimizer,
        schedule,
        n_params,
        data,
        val_data,
        config_lib.pipeline_config(cfg),
    )


def abstract_step_args(run: Run):
    """(params, opt_state, batch) of the training step as ShapeDtypeStructs: what the planner
    plans for, without allocating anything."""
    import jax
    import jax.numpy as jnp

    params, opt_state = jax.eval_shape(lambda: init_state(run))
    micro = run.cfg.batch_size // run.cfg.grad_accum
    tokens = jax.ShapeDtypeStruct((run.cfg.grad_accum, micro, run.cfg.data.seq_len), jnp.int32)
    return params, opt_state, {"inputs": tokens, "targets": tokens}


def device_memory() -> tuple[int | None, str]:
    """(bytes one device can hold, what that is), or (None, why unknown)."""
    import jax

    device = jax.local_devices()[0]
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # a backend without memory statistics
        limit = None
    if limit:
        return limit, f"the {_gib(limit)} of each {device.device_kind}"
    if device.platform == "cpu":
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        n = jax.local_device_count()
        return host // n, (f"{_gib(host // n)} each of {n} CPU devices ({_gib(host)} of host memory shared)")
    return None, f"{device.device_kind} reports no memory size"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def _params_text(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def check_memory(run: Run, plan) -> None:
    """A ConfigError if the planner's estimate of what one device holds during the step exceeds
    what a device has: before anything is allocated or compiled. The estimate is a lower bound
    (the planner counts the step's inputs and what its loops hold for the backward, not the
    other intermediates), so what it refuses cannot fit."""
    from shardflow.train.config import ConfigError

    available, what = device_memory()
    if available is None or plan.memory_bytes <= available:
        return
    cfg = run.cfg
    remedies = ["more devices"]
    if cfg.strategy not in ("fsdp", "2d") and not isinstance(cfg.strategy, dict):
        remedies.append("strategy fsdp or 2d (the parameters and optimizer state split)")
    if run.model_cfg.remat != "full":
        remedies.append("model.remat=full")
    remedies.append("a smaller batch_size (or a larger grad_accum) or data.seq_len")
    where = " (this machine has CPU devices only)" if run.mesh.devices.flat[0].platform == "cpu" else ""
    raise ConfigError(
        f"model {cfg.model} ({_params_text(run.n_params)} parameters) needs an estimated "
        f"{_gib(plan.memory_bytes)} per device on mesh {dict(run.mesh.shape)} (the {cfg.planner} "
        f"planner's estimate, a lower bound: {_gib(plan.input_bytes)} of parameters, optimizer "
        f"state and batch + {_gib(plan.loop_bytes)} of activations the layers keep for the "
        f"backward), more than {what}. Run it on accelerators with at least "
        f"{_gib(plan.memory_bytes)} each{where}, or make the step need less per device: " + ", ".join(remedies)
    )


def plan_step(run: Run, step_fn):
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
    run = setup(cfg)
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
        [
            f"model {cfg.model} {_params_text(run.n_params)} params | mesh {dict(run.mesh.shape)} "
            f"strategy {cfg.strategy} planner {cfg.planner}{pipeline_note} | batch "
            f"{cfg.batch_size}x{cfg.data.seq_len} (accum {cfg.grad_accum}) | compute {cfg.compute_dtype}",
            "",
            str(plan),
            "",
            f"step time, modelled: {plan.modelled_seconds * 1e3:,.3f} ms ({plan.total_seconds * 1e3:,.3f} "
            f"ms of collectives + {plan.work_seconds * 1e3:,.3f} ms of local work - "
            f"{plan.hidden_seconds * 1e3:,.3f} ms the layer loop hides)",
            f"memory per device, modelled: {_gib(plan.memory_bytes)} ({_gib(plan.input_bytes)} of "
            f"parameters, optimizer state and batch + {_gib(plan.loop_bytes)} the loops hold; "
            f"other intermediates not counted){fits}",
        ]
    )


def init_state(run: Run):
    """Fresh fp32 parameters and optimizer state, created directly in their shardings."""
    import jax
    from flax import nnx

    from shardflow import models

    def init():
        model = models.build(run.model_cfg, run.cfg.seed)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return params, run.optimizer.init(params)

    out = (run.shardings(run.param_specs), run.shardings(run.opt_specs))
    return jax.jit(init, out_shardings=out)()


def train(cfg, *, progress: bool = True, until: int | None = None) -> dict:
    """Train per cfg; returns {"losses": {step: loss}, "stopped": None | reason, "params"}.

    ``until`` ends this call after that step as if the run had been interrupted there (the
    schedule still spans cfg.steps): for training in chunks from a notebook, and for tests.
    """
    import jax
    from tqdm import tqdm

    from shardflow.train import config as config_lib
    from shardflow.train import data as data_lib
    from shardflow.train import metrics as metrics_lib
    from shardflow.train.checkpoint import CheckpointError, Checkpoints, abstract_like

    run = setup(cfg)
    config_lib.check_writable(cfg)
    config_lib.check_not_overwriting(cfg)
    step_fn = run.train_step()
    if cfg.engine == "shardflow":
        check_memory(run, plan_step(run, step_fn))
    main_process = jax.process_index() == 0
    out = Path(cfg.out)

    ckpt = (
        Checkpoints(out / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
        if cfg.checkpoint.every
        else None
    )
    start, restored = 0, None
    if ckpt and cfg.checkpoint.resume:
        params_shape, opt_shape = jax.eval_shape(lambda: init_state(run))
        target = {
            "params": abstract_like(params_shape, run.shardings(run.param_specs)),
            "opt_state": abstract_like(opt_shape, run.shardings(run.opt_specs)),
        }
        try:
            restored = ckpt.restore_latest(target)
        except ValueError as e:
            ckpt.close()
            raise config_lib.ConfigError(
                f"{e}. Resume with the config that wrote it, or start this run in a fresh --out directory"
            ) from None
        except BaseException:
            ckpt.close()
            raise
    if restored is not None:
        start, state = restored
        params, opt_state = state["params"], state["opt_state"]
        if main_process:
            print(f"resumed from step {start} ({ckpt.directory})")
    else:
        params, opt_state = init_state(run)
    if main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=str))

    batch_sharding = run.shardings(run.batch_spec)
    micro = cfg.batch_size // cfg.grad_accum
    if run.val_data is not None:
        eval_fn = parallelize_step(
            make_eval_step(run.graphdef, cfg.compute_dtype, run.pipeline),
            cfg.engine,
            run.mesh,
            run.rules,
            in_specs=(run.param_specs, run.batch_spec),
            out_specs=None,
            donate=(),
            planner=cfg.planner,
        )

    def val_loss():
        """Mean loss over cfg.eval_batches fixed batches of val.bin (the same at every eval)."""
        losses = [
            eval_fn(
                params,
                data_lib.global_batch(run.val_data, i, (1, micro), seq_len, cfg.data.seed, batch_sharding, order),
            )
            for i in range(cfg.eval_batches)
        ]
        return float(sum(losses)) / len(losses)

    seq_len = cfg.data.seq_len
    layout = run.model_cfg.layout  # a context-parallel token order: the data stored in it
    order = None if layout is None else layout.positions(seq_len)
    tokens_per_step = cfg.batch_size * seq_len
    flops_per_token = metrics_lib.flops_per_token(run.model_cfg, run.n_params, seq_len)
    peak = metrics_lib.peak_flops(jax.devices()[0], cfg.peak_flops)
    log = metrics_lib.MetricsLog(out, start, enabled=main_process)
    pl = run.pipeline
    pipeline_note = f" | pipeline {pl.schedule} {pl.stages} stages x {pl.microbatches} micro-batches" if pl else ""
    if main_process:
        print(
            f"model {cfg.model} {run.n_params / 1e6:.1f}M params | mesh {dict(run.mesh.shape)} "
            f"strategy {cfg.strategy} engine {cfg.engine}{pipeline_note} | batch "
            f"{cfg.batch_size}x{seq_len} "
            f"(accum {cfg.grad_accum}) | data {run.data.meta.get('tokenizer')} "
            f"{len(run.data) / 1e6:.1f}M tokens | {jax.device_count()} x "
            f"{jax.devices()[0].device_kind}"
        )

    losses: dict[int, float] = {}
    summary = {"losses": losses, "stopped": None, "start_step": start, "out": str(out)}
    last_good_save = start if restored is not None else None
    # tqdm shows no bar where its stream is not a terminal; log lines take its place there.
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        disable=None if progress and main_process else True,
        dynamic_ncols=True,
        unit="step",
    )
    log_lines = progress and main_process and bar.disable
    window_start, window_steps = None, 0

    def check(step, metrics):
        """Host-side look at a finished step: record the loss, stop on NaN/inf."""
        loss = float(metrics["loss"])
        losses[step + 1] = loss
        if not math.isfinite(loss):
            where = (
                f"last good checkpoint: step {last_good_save} in {ckpt.directory}"
                if last_good_save is not None
                else "no checkpoint was saved"
            )
            summary["stopped"] = f"loss is {loss} at step {step + 1}; stopped ({where})"
            return False
        return True

    pending = None  # the previous step's metrics: read one step late so dispatch runs ahead
    done = start
    ctrl_c = _CtrlC()
    try:
        ctrl_c.install()
        for step in range(start, min(cfg.steps, until or cfg.steps)):
            if ctrl_c.pressed:
                break
            batch = data_lib.global_batch(
                run.data, step, (cfg.grad_accum, micro), seq_len, cfg.data.seed, batch_sharding, order
            )
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            if ckpt:
                ckpt.poll()
            if pending is not None and not check(*pending):
                break
            pending = (step, metrics)
            if window_start is None:  # the first step compiles; time from its end
                jax.block_until_ready(metrics)
                window_start, window_steps = time.perf_counter(), 0
            else:
                window_steps += 1
            done = step + 1
            bar.update(1)

            last = done == cfg.steps or done == until
            evaluate = run.val_data is not None and (done % cfg.eval_every == 0 or last)
            if done % cfg.log_every == 0 or last or evaluate:
                jax.block_until_ready(metrics)
                elapsed = time.perf_counter() - window_start
                tok_s = window_steps * tokens_per_step / elapsed if window_steps else None
                mfu = tok_s * flops_per_token / (peak * jax.device_count()) if tok_s and peak else None
                loss = float(metrics["loss"])
                val = val_loss() if evaluate and math.isfinite(loss) else None
                log.log(
                    done,
                    loss=loss,
                    grad_norm=float(metrics["grad_norm"]),
                    lr=float(run.schedule(step)),
                    tokens_per_s=tok_s,
                    mfu=mfu,
                    val_loss=val,
                )
                shown = {
                    "loss": f"{loss:.3f}",
                    "tok_s": f"{tok_s:,.0f}" if tok_s else "-",
                    "mfu": f"{100 * mfu:.1f}%" if mfu else "n/a",
                }
                if val is not None:
                    shown["val_loss"] = f"{val:.3f}"
                bar.set_postfix(shown)
                if log_lines:
                    print(f"step {done}/{cfg.steps} " + " ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
                window_start, window_steps = time.perf_counter(), 0

            if ckpt and (done % cfg.checkpoint.every == 0 or last):
                if not check(*pending):  # never save parameters that produced a bad loss
                    break
                pending = None
                ckpt.save(done, {"params": params, "opt_state": opt_state})
                last_good_save = done
        else:
            if pending is not None:
                check(*pending)
        if ckpt:
            ckpt.wait()  # a failed last save is this run's error (after Ctrl-C too)
    except KeyboardInterrupt:  # a second Ctrl-C
        if ckpt and ckpt.saving is not None:
            try:  # the save under way finishes (its checksums written) ...
                ckpt.wait()
            except (CheckpointError, KeyboardInterrupt):
                pass  # ... or stays without checksums: a resume sets it aside
        raise Interrupted(done) from None
    finally:
        ctrl_c.uninstall()
        bar.close()
        log.close()
        if ckpt:
            ckpt.close()
    if ctrl_c.pressed:
        raise Interrupted(done)
    if summary["stopped"] and main_process:
        print(summary["stopped"], file=sys.stderr)
    summary["params"] = params
    summary["end_step"] = max(losses) if losses else start
    return summary


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    """The config a run is made of: `shardflow explain`'s arguments, and the first of `train`'s."""
    parser.add_argument("--config", help="YAML file of config keys (see shardflow/train/config.py)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. optimizer.lr=3e-4",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_explain_arguments(parser)
    parser.add_argument("--steps", type=int, help="total optimizer steps")
    parser.add_argument("--out", help="run directory (checkpoints, metrics.jsonl, tb/)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def explain_from_args(args) -> int:
    configure_host_platform()
    import shardflow as sf
    from shardflow.train import config as config_lib

    try:
        cfg = config_lib.load(args.config, args.overrides)
        maybe_initialize_distributed()
        print(explain(cfg))
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except sf.ShardingError as e:
        print(f"sharding error: {e}", file=sys.stderr)
        return 2
    return 0


def run_from_args(args) -> int:
    configure_host_platform()
    import shardflow as sf
    from shardflow.train import config as config_lib
    from shardflow.train.checkpoint import CheckpointError

    cfg = None
    try:
        cfg = config_lib.load(args.config, args.overrides, steps=args.steps, out=args.out)
        maybe_initialize_distributed()
        summary = train(cfg, progress=not args.no_progress)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 1
    except sf.ShardingError as e:
        print(f"sharding error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        at = f" after step {e.step}" if isinstance(e, Interrupted) and e.step else ""
        print(f"interrupted{at}" + (f"; {last_checkpoint_line(cfg)}" if cfg else ""), file=sys.stderr)
        return 130
    if summary["stopped"]:
        return 1
    losses = summary["losses"]
    if losses:
        first, last = losses[min(losses)], losses[max(losses)]
        print(
            f"done: step {max(losses)}, loss {first:.3f} (step {min(losses)}) -> {last:.3f}; "
            f"metrics in {Path(cfg.out) / 'metrics.jsonl'}"
        )
    else:
        print(
            f"nothing to train: {cfg.out} already holds a checkpoint at step "
            f"{summary['start_step']} of {cfg.steps} (raise --steps or pick another --out)"
        )
    return 0
