"""`linear_cross_entropy`: a linear layer and the cross-entropy of its logits as one unit, the
logits computed a vocab tile at a time and never held whole, forward or backward.

It runs as the primitives of `shardflow.cross_entropy_primitives` (one forward, one backward
under differentiation); shardflow's passes lay them out by their rule in
`shardflow.cross_entropy_rule`: split over the tokens, or, with w split over the vocab,
Megatron's vocab-parallel cross-entropy (an all-reduce of per-token statistics, never of
logits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from shardflow import cross_entropy_rule  # noqa: F401  (registers the primitives' sharding rule)
from shardflow.cross_entropy_primitives import CrossEntropyConfig, sf_linear_ce_bwd_p, sf_linear_ce_fwd_p


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(config, h, w, targets):
    return sf_linear_ce_fwd_p.bind(h, w, targets, config=config)[0]


def _fused_fwd(config, h, w, targets):
    loss, lse = sf_linear_ce_fwd_p.bind(h, w, targets, config=config)
    return loss, (h, w, targets, lse)


def _fused_bwd(config, residuals, g):
    h, w, targets, lse = residuals
    dh, dw = sf_linear_ce_bwd_p.bind(h, w, targets, lse, g.astype(jnp.float32), config=config)
    return dh, dw, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def linear_cross_entropy(h, w, targets, *, chunk: int = 4096):
    """Each token's cross-entropy (float32) of the logits ``h @ w`` against ``targets``.

    h [..., d], w [d, vocab], targets [...] integer; returns [...] float32, equal to
    ``optax.softmax_cross_entropy_with_integer_labels((h @ w).astype(float32), targets)`` with
    the logits computed in float32. They are computed ``chunk`` vocab columns at a time
    (forward: an online log-sum-exp; backward: each tile recomputed), so memory beyond the
    operands and w's gradient grows with tokens x chunk, not tokens x vocab. A target outside
    [0, vocab) (an ignored position) counts its log-sum-exp alone."""
    if w.ndim != 2 or h.shape[-1] != w.shape[0] or h.shape[:-1] != targets.shape:
        raise ValueError(
            f"linear_cross_entropy: h {h.shape}, w {w.shape}, targets {targets.shape}: "
            "want h [..., d], w [d, vocab] and targets h's leading dims"
        )
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk must be a positive int, got {chunk!r}")
    dtype = jnp.result_type(h, w)
    return _fused(CrossEntropyConfig(chunk), h.astype(dtype), w.astype(dtype), targets.astype(jnp.int32))
