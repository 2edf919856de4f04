"""The fused linear cross-entropy primitives: logits computed a vocab tile at a time, never whole.

`shardflow.cross_entropy.linear_cross_entropy` shows in a jaxpr as one unit:

* forward: ``sf_linear_ce_fwd[config=...]`` with operands ``(h, w, targets)`` and results
  ``(loss, lse)``: h [..., d] the final hidden states, w [d, vocab] the output projection,
  targets [...] int32; loss [...] each token's cross-entropy and lse [...] its logits'
  log-sum-exp, both float32;
* backward: ``sf_linear_ce_bwd[config=...]`` with operands ``(h, w, targets, lse, g)``, g [...]
  the loss's cotangent, and results ``(dh, dw)``. It recomputes each logits tile from h and w.

Both walk w's columns in tiles of ``config.chunk``: the forward keeps an online log-sum-exp (a
running max and a sum of exponentials rescaled to it) and the target's logit; the backward
forms each tile's softmax minus the target's one-hot, scaled by g, adds its product with the
tile to dh and writes its product with h into dw's columns. No [tokens, vocab] buffer exists.
A vocab that is not a multiple of the tile ends with a tile shifted back to end at the vocab,
its columns already counted masked to -inf: exact, with no padded copy of w.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from shardflow.primitives import kernel_primitive


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig:
    chunk: int  # vocab columns per tile


def _tiling(vocab: int, chunk: int) -> tuple:
    """(tile width, tile count) over ``vocab`` columns."""
    width = min(chunk, vocab)
    return width, -(-vocab // width)


def _tile(h, w, i, width: int):
    """Tile i of w's columns and its float32 logits, the columns an earlier tile counted at -inf:
    (w's tile, the logits [tokens, width], the tile's column indices, which of them are new)."""
    start = jnp.minimum(i * width, w.shape[1] - width)
    w_tile = lax.dynamic_slice_in_dim(w, start, width, axis=1)
    columns = start + jnp.arange(width)
    new = columns >= i * width
    logits = jnp.where(new, jnp.dot(h, w_tile, preferred_element_type=jnp.float32), -jnp.inf)
    return w_tile, logits, columns, new


def tiled_statistics(h, w, targets, chunk: int, first_column=0):
    """Per token of h [tokens, d], over w's columns (column j is vocab entry first_column + j):
    (the logits' max, the sum of their exponentials less that max, the target's logit, zero
    where the target is not among the columns), each float32 [tokens]."""
    width, count = _tiling(w.shape[1], chunk)
    local_targets = (targets - first_column)[:, None]

    def tile(i, stats):
        running_max, sum_exp, target_logit = stats
        _, logits, columns, new = _tile(h, w, i, width)
        tile_max = jnp.maximum(running_max, logits.max(-1))
        sum_exp = sum_exp * jnp.exp(running_max - tile_max) + jnp.exp(logits - tile_max[:, None]).sum(-1)
        target_logit += jnp.where((columns == local_targets) & new, logits, 0.0).sum(-1)
        return tile_max, sum_exp, target_logit

    tokens = h.shape[0]
    init = (jnp.full(tokens, -jnp.inf), jnp.zeros(tokens), jnp.zeros(tokens))
    return lax.fori_loop(0, count, tile, init)


def tiled_gradients(h, w, targets, lse, g, chunk: int, first_column=0):
    """(dh [tokens, d], dw [d, columns]) of ``sum(g * cross_entropy)`` over w's columns, given
    each token's log-sum-exp ``lse`` over the whole vocab: w's columns' share of dh, all of dw."""
    width, count = _tiling(w.shape[1], chunk)
    local_targets = (targets - first_column)[:, None]
    compute = jnp.result_type(h, w)

    def tile(i, grads):
        dh, dw = grads
        w_tile, logits, columns, new = _tile(h, w, i, width)
        one_hot = (columns == local_targets) & new
        d_logits = ((jnp.exp(logits - lse[:, None]) - one_hot) * g[:, None]).astype(compute)
        dh += jnp.dot(d_logits, w_tile.T, preferred_element_type=jnp.float32)
        # the columns shared with the previous tile get exactly zero added
        start = columns[0]
        dw_tile = jnp.dot(h.T, d_logits, preferred_element_type=jnp.float32).astype(dw.dtype)
        dw = lax.dynamic_update_slice_in_dim(dw, lax.dynamic_slice_in_dim(dw, start, width, 1) + dw_tile, start, 1)
        return dh, dw

    init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, w.dtype))
    dh, dw = lax.fori_loop(0, count, tile, init)
    return dh.astype(h.dtype), dw


def _flat(h, targets):
    return h.reshape(-1, h.shape[-1]), targets.reshape(-1)


def token_losses(h, w, targets, chunk: int, first_column=0):
    """(loss, lse) [...]: the statistics of `tiled_statistics` on one device's whole vocab."""
    flat_h, flat_targets = _flat(h, targets)
    running_max, sum_exp, target_logit = tiled_statistics(flat_h, w, flat_targets, chunk, first_column)
    lse = running_max + jnp.log(sum_exp)
    return (lse - target_logit).reshape(targets.shape), lse.reshape(targets.shape)


def token_gradients(h, w, targets, lse, g, chunk: int, first_column=0):
    flat_h, flat_targets = _flat(h, targets)
    dh, dw = tiled_gradients(flat_h, w, flat_targets, lse.reshape(-1), g.reshape(-1), chunk, first_column)
    return dh.reshape(h.shape), dw


def sf_linear_ce_fwd(config: CrossEntropyConfig, h, w, targets):
    return token_losses(h, w, targets, config.chunk)


def sf_linear_ce_bwd(config: CrossEntropyConfig, h, w, targets, lse, g):
    return token_gradients(h, w, targets, lse, g, config.chunk)


sf_linear_ce_fwd_p = kernel_primitive("sf_linear_ce_fwd", sf_linear_ce_fwd)
sf_linear_ce_bwd_p = kernel_primitive("sf_linear_ce_bwd", sf_linear_ce_bwd)
