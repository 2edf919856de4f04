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
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_handlers=ocp.StandardCheckpointHandler())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state) -> None:
        """Starts writing ``state`` (a pytree of jax.Arrays); returns before it is on disk."""
        self._manager.save(step, args=ocp.args.StandardSave(state))

    def restore(self, step: int, abstract_state):
        """``abstract_state`` restored from ``step``; a ValueError naming the first differences
        if the checkpoint holds other arrays (another model or optimizer)."""
        saved = _shapes(self._manager.item_metadata(step).tree)
        wanted = _shapes(abstract_state)
        diff = [f"{k}: saved {saved.get(k, 'nothing')}, wanted {wanted.get(k, 'nothing')}"
                for k in sorted(saved.keys() | wanted.keys()) if saved.get(k) != wanted.get(k)]
        if diff:
            raise ValueError(f"the checkpoint at step {step} in {self.directory} holds other arrays "
                             f"than this run's ({len(diff)} differ): " + "; ".join(diff[:3]))
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _shapes(tree) -> dict:
    """'path/to/leaf' -> shape, with dict keys, attributes and indices spelled alike."""
    def name(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)
    return {"/".join(name(k) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
