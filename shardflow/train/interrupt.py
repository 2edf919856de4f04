"""Ctrl-C during training: the first stops the loop before the next step and lets the save
under way finish, a second stops at once."""

from __future__ import annotations

import signal
import threading
from pathlib import Path


class CtrlC:
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
