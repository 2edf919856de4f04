"""The trainer: ``shardflow train`` and ``shardflow prepare``, built on the compiler package.

    from shardflow import train
    run = train.setup(cfg)                       # cfg: shardflow.train.config.Config
    params, opt_state = train.init_state(run)
    summary = train.train(cfg)

Modules: ``config`` (the run's keys), ``data`` (token files), ``checkpoint`` (orbax),
``metrics`` (logs, FLOPs, MFU), ``loop`` (setup and the training loop), ``cli`` (the command).
The compiler package (``shardflow``) imports nothing from here.
"""

from shardflow.train.loop import (
    SIMULATED_CPU_DEVICES,
    Run,
    add_arguments,
    build_optimizer,
    configure_host_platform,
    init_state,
    make_eval_step,
    make_loss_fn,
    make_train_step,
    maybe_initialize_distributed,
    parallelize_step,
    run_from_args,
    setup,
    train,
)

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
