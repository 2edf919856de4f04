"""The routed-experts primitives: every token choice through its expert's SwiGLU, dropless.

`shardflow.experts.routed_experts` shows in a jaxpr as one unit:

* forward: ``sf_experts_fwd[config=...]`` with operands ``(x, experts, w_gate, w_up, w_down)``
  and results ``h`` and, where ``config.keep_activations``, ``activations``: x [..., embed] the
  tokens, experts [..., k] int32 the experts each token chose, the weights [n_experts, embed,
  ffn] / [n_experts, ffn, embed]; h [..., k, embed] each choice's expert output (ungated: the
  gates multiply outside, where JAX differentiates them); activations [..., k, 2, ffn] each
  choice's gate and up projections, in the tokens' order;
* backward: ``sf_experts_bwd[config=...]`` with operands ``(x, experts, w_gate, w_up, w_down,
  [activations,] dh)`` and results ``(dx, dw_gate, dw_up, dw_down)``. Without the forward's
  activations it recomputes them from its operands: every residual is then an operand with an
  ordinary layout, where under expert parallelism the activations live on the experts' devices
  in a data-dependent row order.

On one device the choices are sorted by expert and the experts run as grouped GEMMs
(``jax.lax.ragged_dot``) over the sorted rows; no [tokens, experts x ffn] buffer exists. With
the experts split over a mesh axis, the primitives' rule (`shardflow.experts_rule`) sends each
choice to its expert's device and the result back: ``config.exchange`` says how.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from shardflow.kernels import grouped_matmul_mgpu
from shardflow.primitives import kernel_primitive

EXCHANGES = ("auto", "ragged", "padded")


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    # How choices reach experts on other devices: "ragged" (jax.lax.ragged_all_to_all: exactly the
    # rows each device sends; GPU and TPU only) or "padded" (an all_to_all of buffers sized for
    # the worst case, every choice to one device: n_devices x the rows; any backend).
    exchange: str
    # Whether the forward also returns each choice's gate and up projections for the backward,
    # which then runs six grouped GEMMs instead of eight. Their rows stay with the tokens, so
    # the experts cannot then be split over an axis that splits the tokens (no "ep" layout).
    keep_activations: bool = False


def exchange_of(exchange: str) -> str:
    """The exchange ``exchange`` ("auto", "ragged", "padded") stands for on the default backend:
    "auto" is "ragged" where JAX lowers a ragged all-to-all (GPU, TPU), "padded" elsewhere. An
    explicit "ragged" is kept on CPU too: a plan for GPUs can be made and explained there, and
    lowering it is refused (`shardflow.experts_rule`)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"routed_experts: exchange must be one of {EXCHANGES}, got {exchange!r}")
    if exchange == "auto":
        return "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "padded"
    return exchange


class Sorted(NamedTuple):
    """Where ``m`` token choices sit once sorted by expert: on Hopper, where our kernels take the
    shapes, each choice's row in the kernels' tile-aligned layout (``layout``, ``at``); else at
    its rank in the sorted order, run by ``jax.lax.ragged_dot`` (``layout`` None)."""

    order: jax.Array  # [m] the choices in expert order
    sizes: jax.Array  # [n_experts] int32, the choices of each expert
    layout: grouped_matmul_mgpu.TileLayout | None
    at: jax.Array | None  # [m] each choice's row in the layout


def sort_choices(ids, rows, w_gate, w_down) -> Sorted:
    """The sort of choices with expert ``ids`` [m] (an id out of range sorts past every expert)."""
    n_experts, (m,) = w_gate.shape[0], ids.shape
    ids = jnp.where((ids >= 0) & (ids < n_experts), ids, n_experts)
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=n_experts).astype(jnp.int32)
    if not all(grouped_matmul_mgpu.supports(rows, w) for w in (w_gate, w_down)):
        return Sorted(order, sizes, None, None)
    layout = grouped_matmul_mgpu.tile_layout(sizes, m)
    return Sorted(order, sizes, layout, jnp.zeros(m, jnp.int32).at[order].set(layout.placed, unique_indices=True))


def to_sorted(s: Sorted, rows, repeats: int = 1):
    """The choices ``jnp.repeat(rows, repeats, axis=0)`` in their sorted places (the layout's gaps
    zero), each choice's row read from ``rows`` [n, ...] by one gather: the copies are never
    written."""
    if s.layout is None:
        return rows.at[s.order // repeats].get(unique_indices=repeats == 1)
    source = jnp.full(s.layout.rows, rows.shape[0], jnp.int32)  # a gap reads past the rows: zeros
    source = source.at[s.at].set(jnp.arange(s.at.shape[0], dtype=jnp.int32) // repeats, mode="drop")
    return rows.at[source].get(mode="fill", fill_value=0)


def from_sorted(s: Sorted, rows):
    """The inverse of ``to_sorted`` of the choices themselves: each choice's row, zero for a
    choice of no expert. Also its transpose (both are permutations): a gradient goes back
    through it."""
    if s.layout is None:
        return jnp.zeros_like(rows).at[s.order].set(rows, unique_indices=True)
    return rows.at[s.at].get(mode="fill", fill_value=0, unique_indices=True)


def grouped(s: Sorted, lhs, w):
    """Each sorted row of ``lhs`` by its expert's matrix of ``w`` [n_experts, K, N]."""
    if s.layout is None:
        return jax.lax.ragged_dot(lhs, w, s.sizes)
    return grouped_matmul_mgpu.gmm(lhs, w, s.layout.tile_groups, s.layout.group_tiles)


def grouped_grads(s: Sorted, lhs, w, dout):
    """(d lhs, d w) of ``grouped(s, lhs, w)`` at output gradient ``dout``, without its forward."""
    if s.layout is None:
        return jax.vjp(lambda lhs, w: jax.lax.ragged_dot(lhs, w, s.sizes), lhs, w)[1](dout)
    return grouped_matmul_mgpu.gmm_grads(lhs, w, dout, s.layout.tile_groups, s.layout.group_tiles)


def _gated(gate, up):
    return jax.nn.silu(gate) * up


def sorted_ffn(rows, ids, w_gate, w_up, w_down, repeats: int = 1, keep_activations: bool = False):
    """Choice i, row ``i // repeats`` of ``rows`` [n, embed], through expert ``ids[i]`` of the
    weights: [n * repeats, embed], and with ``keep_activations`` each choice's gate and up
    projections [n * repeats, 2, ffn] too. An id out of range (n_experts: a row of another
    device's expert, or padding) gives zeros.

    The choices run sorted by expert as grouped GEMMs: on Hopper, where our kernels take the
    shapes, by them (6-13x ``jax.lax.ragged_dot``'s TFLOP/s on one H100 at the MoE presets'
    shapes, benchmarks/results/moe.md), each choice's row moved once into its place in the
    tile-aligned layout and its result read once from there; elsewhere by ragged_dot. A row is
    read into each of its choices' places by one gather; every other move is a permutation
    (unique indices), and the backward (``sorted_ffn_grads``, not JAX's transpose of the
    forward) moves the gradients back by gathers and a sum over each row's choices: no
    scatter-add."""
    s = sort_choices(ids, rows, w_gate, w_down)
    x = to_sorted(s, rows, repeats)
    gate, up = grouped(s, x, w_gate), grouped(s, x, w_up)
    out = from_sorted(s, grouped(s, _gated(gate, up), w_down))
    return (out, from_sorted(s, jnp.stack([gate, up], 1))) if keep_activations else out


def sorted_ffn_grads(rows, ids, w_gate, w_up, w_down, d_out, activations=None, repeats: int = 1):
    """(d rows, d w_gate, d w_up, d w_down) of ``sorted_ffn`` at output gradient ``d_out``:
    six grouped GEMMs where its ``activations`` are given, eight where they are recomputed."""
    s = sort_choices(ids, rows, w_gate, w_down)
    x = to_sorted(s, rows, repeats)
    if activations is None:
        gate, up = grouped(s, x, w_gate), grouped(s, x, w_up)
    else:
        gate, up = (to_sorted(s, a) for a in jnp.unstack(activations, axis=1))
    hidden, gated_vjp = jax.vjp(_gated, gate, up)
    d_hidden, d_w_down = grouped_grads(s, hidden, w_down, to_sorted(s, d_out.astype(rows.dtype)))
    d_gate, d_up = gated_vjp(d_hidden)
    dx_gate, d_w_gate = grouped_grads(s, x, w_gate, d_gate)
    dx_up, d_w_up = grouped_grads(s, x, w_up, d_up)
    d_choices = from_sorted(s, dx_gate + dx_up)
    d_rows = d_choices.reshape(rows.shape[0], repeats, rows.shape[1]).sum(1) if repeats > 1 else d_choices
    return d_rows, d_w_gate, d_w_up, d_w_down


def routed_ffn(x, experts, w_gate, w_up, w_down, first_expert=0, keep_activations: bool = False):
    """h [..., k, embed]: token i's choice j through expert ``experts[i, j] - first_expert`` of
    the weights given (zero where that is not one of them); with ``keep_activations`` also each
    choice's gate and up projections [..., k, 2, ffn]."""
    k, d = experts.shape[-1], x.shape[-1]
    ids = experts.reshape(-1) - first_expert
    out = sorted_ffn(x.reshape(-1, d), ids, w_gate, w_up, w_down, k, keep_activations)
    if not keep_activations:
        return out.reshape(*experts.shape, d)
    h, activations = out
    return h.reshape(*experts.shape, d), activations.reshape(*experts.shape, *activations.shape[1:])


def routed_ffn_grads(x, experts, w_gate, w_up, w_down, dh, activations=None, first_expert=0):
    """(dx, d w_gate, d w_up, d w_down) of ``routed_ffn`` at ``dh`` [..., k, embed]."""
    k, d = experts.shape[-1], x.shape[-1]
    if activations is not None:
        activations = activations.reshape(-1, *activations.shape[-2:])
    ids = experts.reshape(-1) - first_expert
    dx, *d_weights = sorted_ffn_grads(x.reshape(-1, d), ids, w_gate, w_up, w_down, dh.reshape(-1, d), activations, k)
    return dx.reshape(x.shape), *d_weights


def sf_experts_fwd(config: ExpertsConfig, x, experts, w_gate, w_up, w_down):
    out = routed_ffn(x, experts, w_gate, w_up, w_down, keep_activations=config.keep_activations)
    return out if config.keep_activations else (out,)


def sf_experts_bwd(config: ExpertsConfig, x, experts, w_gate, w_up, w_down, *activations_and_dh):
    *activations, dh = activations_and_dh
    return routed_ffn_grads(x, experts, w_gate, w_up, w_down, dh, *activations)


sf_experts_fwd_p = kernel_primitive("sf_experts_fwd", sf_experts_fwd)
sf_experts_bwd_p = kernel_primitive("sf_experts_bwd", sf_experts_bwd)
