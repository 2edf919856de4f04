"""Checkpoints with orbax: asynchronous saves, keep the last N, restore onto any mesh.

Restoring takes an abstract target — shapes, dtypes and the *current* run's shardings — so a
checkpoint written under one mesh (say 8-way DP) loads straight into another (2×4 DP×TP):
orbax reads each device's slice of every array from the saved files.

Every saved array has a checksum: once a save has finished, ``STEP/checksums.json`` holds
two position-weighted sums of each array's bits (computed on its devices, so they do not depend
on the mesh), and a restore recomputes them. A step whose files are missing or unreadable,
whose arrays do not match their checksums, or without checksums (its save did not finish) is
*damaged*: resuming falls back to the newest step that restores and moves the damaged ones
aside (``STEP.damaged``), so the run can save those step numbers again. A step this process
has no permission to read is not damaged: that is a CheckpointError, and nothing moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

CHECKSUMS = "checksums.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, or no checkpoint that can be read."""


class DamagedCheckpoint(CheckpointError):
    def __init__(self, step: int, why: str):
        super().__init__(f"step {step} is damaged ({why})")
        self.step, self.why = step, why


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying the given shardings, for restoring ``tree``'s structure."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpoints:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            # When a step directory made in the background cannot be created, orbax's commit
            # threads wait out their 300 s signal timeout, and the process waits for them at
            # exit. Made in save() instead, the failure is an exception there.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        self.directory = Path(directory).absolute()
        _check_readable(self.directory)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )
        self._async = async_save
        self._saving: int | None = None  # the step whose background save may still run
        self._saving_checksums = None  # its arrays' checksums, written when it finishes

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state) -> None:
        """Starts writing ``state`` (a pytree of jax.Arrays); returns before it is on disk.
        A CheckpointError if this save, or the previous one in the background, failed."""
        self.wait()
        # Dispatched before the caller's next step can donate the arrays; read when written.
        checksums = _checksums(state)
        with self._failure(f"saving step {step}"):
            self._manager.save(step, args=ocp.args.StandardSave(state))
        self._saving, self._saving_checksums = step, checksums
        if not self._async:
            self.wait()

    def wait(self) -> None:
        """Blocks until the last save is on disk, then writes its checksums; a CheckpointError
        if either failed."""
        step, self._saving = self._saving, None
        if step is not None:
            with self._failure(f"saving step {step}"):
                self._manager.wait_until_finished()
                self._write_checksums(step, self._saving_checksums)

    def poll(self) -> None:
        """Writes the checksums of a background save that has finished, so that the step counts
        as saved without waiting for the next save; a CheckpointError if that save failed."""
        if self._saving is not None and not self._manager.is_saving_in_progress():
            self.wait()

    @property
    def saving(self) -> int | None:
        """The step whose save has started but whose checksums are not written yet."""
        return self._saving

    def _write_checksums(self, step: int, checksums) -> None:
        digests = _digests(checksums)
        if jax.process_index() == 0:
            path = self.directory / str(step) / CHECKSUMS
            partial = path.with_name(CHECKSUMS + ".partial")
            partial.write_text(json.dumps(digests, indent=0, sort_keys=True))
            os.replace(partial, path)

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
            raise DamagedCheckpoint(step, f"{self.directory / str(step) / 'default'} has no readable _METADATA")
        saved = _shapes(metadata.tree)
        wanted = _shapes(abstract_state)
        diff = [
            f"{k}: saved {saved.get(k, 'nothing')}, wanted {wanted.get(k, 'nothing')}"
            for k in sorted(saved.keys() | wanted.keys())
            if saved.get(k) != wanted.get(k)
        ]
        if diff:
            raise ValueError(
                f"the checkpoint at step {step} in {self.directory} holds other arrays "
                f"than this run's ({len(diff)} differ): " + "; ".join(diff[:3])
            )
        try:
            with _reads_finish_before_their_loop_closes():
                state = self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except Exception as e:  # tensorstore's and orbax's read errors alike
            raise DamagedCheckpoint(step, self._why(step, e)) from None
        self._verify(step, state)
        return state

    def _verify(self, step: int, state) -> None:
        verify_checksums(self.directory / str(step), step, state)

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
                + f". Move {self.directory} away or pick another --out"
            )
        return None

    def _set_aside(self, damaged: list[DamagedCheckpoint], good_step: int) -> None:
        if not damaged:
            return
        if jax.process_index() == 0:
            for e in damaged:
                aside = next(
                    path
                    for i in itertools.count()
                    if not (path := self.directory / f"{e.step}.damaged{i or ''}").exists()
                )
                (self.directory / str(e.step)).rename(aside)
                print(
                    f"warning: checkpoint {e}; resuming from step {good_step} (moved the damaged step to {aside})",
                    file=sys.stderr,
                )
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
            raise CheckpointError(f"{what} in {self.directory} failed: {type(e).__name__}: {e}") from e


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


def verify_checksums(step_dir: Path, step: int, state, *, partial: bool = False) -> None:
    """DamagedCheckpoint unless every array of ``state``, restored from ``step_dir``, matches the
    checksum its save wrote. ``partial``: ``state`` is a part of what was saved (a sampler
    restores only the parameters), so the saved arrays it lacks are not compared."""
    path = Path(step_dir) / CHECKSUMS
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(step, f"{path} is missing: its save did not finish") from None
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(step, f"{path} cannot be read: {e}") from None
    restored = _digests(_checksums(state))
    names = restored.keys() if partial else restored.keys() | saved.keys()
    wrong = [name for name in sorted(names) if restored.get(name) != saved.get(name)]
    if wrong:
        raise DamagedCheckpoint(
            step,
            f"{len(wrong)} of its {len(restored)} arrays do not match their checksums "
            f"in {path.name}: {', '.join(wrong[:3])}{', ...' * (len(wrong) > 3)}",
        )


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


def _check_readable(directory: Path) -> None:
    """A CheckpointError naming the first step folder or file of ``directory`` this process may
    not read. Read permission is the process's, not the files': such a step is not set aside."""
    if not directory.is_dir():
        return

    def fail(e: OSError):
        raise e

    try:
        steps = [p for p in directory.iterdir() if p.name.isascii() and p.name.isdigit()]
        for step_dir in steps:
            for root, _, files in os.walk(step_dir, onerror=fail):
                for name in files:
                    with open(os.path.join(root, name), "rb"):
                        pass
    except PermissionError as e:
        raise CheckpointError(
            f"{e.filename} cannot be read by this process ({e.strerror}): give it read "
            f"permission, or move that step out of {directory} to resume from an older "
            "one"
        ) from None


def _checksum(x: jax.Array) -> jax.Array:
    """Two sums of ``x``'s bits as 32-bit words, mod 2**32, each word weighted by an odd
    multiple of its position: one flipped bit changes both, any reordering of words changes
    them almost surely. Not cryptographic; a check against damage, not tampering."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize >= 4:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        words = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    words = words.astype(jnp.uint32).ravel()
    position = jax.lax.iota(jnp.uint32, words.size)
    rotated = (words << 13) | (words >> 19)
    return jnp.stack(
        [
            jnp.sum(words * (position * np.uint32(0x9E3779B1) | 1), dtype=jnp.uint32),
            jnp.sum(rotated * (position * np.uint32(0x85EBCA77) | 1), dtype=jnp.uint32),
        ]
    )


_checksums = jax.jit(lambda tree: jax.tree.map(_checksum, tree))


def _digests(checksums) -> dict:
    """'path/to/leaf' -> its two checksum words as ints, as checksums.json holds them."""
    return {name: [int(word) for word in np.asarray(value)] for name, value in _named_leaves(checksums).items()}


def _named_leaves(tree) -> dict:
    """'path/to/leaf' -> leaf, with dict keys, attributes and indices spelled alike."""
    return {_path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _path_name(path) -> str:
    def name(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    return "/".join(name(k) for k in path)


def _shapes(tree) -> dict:
    """'path/to/leaf' -> shape."""
    return {name: tuple(leaf.shape) for name, leaf in _named_leaves(tree).items()}
