"""The sharding rule of the fused linear cross-entropy primitives.

Per mesh axis, one of:

* "tokens": h, the targets and the per-token results split along one of the tokens' dims, w
  whole on every device; w's gradient is a partial sum over the token shards.
* "vocab": w split over its columns (Megatron's vocab-parallel cross-entropy). Each device
  walks its own tiles for its tokens' local max, sum of exponentials and target logit (zero
  unless the target is one of its columns); an all-reduce of the [tokens] maxima and then
  one of the rescaled sums and the target logits combine them. The backward needs no
  collective: with the global log-sum-exp each device forms its columns' softmax, dw's
  columns are its own and dh is a partial sum over the vocab shards. Neither the logits nor w
  ever move.

No signature splits the model dim d (h's last, w's first): each tile's logits would be a
partial sum, reduced before its softmax — an all-reduce of every [tokens, tile] logits tile,
the very bytes this unit exists to avoid. Such an h or w is gathered first.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from shardflow.conversion import Step
from shardflow.cross_entropy_primitives import (
    sf_linear_ce_bwd_p,
    sf_linear_ce_fwd_p,
    tiled_statistics,
    token_gradients,
    token_losses,
)
from shardflow.registry import Sig, decision_of, defrule
from shardflow.specs import B, P, S, local_shape


def _operand_names(eqn) -> tuple:
    return ("h", "w", "targets") + (("lse", "g") if eqn.primitive is sf_linear_ce_bwd_p else ())


def _result_names(eqn) -> tuple:
    return ("dh", "dw") if eqn.primitive is sf_linear_ce_bwd_p else ("loss", "lse")


def _sig(eqn, layout: dict, name: str) -> Sig:
    return Sig(
        tuple(layout.get(n, B) for n in _operand_names(eqn)), tuple(layout.get(n, B) for n in _result_names(eqn)), name
    )


def _cross_entropy_signatures(eqn):
    per_token = ("h", "targets", "lse", "g", "loss", "dh")
    sigs = [_sig(eqn, {**{n: S(dim) for n in per_token}, "dw": P}, "tokens") for dim in range(eqn.invars[2].aval.ndim)]
    sigs.append(_sig(eqn, {"w": S(1), "dw": S(1), "dh": P}, "vocab"))
    return sigs


def _local_cross_entropy(local, eqn, ins):
    vocab_axes = tuple(local.names[i] for i in decision_of(eqn).named("vocab"))
    first_column = local.shard_index(eqn.invars[1], 1)[0] * ins[1].shape[1] if vocab_axes else 0
    chunk = eqn.params["config"].chunk
    if eqn.primitive is sf_linear_ce_bwd_p:
        return list(token_gradients(*ins, chunk=chunk, first_column=first_column))
    if not vocab_axes:
        return list(token_losses(*ins, chunk=chunk))
    h, w, targets = ins
    local_max, sum_exp, target_logit = tiled_statistics(
        h.reshape(-1, h.shape[-1]), w, targets.reshape(-1), chunk, first_column
    )
    global_max = lax.pmax(local_max, vocab_axes)
    sum_exp, target_logit = lax.psum(jnp.stack([sum_exp * jnp.exp(local_max - global_max), target_logit]), vocab_axes)
    lse = global_max + jnp.log(sum_exp)
    return [(lse - target_logit).reshape(targets.shape), lse.reshape(targets.shape)]


def _cross_entropy_comm(eqn, ins, sigs, mesh):
    """Under "vocab", forward: an all-reduce (max) of each local token's float32 maximum, then
    one (sum) of its rescaled sum of exponentials and target logit."""
    axes = tuple(a for a, s in zip(mesh.axis_names, sigs) if getattr(s, "name", None) == "vocab")
    if not axes or eqn.primitive is not sf_linear_ce_fwd_p:
        return []
    n = math.prod(dict(zip(mesh.axis_names, mesh.devices.shape))[a] for a in axes)
    tokens = math.prod(local_shape(eqn.invars[2].aval.shape, ins[2], mesh))

    def all_reduce(shape, op):
        value = jax.core.ShapedArray(shape, jnp.float32)
        return Step("all_reduce", axes, op=op, bytes=int(2 * (n - 1) * math.prod(shape) * 4 // n), value=value)

    return [all_reduce((tokens,), "max"), all_reduce((2, tokens), "sum")]


def _cross_entropy_flops(eqn, in_shapes, out_shapes):
    """One GEMM of the local tokens by the local columns forward; backward three (the logits
    recomputed, dh and dw)."""
    h, w = in_shapes[0], in_shapes[1]
    gemms = 3 if eqn.primitive is sf_linear_ce_bwd_p else 1
    return gemms * 2.0 * math.prod(h) * w[1]


defrule(
    sf_linear_ce_fwd_p,
    sf_linear_ce_bwd_p,
    lower=_local_cross_entropy,
    comm=_cross_entropy_comm,
    comm_reason="combines each token's log-sum-exp statistics over the vocab shards",
    flops=_cross_entropy_flops,
)(_cross_entropy_signatures)
