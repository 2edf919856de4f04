"""Mixture-of-Experts feed-forward layer: a top-k softmax router and SwiGLU experts.

Routing, two modes (``ModelConfig.routing``):

* ``"capacity"`` (GShard / Switch): the batch is cut into routing groups of
  ``ModelConfig.routing_group`` tokens (default: each sequence); an expert takes at most
  ``capacity = ceil(k * group * capacity_factor / n_experts)`` of a group's token choices,
  first choices of every token before second choices, in token order; the rest are dropped
  (their share of the layer's output is zero; the residual carries the token). Dispatch
  and combine are one-hot einsums over ``[batch, seq, experts, capacity]``, so the program is
  ordinary dense algebra a planner can shard: with the experts' weights split over a mesh axis
  the tokens reach their experts by an all-to-all of the ``[experts, batch, capacity, embed]``
  buffer.
* ``"dropless"`` (MegaBlocks): every choice is computed, by ``shardflow.experts.routed_experts``:
  the token choices sorted by expert, the experts run as grouped GEMMs over the sorted rows,
  and — with the experts split over a mesh axis that splits the tokens too — each choice sent
  to its expert's device and back, as the planner decides.

Balancing (``ModelConfig.balance``): ``"aux_loss"`` adds Switch/GShard's auxiliary loss
``n_experts * sum_e f_e * p_e`` (f_e the fraction of choices routed to e, p_e its mean router
probability, over the whole batch) times ``aux_loss_weight``; ``"bias"`` is DeepSeek-V3's
aux-loss-free balancing: a per-expert bias, not trained by gradient, is added to the router's
scores for selection only and moved by ``bias_rate * sign(mean load - load)`` after each step
(:func:`updated_router_bias`). ``z_loss_weight`` adds the router z-loss (ST-MoE).

Each layer returns its statistics with its output (:class:`RoutingStats`): the loss terms, the
tokens routed to each expert before capacity and the choices dropped; the trainer logs them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardflow.experts import routed_experts

from . import sharding as model_sharding
from .config import ModelConfig
from .sharding import logical_axes


class RouterBias(nnx.Variable):
    """Aux-loss-free balancing's per-expert selection bias: state, not a parameter. It travels
    with the parameters, but no gradient reaches it (selection only, under stop_gradient) and
    it is 1-D per layer (no weight decay), so the optimizer's update of it is exactly zero; the
    train step moves it by :func:`rebalanced` after each update."""


class RoutingStats(NamedTuple):
    aux_loss: jax.Array  # Switch/GShard balance loss (unweighted), fp32 scalar
    z_loss: jax.Array  # mean squared logsumexp of the router logits, fp32 scalar
    load: jax.Array  # [experts] token choices routed to each expert, before capacity, fp32
    dropped: jax.Array  # token choices dropped by capacity, fp32 scalar


def capacity(group: int, k: int, n_experts: int, capacity_factor: float) -> int:
    """Token choices one expert takes from one routing group of ``group`` tokens."""
    return max(1, math.ceil(k * group * capacity_factor / n_experts))


def in_groups(group: int, *values):
    """``values`` [batch, seq, ...] as [groups, group, ...]: whole sequences or equal parts of
    one (a group of several sequences lies on one device where the batch is split, if the
    per-device batch holds whole groups; else the queues cross devices)."""
    batch, seq = values[0].shape[:2]
    if (batch * seq) % group or (group % seq and seq % group):
        raise ValueError(
            f"model.routing_group ({group}) must be a multiple or a divisor of the sequence length ({seq}) "
            f"dividing the batch's {batch * seq} tokens"
        )
    return [v.reshape(batch * seq // group, group, *v.shape[2:]) for v in values]


def route(logits, k: int, bias=None):
    """Top-k routing of fp32 router ``logits`` [..., experts]: (gates [..., k] summing to one,
    experts [..., k] int32, probabilities [..., experts]). ``bias`` shifts the selection only."""
    probs = jax.nn.softmax(logits, axis=-1)
    scores = probs if bias is None else probs + jax.lax.stop_gradient(bias)
    _, experts = jax.lax.top_k(scores, k)
    gates = jnp.take_along_axis(probs, experts, axis=-1)
    return gates / gates.sum(-1, keepdims=True), experts.astype(jnp.int32), probs


def balance_loss(probs, experts, n_experts: int):
    """Switch Transformer's auxiliary loss over every token of ``probs`` [..., experts]."""
    k = experts.shape[-1]
    chosen = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32).sum(-2)  # [..., experts]
    fraction = chosen.reshape(-1, n_experts).mean(0) / k
    return n_experts * jnp.sum(fraction * probs.reshape(-1, n_experts).mean(0))


def capacity_slots(experts, n_experts: int, cap: int):
    """Where each choice of ``experts`` [groups, group, k] lands in its expert's queue of its
    routing group: (slot [groups, group, k] int32, kept [groups, group, k] bool). Choices queue
    by rank (every token's first choice before any second choice), then by token."""
    b, s, k = experts.shape
    chosen = jax.nn.one_hot(experts, n_experts, dtype=jnp.int32)  # [b, s, k, e]
    by_rank = chosen.transpose(0, 2, 1, 3).reshape(b, k * s, n_experts)
    before = jnp.cumsum(by_rank, axis=1) - by_rank
    slot = (before * by_rank).sum(-1).reshape(b, k, s).transpose(0, 2, 1)
    return slot, slot < cap


def swiglu_experts(x, w_gate, w_up, w_down):
    """The experts' SwiGLU on their own tokens: x [experts, ..., embed] -> same shape."""
    gate = jax.nn.silu(jnp.einsum("e...d,edf->e...f", x, w_gate))
    return jnp.einsum("e...f,efd->e...d", gate * jnp.einsum("e...d,edf->e...f", x, w_up), w_down)


def capacity_experts(x, gates, experts, w_gate, w_up, w_down, capacity_factor: float):
    """Capacity-mode MoE of x [groups, group, embed] (each row a routing group: a sequence, or
    ``in_groups``'s): (y, dropped choices)."""
    n_experts = w_gate.shape[0]
    cap = capacity(x.shape[1], experts.shape[-1], n_experts, capacity_factor)
    slot, kept = capacity_slots(experts, n_experts, cap)
    where = jax.nn.one_hot(experts, n_experts, dtype=x.dtype) * kept[..., None]  # [b, s, k, e]
    at = jax.nn.one_hot(slot, cap, dtype=x.dtype)  # [b, s, k, c]
    dispatch = jnp.einsum("bske,bskc->bsec", where, at)
    combine = jnp.einsum("bsk,bske,bskc->bsec", gates.astype(x.dtype), where, at)
    routed = jnp.einsum("bsec,bsd->ebcd", dispatch, x)
    y = jnp.einsum("bsec,ebcd->bsd", combine, swiglu_experts(routed, w_gate, w_up, w_down))
    return y, jnp.sum(~kept).astype(jnp.float32)


def dropless_experts(x, gates, experts, w_gate, w_up, w_down):
    """Dropless MoE of x [..., embed]: every token choice through its expert
    (`shardflow.experts.routed_experts`: grouped GEMMs over the choices sorted by expert, and
    expert parallelism where the planner splits the experts), weighted by its gate. Where the
    trainer's rules split no mesh axis by expert, the backward takes the forward's activations
    (six grouped GEMMs, not eight); where they do, or no rules are set, it recomputes them and
    the experts may be exchanged."""
    keep = model_sharding.active_mesh_axes("expert") == ()
    h = routed_experts(x, experts, w_gate, w_up, w_down, keep_activations=keep)
    return jnp.einsum("...k,...kd->...d", gates.astype(x.dtype), h)


def _normal(rngs: nnx.Rngs, shape, std):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


@logical_axes(
    router=("embed", None),
    bias=("expert",),
    w_gate=("expert", "embed", "mlp"),
    w_up=("expert", "embed", "mlp"),
    w_down=("expert", "mlp", "embed"),
)
class MoE(nnx.Module):
    """Routed SwiGLU experts, plus ``shared`` (an always-on feed-forward layer: DeepSeek's shared
    experts) where given: x [batch, seq, embed] -> (y, RoutingStats)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, shared: nnx.Module | None = None):
        d, e, f = cfg.d_model, cfg.n_experts, cfg.expert_ffn_dim
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.router = _normal(rngs, (d, e), cfg.init_std)
        self.w_gate = _normal(rngs, (e, d, f), cfg.init_std)
        self.w_up = _normal(rngs, (e, d, f), cfg.init_std)
        self.w_down = _normal(rngs, (e, f, d), out_std)
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32)) if cfg.balance == "bias" else None
        self.shared = shared
        self.k, self.routing, self.capacity_factor = cfg.experts_per_token, cfg.routing, cfg.capacity_factor
        self.routing_group = cfg.routing_group
        self.bias_rate = cfg.bias_rate

    def __call__(self, x):
        logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), self.router[...])
        bias = None if self.bias is None else self.bias[...]
        gates, experts, probs = route(logits, self.k, bias)
        weights = self.w_gate[...], self.w_up[...], self.w_down[...]
        if self.routing == "capacity":
            grouped = in_groups(self.routing_group or x.shape[1], x, gates, experts)
            y, dropped = capacity_experts(*grouped, *weights, self.capacity_factor)
            y = y.reshape(x.shape)
        else:
            y, dropped = dropless_experts(x, gates, experts, *weights), jnp.zeros((), jnp.float32)
        if self.shared is not None:
            y = y + self.shared(x)
        n_experts = probs.shape[-1]
        stats = RoutingStats(
            aux_loss=balance_loss(probs, experts, n_experts),
            z_loss=jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
            load=jax.nn.one_hot(experts, n_experts, dtype=jnp.float32).sum((0, 1, 2)),
            dropped=dropped,
        )
        return y, stats


def updated_router_bias(bias, load, rate: float):
    """Aux-loss-free balancing's step: each expert's bias moves towards the mean load by
    ``rate`` times its relative imbalance (mean - load) / mean, up when it took fewer choices
    than the mean, down when more. DeepSeek-V3 moves it by ``rate`` times the sign; near
    balance the sign keeps every bias swinging by the full step, so whole blocks of tokens with
    near-equal scores flip between experts from step to step (on the embedded corpus: busiest
    expert 1.21-1.49x the mean and 1.2 % dropped, against 1.17-1.20x and 0.1 % this way)."""
    mean = load.mean(-1, keepdims=True)
    return bias + rate * (mean - load) / jnp.maximum(mean, 1.0)


def rebalanced(graphdef, state, load):
    """``state`` (a model's pure dict) with every MoE layer's RouterBias moved one
    aux-loss-free step by its layers' ``load`` [moe layers, experts]; the same state where no
    layer balances by bias."""
    model = nnx.merge(graphdef, state)
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE) and m.bias is not None]
    if not layers:
        return state
    for layer in layers:  # one stacked MoE over depth: its bias is [moe layers, experts]
        layer.bias[...] = updated_router_bias(layer.bias[...], load, layer.bias_rate)
    return nnx.to_pure_dict(nnx.state(model))
