"""Uneven micro-batch counts per data replica (``replica_microbatches: [4, 4, 3, 1]``): a slower
replica takes less of the batch, in one SPMD program.

Every replica runs as many micro-batch slots as the busiest (``max(counts)``); replica r's
slots past its own count hold padding rows of weight zero, which ``sf.predicated`` lets its
devices skip (no work, no waiting: the conditional is on each device's own rows). Each real
row weighs one, and the step's loss and gradients are the sums over real rows divided by their
number: the homogeneous step's mean over the same global batch.

Partial: dense models (an MoE's routing couples the rows of a micro-batch); data parallelism
over the data axes (FSDP's gathers would cross them: sf.predicated then runs every slot
everywhere, exact, and warns); one process (each process reads the whole batch).
"""

from __future__ import annotations

import numpy as np


def slots(counts, rows: int):
    """(index [slots, replicas * rows] of each slot row into the step's global batch, weight of
    each: 1 for a real row, 0 for padding). Replica r's rows are consecutive in the batch."""
    n_slots, start = max(counts), np.cumsum([0] + list(counts[:-1])) * rows
    index = np.zeros((n_slots, len(counts), rows), np.int64)
    weight = np.zeros(index.shape, np.float32)
    for r, count in enumerate(counts):
        for i in range(count):
            index[i, r] = start[r] + i * rows + np.arange(rows)
            weight[i, r] = 1.0
    return index.reshape(n_slots, -1), weight.reshape(n_slots, -1)


def global_batch(data, step: int, counts, rows: int, seq_len: int, seed: int, shardings):
    """{"inputs", "targets" [slots, replicas * rows, seq], "weights" [slots, replicas * rows]}: the
    step's global batch (the homogeneous step's rows) laid out in the replicas' slots."""
    import jax

    index, weight = slots(counts, rows)
    starts = data.window_starts(step, (1, sum(counts) * rows), seq_len, seed)[0]
    windows = data.windows(starts[index], seq_len)
    arrays = {"inputs": windows[..., :-1], "targets": windows[..., 1:], "weights": weight}
    return {k: jax.make_array_from_callback(a.shape, shardings[k], lambda i, a=a: a[i]) for k, a in arrays.items()}


def make_train_step(graphdef, optimizer, compute_dtype):
    """(params, opt_state, batch) -> (params, opt_state, {"loss", "grad_norm"}): the slots in a
    scan, each row's mean next-token cross-entropy under ``sf.predicated`` by its weight."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardflow as sf

    def per_row(params, inputs, targets):
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
        logits = model(inputs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)

    def slot_loss(params, inputs, targets, weights):
        return jnp.sum(sf.predicated(per_row, weights, params, inputs, targets))

    grad_fn = jax.value_and_grad(slot_loss)

    def train_step(params, opt_state, batch):
        def accumulate(total, slot):
            return jax.tree.map(jnp.add, total, grad_fn(params, slot["inputs"], slot["targets"], slot["weights"])), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(accumulate, zeros, batch)
        rows = jnp.sum(batch["weights"])
        loss, grads = loss / rows, jax.tree.map(lambda g: g / rows, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return train_step
