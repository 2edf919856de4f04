"""Uneven micro-batch counts per data replica (``replica_microbatches: [4, 4, 3, 1]``): a slower
replica takes less of the batch, in one SPMD program.

Every replica runs the same number of micro-batch slots: the busiest replica's count
(``max(counts)``), or with a pipeline its ``pipeline.microbatches`` where that is more (a
schedule may want a multiple of the stages). Replica r's slots past its own count hold padding
rows of weight zero. Each real row weighs one, and the step's loss and gradients are the sums
over real rows divided by their number: the homogeneous step's mean over the same global batch,
exactly (a padding row's loss is multiplied by zero, and so is every gradient it would add).

Without a pipeline the slots run in a scan, each under ``sf.predicated``: a device whose rows
of a slot are all padding skips it (no work, no waiting: the conditional is on its own rows).
With one (``pipeline.stages``, uneven ``layers_per_stage`` and every schedule) the slots are the
pipeline's micro-batches: slot i of every replica is its micro-batch i, the rows' weights go to
the head with the targets, and the layers' stages stay on the pipeline axis.

Partial: with a pipeline, a replica's padding micro-batches are computed (forward, head and
backward, their results weighted zero), not skipped: the schedule's steps run on every device.
Dense models only (an MoE's routing couples the rows of a micro-batch); data parallelism over
the data axes (FSDP's gathers would cross them: sf.predicated then runs every slot everywhere,
exact, and warns); one process (each process reads the whole batch).
"""

from __future__ import annotations

import numpy as np


def slots(counts, rows: int, n_slots: int | None = None):
    """(index [slots, replicas * rows] of each slot row into the step's global batch, weight of
    each: 1 for a real row, 0 for padding), ``n_slots`` slots (default: the largest count).
    Replica r's rows are consecutive in the batch."""
    n_slots, start = n_slots or max(counts), np.cumsum([0] + list(counts[:-1])) * rows
    index = np.zeros((n_slots, len(counts), rows), np.int64)
    weight = np.zeros(index.shape, np.float32)
    for r, count in enumerate(counts):
        for i in range(count):
            index[i, r] = start[r] + i * rows + np.arange(rows)
            weight[i, r] = 1.0
    return index.reshape(n_slots, -1), weight.reshape(n_slots, -1)


def global_batch(data, step: int, counts, rows: int, n_slots: int, seq_len: int, seed: int, shardings, order=None):
    """{"inputs", "targets" [slots, replicas * rows, seq], "weights" [slots, replicas * rows]}: the
    step's global batch (the homogeneous step's rows) laid out in the replicas' slots; ``order``
    the tokens' (data.global_batch's)."""
    import jax

    index, weight = slots(counts, rows, n_slots)
    starts = data.window_starts(step, (1, sum(counts) * rows), seq_len, seed)[0]
    windows = data.windows(starts[index], seq_len)
    inputs, targets = windows[..., :-1], windows[..., 1:]
    if order is not None:
        inputs, targets = inputs[..., order], targets[..., order]
    arrays = {"inputs": inputs, "targets": targets, "weights": weight}
    return {k: jax.make_array_from_callback(a.shape, shardings[k], lambda i, a=a: a[i]) for k, a in arrays.items()}


def make_train_step(graphdef, optimizer, compute_dtype, pipeline=None):
    """(params, opt_state, batch) -> (params, opt_state, {"loss", "grad_norm"}): the mean loss
    over the batch's real rows and its gradients, by ``sf.predicated`` slots or, with
    ``pipeline`` (a models.PipelineConfig), the slots as its micro-batches."""
    import optax

    gradients = _slot_gradients if pipeline is None else _pipelined_gradients
    loss_and_grads = gradients(graphdef, compute_dtype, pipeline)

    def train_step(params, opt_state, batch):
        loss, grads = loss_and_grads(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return train_step


def make_eval_step(graphdef, compute_dtype, pipeline=None):
    """(params, batch in slots) -> the mean cross-entropy over its real rows (padding computed)."""
    from shardflow.train.steps import make_loss_fn

    loss_fn = make_loss_fn(graphdef, compute_dtype, pipeline)

    def eval_step(params, batch):
        return loss_fn(params, *(_slot_minor(batch[k]) for k in ("inputs", "targets", "weights")))[0]

    return eval_step


def _slot_minor(a):
    """[slots, rows, ...] -> [rows * slots, ...]: sf.pipeline's micro-batch i is rows i, i + m, ...
    of each device's block, here a replica's rows of slot i, its block staying on its own
    devices (a local reshape)."""
    return a.swapaxes(0, 1).reshape((-1,) + a.shape[2:])


def _slot_gradients(graphdef, compute_dtype, _):
    """The slots in a scan, each row's mean next-token cross-entropy under ``sf.predicated`` by
    its weight: a device whose rows of a slot are all padding skips it."""
    import jax
    import jax.numpy as jnp

    import shardflow as sf
    from shardflow import models
    from shardflow.models.pipeline import row_cross_entropy

    def per_row(params, inputs, targets):
        model = models.for_compute(graphdef, params, compute_dtype)
        return row_cross_entropy(*model.features(inputs), targets)

    def slot_loss(params, inputs, targets, weights):
        return jnp.sum(sf.predicated(per_row, weights, params, inputs, targets))

    grad_fn = jax.value_and_grad(slot_loss)

    def loss_and_grads(params, batch):
        def accumulate(total, slot):
            return jax.tree.map(jnp.add, total, grad_fn(params, slot["inputs"], slot["targets"], slot["weights"])), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(accumulate, zeros, batch)
        rows = jnp.sum(batch["weights"])
        return loss / rows, jax.tree.map(lambda g: g / rows, grads)

    return loss_and_grads


def _pipelined_gradients(graphdef, compute_dtype, pipeline):
    """The model's pipelined loss with the rows weighted: slot i of every replica is the
    pipeline's micro-batch i, padding rows weighing zero (computed, not skipped)."""
    import jax

    from shardflow.train.steps import make_loss_fn

    grad_fn = jax.value_and_grad(make_loss_fn(graphdef, compute_dtype, pipeline), has_aux=True)

    def loss_and_grads(params, batch):
        rows = {k: _slot_minor(a) for k, a in batch.items()}
        (loss, _), grads = grad_fn(params, rows["inputs"], rows["targets"], rows["weights"])
        return loss, grads

    return loss_and_grads
