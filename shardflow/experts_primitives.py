"""The routed-experts primitives: every token choice through its expert's SwiGLU, dropless.

`shardflow.experts.routed_experts` shows in a jaxpr as one unit:

* forward: ``sf_experts_fwd[config=...]`` with operands ``(x, experts, w_gate, w_up, w_down)``
  and one result ``h``: x [..., embed] the tokens, experts [..., k] int32 the experts each token
  chose, the weights [n_experts, embed, ffn] / [n_experts, ffn, embed]; h [..., k, embed] each
  choice's expert output (ungated: the gates multiply outside, where JAX differentiates them);
* backward: ``sf_experts_bwd[config=...]`` with operands ``(x, experts, w_gate, w_up, w_down,
  dh)`` and results ``(dx, dw_gate, dw_up, dw_down)``. It recomputes the forward's activations
  from its operands: every residual is then an operand with an ordinary layout, where saved
  activations would live in the experts' devices' data-dependent row order.

On one device the choices are sorted by expert and the experts run as grouped GEMMs
(``jax.lax.ragged_dot``) over the sorted rows; no [tokens, experts x ffn] buffer exists. With
the experts split over a mesh axis, the primitives' rule (`shardflow.experts_rule`) sends each
choice to its expert's device and the result back: ``config.exchange`` says how.
"""

from __future__ import annotations

import dataclasses

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


def ragged_swiglu(rows, group_sizes, w_gate, w_up, w_down):
    """SwiGLU of ``rows`` [m, embed] sorted by expert, ``group_sizes[e]`` rows for expert e, as
    ``jax.lax.ragged_dot`` grouped GEMMs; rows past the groups give zeros."""
    gate = jax.nn.silu(jax.lax.ragged_dot(rows, w_gate, group_sizes))
    return jax.lax.ragged_dot(gate * jax.lax.ragged_dot(rows, w_up, group_sizes), w_down, group_sizes)


def tiled_swiglu(tiled, layout, w_gate, w_up, w_down):
    """The same by our Mosaic GPU grouped GEMMs, on rows in their tile-aligned layout."""

    def gmm(lhs, w):
        return grouped_matmul_mgpu.gmm(lhs, w, layout.tile_groups, layout.group_tiles)

    return gmm(jax.nn.silu(gmm(tiled, w_gate)) * gmm(tiled, w_up), w_down)


def sorted_ffn(rows, ids, w_gate, w_up, w_down, repeats: int = 1):
    """Choice i, row ``i // repeats`` of ``rows`` [n, embed], through expert ``ids[i]`` of the
    weights: [n * repeats, embed]. An id out of range (n_experts: a row of another device's
    expert, or padding) gives zeros.

    The choices run sorted by expert as grouped GEMMs: on Hopper, where our kernels take the
    shapes, by them (6-13x ``jax.lax.ragged_dot``'s TFLOP/s on one H100 at the MoE presets'
    shapes, benchmarks/results/moe.md), each choice's row moved once into its place in the
    tile-aligned layout and its result read once from there; elsewhere by ragged_dot. Every
    move is a permutation (unique indices) and a row's copies are a repeat, so the backward
    moves them back by gathers, scatters without atomics and a sum over the copies."""
    n_experts, (m,) = w_gate.shape[0], ids.shape
    ids = jnp.where((ids >= 0) & (ids < n_experts), ids, n_experts)
    choices = jnp.repeat(rows, repeats, axis=0) if repeats > 1 else rows
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=n_experts).astype(jnp.int32)
    if not all(grouped_matmul_mgpu.supports(rows, w) for w in (w_gate, w_down)):
        out = ragged_swiglu(choices.at[order].get(unique_indices=True), sizes, w_gate, w_up, w_down)
        return jnp.zeros_like(out).at[order].set(out, unique_indices=True)
    layout = grouped_matmul_mgpu.tile_layout(sizes, m)
    at = jnp.zeros(m, jnp.int32).at[order].set(layout.placed, unique_indices=True)
    tiled = jnp.zeros((layout.rows, rows.shape[1]), rows.dtype).at[at].set(choices, mode="drop", unique_indices=True)
    out = tiled_swiglu(tiled, layout, w_gate, w_up, w_down)
    return out.at[at].get(mode="fill", fill_value=0, unique_indices=True)


def routed_ffn(x, experts, w_gate, w_up, w_down, first_expert=0):
    """h [..., k, embed]: token i's choice j through expert ``experts[i, j] - first_expert`` of
    the weights given (zero where that is not one of them)."""
    k, d = experts.shape[-1], x.shape[-1]
    h = sorted_ffn(x.reshape(-1, d), experts.reshape(-1) - first_expert, w_gate, w_up, w_down, repeats=k)
    return h.reshape(*experts.shape, d)


def sf_experts_fwd(config: ExpertsConfig, x, experts, w_gate, w_up, w_down):
    return (routed_ffn(x, experts, w_gate, w_up, w_down),)


def sf_experts_bwd(config: ExpertsConfig, x, experts, w_gate, w_up, w_down, dh):
    _, vjp = jax.vjp(lambda x, *w: routed_ffn(x, experts, *w), x, w_gate, w_up, w_down)
    return vjp(dh)


sf_experts_fwd_p = kernel_primitive("sf_experts_fwd", sf_experts_fwd)
sf_experts_bwd_p = kernel_primitive("sf_experts_bwd", sf_experts_bwd)
