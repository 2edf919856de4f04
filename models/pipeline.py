"""The models' training loss, with the stacked layers optionally pipelined (``sf.pipeline``).

A model's ``loss(tokens, targets, pipeline=None)`` is the mean next-token cross-entropy. With
a :class:`PipelineConfig` the same loss is computed by ``sf.pipeline``: the embedding runs
before it, the stacked layers are its layers (one Block, merged from the stack's graphdef, as
``scan_layers`` runs it: the residual stream's ``constrain`` and the remat policy stay inside
the layer), and the final norm and the fused output projection and cross-entropy are its
head, the targets the head's per-micro-batch argument. Nothing in a model is schedule-specific; on one
device, or under ``sf.parallelize`` on a mesh with the pipeline axis, the numbers are the plain
loss's (up to float rounding: micro-batches are summed in another order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardflow.cross_entropy import linear_cross_entropy

from .config import REMAT_POLICIES
from .sharding import constrain

RESIDUAL = ("batch", "seq", None)  # logical axes of the residual stream between blocks


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How ``sf.pipeline`` runs the stacked layers: ``stages`` devices on mesh axis ``axis``
    (its size under ``sf.parallelize``), the batch cut into ``microbatches`` (strided: rows i,
    i + m, ... — a batch split over ``data`` stays split), ``schedule`` a name of
    ``shardflow.schedules.by_name`` or a ``Schedule``, ``chunks`` the layer chunks per stage
    (interleaved only; default 2), ``layers_per_stage`` an uneven split (``sf.pipeline``'s)."""

    stages: int
    microbatches: int
    schedule: Any = "1f1b"
    chunks: int | None = None
    axis: str = "pipe"
    layers_per_stage: tuple | None = None


def layer_step(graphdef, remat: str, *args) -> Callable:
    """``(h, layer_params) -> (h, stats)``: one layer of a stack split by ``nnx.split``
    (graphdef, the state of one layer), its output pinned to the residual stream's sharding,
    rematerialised under the model's remat policy; ``stats`` what a layer returns beside its
    output (an MoE layer's RoutingStats), else None. ``args`` (RoPE tables) are passed to every
    layer."""

    def step(x, layer_params):
        out = nnx.merge(graphdef, layer_params)(x, *args)
        x, stats = out if isinstance(out, tuple) else (out, None)
        return constrain(x, RESIDUAL), stats

    if remat != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return step


def scan_layers(layers: nnx.Module, x, remat: str, *args):
    """Run stacked layers over depth with lax.scan (one compiled layer, not n copies):
    (output, the layers' stats stacked over depth, or None)."""
    graphdef, params = nnx.split(layers)
    return jax.lax.scan(layer_step(graphdef, remat, *args), x, params)


def row_cross_entropy(hidden, weight, targets):
    """Each row's mean next-token cross-entropy in fp32 of the logits ``hidden @ weight``
    (hidden [batch, seq, d], weight [d, vocab]), fused: computed a vocab tile at a time, the
    logits never held whole (``shardflow.cross_entropy``): [batch]."""
    return linear_cross_entropy(hidden, weight, targets).mean(-1)


def cross_entropy(hidden, weight, targets, weights=None):
    """Mean next-token cross-entropy in fp32 of the logits ``hidden @ weight``, fused as
    :func:`row_cross_entropy`; with ``weights`` [batch], the rows' weighted mean (a row of
    weight zero contributes exactly nothing, to the loss or to any gradient)."""
    if weights is None:
        return row_cross_entropy(hidden, weight, targets).mean()
    return jnp.sum(row_cross_entropy(hidden, weight, targets) * weights) / jnp.sum(weights)


def pipelined_loss(
    layers: nnx.Module,
    x,
    targets,
    *,
    pipeline: PipelineConfig,
    remat: str,
    layer_args=(),
    head: Callable,
    head_params,
    layer_loss: Callable | None = None,
    weights=None,
):
    """(``cross_entropy(*head(head_params, layers(x)), targets, weights)``, None) with the stacked
    ``layers`` run by ``sf.pipeline`` in ``pipeline``'s stages, micro-batches and schedule; with
    ``layer_loss`` (of what a layer returns beside its output: an MoE layer's RoutingStats)
    each layer's term is added to the loss, differentiated on the stage that runs the layer,
    and the second result is those statistics stacked over depth, averaged over micro-batches.

    ``head(head_params, h) -> (hidden, weight)``, the logits' factors, is a pure function of
    its parameters (a pytree of arrays and nnx states), so that the pipeline owns its
    gradient; ``layer_args`` (RoPE tables) are closed over by the pipelined layer, so they must
    be values known at trace time.

    ``weights`` [batch] (None: every row weighs one) go to the head with the targets, scaled so
    that the pipeline's mean over micro-batches is their weighted mean over all rows: a
    micro-batch of zero weights (padding) adds exactly nothing, however many there are."""
    import shardflow as sf

    graphdef, params = nnx.split(layers)
    step = layer_step(graphdef, remat, *layer_args)

    def layer(layer_params, h):
        h, stats = step(h, layer_params)
        return h if layer_loss is None else (h, layer_loss(stats), stats)

    if weights is None:
        head_args = targets

        def head_loss(hp, h, targets):
            return cross_entropy(*head(hp, h), targets)
    else:
        schedule = pipeline.schedule
        m = schedule.microbatches if isinstance(schedule, sf.schedules.Schedule) else pipeline.microbatches
        head_args = (targets, weights * (m / jnp.sum(weights)))

        def head_loss(hp, h, targets_and_weights):
            targets, weights = targets_and_weights
            return jnp.sum(row_cross_entropy(*head(hp, h), targets) * weights)

    out = sf.pipeline(
        layer,
        params,
        x,
        head=head_loss,
        head_params=head_params,
        head_args=head_args,
        stages=pipeline.stages,
        microbatches=pipeline.microbatches,
        schedule=pipeline.schedule,
        chunks=pipeline.chunks,
        layers_per_stage=pipeline.layers_per_stage,
        axis=pipeline.axis,
    )
    return out if layer_loss is not None else (out, None)
