"""Checkpoints with orbax: asynchronous saves, keep the last N, restore onto any mesh.

Restoring takes an abstract target — shapes, dtypes and the *current* run's shardings — so a
checkpoint written under one mesh (say 8-way DP) loads straight into another (2×4 DP×TP):
orbax reads each device's slice of every array from the saved files.

A step whose files are missing or unreadable is *damaged*: resuming falls back to the newest
step that restores and moves the damaged ones aside (``STEP.damaged``), so the run can save
those step numbers again.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, or no checkpoint that can be read."""


class DamagedCheckpoint(CheckpointError):
    def __init__(self, step: int, why: str):
        super().__init__(f"step {step} is damaged ({why})")
        self.step, self.why = step, why


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying the given shardings, for restoring ``tree``'s structure."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


class Checkpoints:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save,
            # When a step directory made in the background cannot be created, orbax's commit
            # threads wait out their 300 s signal timeout, and the process waits for them at
            # exit. Made in save() instead, the failure is an exception there.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_handlers=ocp.StandardCheckpointHandler())
        self._saving: int | None = None  # the step whose background save may still run

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state) -> None:
        """Starts writing ``state`` (a pytree of jax.Arrays); returns before it is on disk.
        A CheckpointError if this save, or the previous one in the background, failed."""
        self.wait()
        with self._failure(f"saving step {step}"):
            self._manager.save(step, args=ocp.args.StandardSave(state))
        self._saving = step

    def wait(self) -> None:
        """Blocks until the last save is on disk; a CheckpointError if it failed."""
        step, self._saving = self._saving, None
        if step is not None:
            with self._failure(f"saving step {step}"):
                self._manager.wait_until_finished()

    def close(self) -> None:
        """Releases orbax's threads. Call wait() first to hear about a failed last save."""
        with contextlib.suppress(Exception):
            self._manager.wait_until_finished()
        self._manager.close()

    def restore(self, step: int, abstract_state):
        """``abstract_state`` restored from ``step``. A ValueError naming the first differences
        if the checkpoint holds other arrays (another model or optimizer); DamagedCheckpoint if
        its files are missing or unreadable."""
        try:
            with _reads_finish_before_their_loop_closes():
                metadata = self._manager.item_metadata(step)
        except Exception as e:  # whatever orbax makes of a broken folder
            raise DamagedCheckpoint(step, self._why(step, e, "reading its metadata: ")) from None
        if metadata is None:
            raise DamagedCheckpoint(step, f"{self.directory / str(step) / 'default'} has no "
                                          "readable _METADATA")
        saved = _shapes(metadata.tree)
        wanted = _shapes(abstract_state)
        diff = [f"{k}: saved {saved.get(k, 'nothing')}, wanted {wanted.get(k, 'nothing')}"
                for k in sorted(saved.keys() | wanted.keys()) if saved.get(k) != wanted.get(k)]
        if diff:
            raise ValueError(f"the checkpoint at step {step} in {self.directory} holds other arrays "
                             f"than this run's ({len(diff)} differ): " + "; ".join(diff[:3]))
        try:
            with _reads_finish_before_their_loop_closes():
                return self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except Exception as e:  # tensorstore's and orbax's read errors alike
            raise DamagedCheckpoint(step, self._why(step, e)) from None

    def restore_latest(self, abstract_state):
        """(step, state) from the newest step that restores, or None if there are no steps.

        Damaged newer steps are moved aside, each with a warning, once an older one has
        restored (proof that it is those files, not this process, that cannot be read). If no
        step restores, a CheckpointError says why for each.
        """
        damaged = []
        for step in reversed(self.steps()):
            try:
                state = self.restore(step, abstract_state)
            except DamagedCheckpoint as e:
                damaged.append(e)
                continue
            self._set_aside(damaged, step)
            return step, state
        if damaged:
            raise CheckpointError(
                f"no checkpoint in {self.directory} can be restored: "
                + "; ".join(str(e) for e in damaged)
                + f". Move {self.directory} away or pick another --out")
        return None

    def _set_aside(self, damaged: list[DamagedCheckpoint], good_step: int) -> None:
        if not damaged:
            return
        if jax.process_index() == 0:
            for e in damaged:
                aside = next(path for i in itertools.count()
                             if not (path := self.directory / f"{e.step}.damaged{i or ''}").exists())
                (self.directory / str(e.step)).rename(aside)
                print(f"warning: checkpoint {e}; resuming from step {good_step} (moved the "
                      f"damaged step to {aside})", file=sys.stderr)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("shardflow: damaged checkpoints set aside")
        self._manager.reload()

    def _why(self, step: int, error: BaseException, doing: str = "") -> str:
        step_dir = self.directory / str(step)
        if not step_dir.is_dir() or not any(step_dir.iterdir()):
            return f"{step_dir} is empty"
        if not (step_dir / "default").is_dir():
            return f"{step_dir / 'default'} is missing"
        while error.__cause__ is not None:  # the innermost error names the file
            error = error.__cause__
        return doing + str(error).split(" [tensorstore_spec=")[0].strip()

    @contextlib.contextmanager
    def _failure(self, what: str):
        try:
            yield
        except Exception as e:
            raise CheckpointError(f"{what} in {self.directory} failed: "
                                  f"{type(e).__name__}: {e}") from e


class _DrainingLoop(asyncio.SelectorEventLoop):
    def close(self):
        pending = asyncio.all_tasks(self)
        if pending:
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()

    def call_soon_threadsafe(self, callback, *args, context=None):
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if not self.is_closed():
                raise
            return None  # a read whose task was cancelled finished after the loop closed


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        return _DrainingLoop()


@contextlib.contextmanager
def _reads_finish_before_their_loop_closes():
    """orbax runs a restore's reads as tasks of an event loop it closes when the first read
    fails (of metadata too). The others would be left pending, each printing a traceback when collected, and
    a tensorstore read that completes after the close raises "Event loop is closed" in its
    thread. Here loops wait for their remaining tasks before they close, and a late read's
    wake-up of a closed loop is dropped."""
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_DrainingPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)


def _shapes(tree) -> dict:
    """'path/to/leaf' -> shape, with dict keys, attributes and indices spelled alike."""
    def name(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)
    return {"/".join(name(k) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
