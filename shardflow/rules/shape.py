"""Shape ops: broadcasts, reshapes, transposes, concatenation, stacking, sorting, iota."""

from __future__ import annotations

from jax import lax

from shardflow import _compat
from shardflow.registry import Sig, defrule
from shardflow.rules.elementwise import every, rank, shape
from shardflow.specs import P, S


def _lower_broadcast_in_dim(local, eqn, ins):
    return lax.broadcast_in_dim_p.bind(
        ins[0],
        shape=local.shape(eqn.outvars[0]),
        broadcast_dimensions=eqn.params["broadcast_dimensions"],
        sharding=None,
    )


@defrule(lax.broadcast_in_dim_p, lower=_lower_broadcast_in_dim)
def _broadcast_in_dim(eqn):
    x = eqn.invars[0]
    out_shape, bdims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    # No B -> S(new dim) signature: a broadcast of a B value stays B, and its users slice it
    # for free where they need it split.
    sigs = [Sig((S(d),), (S(e),)) for d, e in enumerate(bdims) if shape(x)[d] == out_shape[e]]
    sigs.append(Sig((P,), (P,)))
    return sigs


def reshape_groups(in_shape, out_shape):
    """Pairs (in dim, out dim): the leading non-unit dims of the contiguous dim groups that a
    reshape maps onto each other. Splitting such an in dim splits its out dim the same way."""

    def leading(shape, lo, hi):
        return next((d for d in range(lo, hi) if shape[d] > 1), None)

    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj, a, b = i, j, 1, 1
        while True:
            if a <= b and i < len(in_shape):
                a *= in_shape[i]
                i += 1
            elif j < len(out_shape):
                b *= out_shape[j]
                j += 1
            else:
                break
            if a == b and a > 1 or (i == len(in_shape) and j == len(out_shape)):
                break
        d, e = leading(in_shape, gi, i), leading(out_shape, gj, j)
        if d is not None and e is not None:
            groups.append((d, e))
    return groups


def _lower_reshape(local, eqn, ins):
    return lax.reshape(ins[0], local.shape(eqn.outvars[0]), dimensions=eqn.params.get("dimensions"))


@defrule(lax.reshape_p, lower=_lower_reshape)
def _reshape(eqn):
    x = eqn.invars[0]
    if eqn.params.get("dimensions") is not None or len(eqn.invars) > 1:
        return []
    groups = reshape_groups(shape(x), eqn.params["new_sizes"])
    return [Sig((S(d),), (S(e),)) for d, e in groups if shape(x)[d] > 1] + [Sig((P,), (P,))]


@defrule(lax.transpose_p)
def _transpose(eqn):
    perm = eqn.params["permutation"]
    return [Sig((S(p),), (S(i),)) for i, p in enumerate(perm)] + [Sig((P,), (P,))]


@defrule(lax.rev_p)
def _rev(eqn):
    dims = eqn.params["dimensions"]
    return [Sig((S(d),), (S(d),)) for d in range(rank(eqn.invars[0])) if d not in dims] + [Sig((P,), (P,))]


@defrule(lax.squeeze_p)
def _squeeze(eqn):
    dims = eqn.params["dimensions"]
    kept = [d for d in range(rank(eqn.invars[0])) if d not in dims]
    return [Sig((S(d),), (S(i),)) for i, d in enumerate(kept)] + [Sig((P,), (P,))]


@defrule(lax.concatenate_p)
def _concatenate(eqn):
    n, r, axis = len(eqn.invars), rank(eqn.outvars[0]), eqn.params["dimension"]
    return [Sig(every(n, S(d)), (S(d),)) for d in range(r) if d != axis] + [Sig(every(n, P), (P,))]


@defrule(_compat.stack_p)
def _stack(eqn):
    n, axis = len(eqn.invars), eqn.params["axis"]
    return [Sig(every(n, S(d)), (S(d if d < axis else d + 1),)) for d in range(rank(eqn.invars[0]))] + [
        Sig(every(n, P), (P,))
    ]


@defrule(_compat.unstack_p)
def _unstack(eqn):
    n, axis = len(eqn.outvars), eqn.params["axis"]
    return [Sig((S(d),), every(n, S(d if d < axis else d - 1))) for d in range(rank(eqn.invars[0])) if d != axis] + [
        Sig((P,), every(n, P))
    ]


@defrule(lax.split_p)
def _split(eqn):
    axis, n = eqn.params["axis"], len(eqn.outvars)
    return [Sig((S(d),), every(n, S(d))) for d in range(rank(eqn.invars[0])) if d != axis] + [Sig((P,), every(n, P))]


@defrule(lax.sort_p)
def _sort(eqn):
    n, dim = len(eqn.invars), eqn.params["dimension"]
    return [Sig(every(n, S(d)), every(n, S(d))) for d in range(rank(eqn.invars[0])) if d != dim]


@defrule(lax.top_k_p)
def _top_k(eqn):
    return [Sig((S(d),), (S(d), S(d))) for d in range(rank(eqn.invars[0]) - 1)]


def _lower_iota(local, eqn, ins):
    out = eqn.outvars[0]
    dim, dtype = eqn.params["dimension"], eqn.params["dtype"]
    local_shape = local.shape(out)
    x = lax.broadcasted_iota(dtype, local_shape, dim)
    idx, count = local.shard_index(out, dim)
    if count > 1:
        x = x + (idx * local_shape[dim]).astype(dtype)
    return x


defrule(lax.iota_p, lower=_lower_iota)
