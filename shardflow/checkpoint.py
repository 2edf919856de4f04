"""Checkpoints with orbax: asynchronous saves, keep the last N, restore onto any mesh.

Restoring takes an abstract target — shapes, dtypes and the *current* run's shardings — so a
checkpoint written under one mesh (say 8-way DP) loads straight into another (2×4 DP×TP):
orbax reads each device's slice of every array from the saved files.
"""
from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying the given shardings, for restoring ``tree``'s structure."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


class Checkpoints:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                               enable_async_checkpointing=async_save)
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state) -> None:
        """Starts writing ``state`` (a pytree of jax.Arrays); returns before it is on disk."""
        self._manager.save(step, args=ocp.args.StandardSave(state))

    def restore(self, step: int, abstract_state):
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
