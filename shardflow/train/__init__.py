"""The trainer: ``shardflow train`` and ``shardflow prepare``, built on the compiler package.

    from shardflow import train
    run = train.setup(cfg)                       # cfg: shardflow.train.config.Config
    params, opt_state = train.init_state(run)
    summary = train.train(cfg)

Modules: ``config`` (the run's keys), ``data`` (token files), ``checkpoint`` (orbax),
``metrics`` (logs, FLOPs, MFU), ``devices`` (simulated CPU devices, multi-process start),
``steps`` (the step functions), ``run_setup`` (a run from a config), ``memory`` (the memory
budget), ``planning`` (the step's plan, `shardflow explain`), ``progress`` (bar, throughput,
metrics log), ``interrupt`` (Ctrl-C), ``loop`` (the training loop), ``cli`` (the command).
The compiler package (``shardflow``) imports nothing from here.
"""

from shardflow.train.cli import add_arguments, run_from_args
from shardflow.train.devices import SIMULATED_CPU_DEVICES, configure_host_platform, maybe_initialize_distributed
from shardflow.train.loop import train
from shardflow.train.run_setup import Run, init_state, setup
from shardflow.train.steps import build_optimizer, make_eval_step, make_loss_fn, make_train_step, parallelize_step

__all__ = [
    "SIMULATED_CPU_DEVICES",
    "Run",
    "add_arguments",
    "build_optimizer",
    "configure_host_platform",
    "init_state",
    "make_eval_step",
    "make_loss_fn",
    "make_train_step",
    "maybe_initialize_distributed",
    "parallelize_step",
    "run_from_args",
    "setup",
    "train",
]
