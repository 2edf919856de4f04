"""`routed_experts`: dropless mixture-of-experts feed-forward, one unit the compiler lays out.

It runs as the primitives of `shardflow.experts_primitives` (one forward, one backward under
differentiation); shardflow's passes lay them out by their rule in `shardflow.experts_rule`:
with the experts' weights split over a mesh axis that also splits the tokens, the choices
travel to their experts' devices and back (expert parallelism), without a line of it in the
model.
"""

from __future__ import annotations

import functools

import jax

from shardflow import experts_rule  # noqa: F401  (registers the primitives' sharding rule)
from shardflow.experts_primitives import ExpertsConfig, exchange_of, sf_experts_bwd_p, sf_experts_fwd_p


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _routed(config, x, experts, w_gate, w_up, w_down):
    return sf_experts_fwd_p.bind(x, experts, w_gate, w_up, w_down, config=config)[0]


def _routed_fwd(config, x, experts, *weights):
    h, *activations = sf_experts_fwd_p.bind(x, experts, *weights, config=config)
    return h, (x, experts, *weights, *activations)


def _routed_bwd(config, residuals, dh):
    dx, *d_weights = sf_experts_bwd_p.bind(*residuals, dh.astype(residuals[0].dtype), config=config)
    return (dx, None, *d_weights)


_routed.defvjp(_routed_fwd, _routed_bwd)


def routed_experts(x, experts, w_gate, w_up, w_down, *, exchange: str = "auto", keep_activations: bool = False):
    """Each token's chosen experts' SwiGLU outputs, every choice computed (dropless).

    x [..., embed]; experts [..., k] int32, the experts each token chose; w_gate and w_up
    [n_experts, embed, ffn], w_down [n_experts, ffn, embed]. Returns h [..., k, embed], choice
    j of token i through expert ``experts[i, j]``, not yet weighted by its gate. ``exchange``:
    how choices reach experts on other devices under expert parallelism — "ragged" (a ragged
    all-to-all; GPU and TPU), "padded" (an all-to-all of worst-case buffers; any backend) or
    "auto" (ragged where it lowers). ``keep_activations``: the forward keeps each choice's gate
    and up projections ([..., k, 2, ffn], with the tokens) for the backward, which then runs six
    grouped GEMMs instead of eight; the experts can then not be split over an axis that splits
    the tokens (expert parallelism), so keep them where they are not."""
    if experts.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"routed_experts: experts {experts.shape} must be x's {x.shape[:-1]} plus k")
    n_experts, d, f = w_gate.shape
    if x.shape[-1] != d or w_up.shape != w_gate.shape or w_down.shape != (n_experts, f, d):
        raise ValueError(
            f"routed_experts: x {x.shape}, w_gate {w_gate.shape}, w_up {w_up.shape}, w_down {w_down.shape}: "
            "want w_gate and w_up [n_experts, embed, ffn] and w_down [n_experts, ffn, embed]"
        )
    config = ExpertsConfig(exchange_of(exchange), keep_activations)
    return _routed(config, x, experts.astype("int32"), w_gate, w_up, w_down)
