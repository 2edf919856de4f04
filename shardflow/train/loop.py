"""The training loop: ``train(cfg)`` runs a config's steps from a fresh or resumed state,
checkpointing, evaluating and reporting as it goes, and stops cleanly on a non-finite loss or
Ctrl-C. The pieces it is built of: ``run_setup`` (the run), ``steps`` (the step functions),
``planning`` and ``memory`` (the plan and the memory budget), ``progress`` and ``interrupt``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from shardflow.train import planning
from shardflow.train.interrupt import CtrlC, Interrupted
from shardflow.train.memory import check_memory
from shardflow.train.progress import Progress
from shardflow.train.run_setup import Run, init_state, setup


def train(cfg, *, progress: bool = True, until: int | None = None) -> dict:
    """Train per cfg; returns {"losses": {step: loss}, "stopped": None | reason, "params"}.

    ``until`` ends this call after that step as if the run had been interrupted there (the
    schedule still spans cfg.steps): for training in chunks from a notebook, and for tests.
    """
    import jax

    from shardflow.train import config as config_lib

    run = setup(cfg)
    cfg = run.cfg  # with a cluster block, its plan's settings
    config_lib.check_writable(cfg)
    config_lib.check_not_overwriting(cfg)
    step_fn = run.train_step()
    if cfg.engine == "shardflow":
        check_memory(run, planning.plan_step(run, step_fn))
    main_process = jax.process_index() == 0
    out = Path(cfg.out)
    ckpt = _checkpoints(cfg, out)
    start, restored, (params, opt_state) = _initial_state(run, ckpt)
    if restored and main_process:
        print(f"resumed from step {start} ({ckpt.directory})")
    if main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=str))
        if run.cluster_plan:
            (out / "cluster_plan.json").write_text(json.dumps(run.cluster_plan.metadata(), indent=1))
            print(run.cluster_plan.describe())
        print(_header(run))
    loop = _Loop(
        run, step_fn, ckpt, start, restored, Progress(run, out, start, progress=progress, main_process=main_process)
    )
    params = loop.train(params, opt_state, until)
    summary = loop.summary
    if summary["stopped"] and main_process:
        print(summary["stopped"], file=sys.stderr)
    summary["params"] = params
    summary["end_step"] = max(loop.losses) if loop.losses else start
    return summary


def _checkpoints(cfg, out: Path):
    """The run's checkpoint directory, or None where checkpointing is off."""
    from shardflow.train.checkpoint import Checkpoints

    if not cfg.checkpoint.every:
        return None
    return Checkpoints(out / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)


def _initial_state(run: Run, ckpt):
    """(start step, whether resumed, (params, opt_state)): the newest checkpoint's where the
    config resumes and one exists, else fresh."""
    import jax

    from shardflow.train import config as config_lib
    from shardflow.train.checkpoint import abstract_like

    restored = None
    if ckpt and run.cfg.checkpoint.resume:
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
    if restored is None:
        return 0, False, init_state(run)
    start, state = restored
    return start, True, (state["params"], state["opt_state"])


def _header(run: Run) -> str:
    import jax

    cfg, pl = run.cfg, run.pipeline
    pipeline_note = f" | pipeline {pl.schedule} {pl.stages} stages x {pl.microbatches} micro-batches" if pl else ""
    return (
        f"model {cfg.model} {run.n_params / 1e6:.1f}M params | mesh {dict(run.mesh.shape)} "
        f"strategy {cfg.strategy} engine {cfg.engine}{pipeline_note} | batch "
        f"{cfg.batch_size}x{cfg.data.seq_len} "
        f"(accum {cfg.grad_accum}) | data {run.data.meta.get('tokenizer')} "
        f"{len(run.data) / 1e6:.1f}M tokens | {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}"
    )


class _Loop:
    """The steps of one ``train`` call: each step's batch, the step, its loss read one step late
    (so dispatch runs ahead) and checked, reports, evaluations and saves."""

    def __init__(self, run: Run, step_fn, ckpt, start: int, resumed: bool, progress: Progress):
        cfg = run.cfg
        self.run, self.cfg, self.step_fn, self.ckpt, self.progress = run, cfg, step_fn, ckpt, progress
        self.start = start
        self.losses: dict[int, float] = {}
        self.summary = {"losses": self.losses, "stopped": None, "start_step": start, "out": str(Path(cfg.out))}
        self.last_good_save = start if resumed else None
        self.eval_fn = None if run.val_data is None else run.eval_step()

    def train_batch(self, step: int):
        return self.run.step_batch(self.run.data, step)

    def val_loss(self, params) -> float:
        """Mean loss over cfg.eval_batches fixed batches of val.bin (the same at every eval)."""
        losses = [
            self.eval_fn(params, self.run.step_batch(self.run.val_data, i, accum=1))
            for i in range(self.cfg.eval_batches)
        ]
        return float(sum(losses)) / len(losses)

    def check(self, step, metrics) -> bool:
        """Host-side look at a finished step: record the loss, stop on NaN/inf."""
        loss = float(metrics["loss"])
        self.losses[step + 1] = loss
        if not math.isfinite(loss):
            where = (
                f"last good checkpoint: step {self.last_good_save} in {self.ckpt.directory}"
                if self.last_good_save is not None
                else "no checkpoint was saved"
            )
            self.summary["stopped"] = f"loss is {loss} at step {step + 1}; stopped ({where})"
            return False
        return True

    def train(self, params, opt_state, until: int | None):
        """The steps from ``start`` to cfg.steps (or ``until``): the parameters at the end.
        Interrupted on Ctrl-C, once the save under way (if any) has finished or failed."""
        from shardflow.train.checkpoint import CheckpointError

        cfg, ckpt = self.cfg, self.ckpt
        pending = None  # the previous step's metrics: read one step late so dispatch runs ahead
        done = self.start
        ctrl_c = CtrlC()
        try:
            ctrl_c.install()
            for step in range(self.start, min(cfg.steps, until or cfg.steps)):
                if ctrl_c.pressed:
                    break
                batch = self.train_batch(step)
                params, opt_state, metrics = self.step_fn(params, opt_state, batch)
                if ckpt:
                    ckpt.poll()
                if pending is not None and not self.check(*pending):
                    break
                pending = (step, metrics)
                self.progress.stepped(metrics)
                done = step + 1
                last = done == cfg.steps or done == until
                evaluate = self.run.val_data is not None and (done % cfg.eval_every == 0 or last)
                if done % cfg.log_every == 0 or last or evaluate:
                    self.progress.report(done, step, metrics, (lambda: self.val_loss(params)) if evaluate else None)
                if ckpt and (done % cfg.checkpoint.every == 0 or last):
                    if not self.check(*pending):  # never save parameters that produced a bad loss
                        break
                    pending = None
                    ckpt.save(done, {"params": params, "opt_state": opt_state})
                    self.last_good_save = done
            else:
                if pending is not None:
                    self.check(*pending)
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
            self.progress.close()
            if ckpt:
                ckpt.close()
        if ctrl_c.pressed:
            raise Interrupted(done)
        return params
