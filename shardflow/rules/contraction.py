"""dot_general, reductions and cumulative ops."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray

from shardflow.conversion import Step
from shardflow.registry import Sig, bind_params, decision_of, defrule
from shardflow.rules.elementwise import rank
from shardflow.specs import B, P, Partial, S, axis_sizes, local_shape, split_axes


def _dot_flops(eqn, in_shapes, out_shapes):
    (lc, _), _ = eqn.params["dimension_numbers"]
    return 2.0 * math.prod(out_shapes[0]) * math.prod(in_shapes[0][d] for d in lc)


@defrule(lax.dot_general_p, flops=_dot_flops)
def _dot_general(eqn):
    lhs, rhs = eqn.invars
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lfree = [d for d in range(rank(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(rank(rhs)) if d not in rc and d not in rb]
    sigs = [Sig((S(l), S(r)), (S(i),)) for i, (l, r) in enumerate(zip(lb, rb))]
    sigs += [Sig((S(l), B), (S(len(lb) + i),)) for i, l in enumerate(lfree)]
    sigs += [Sig((B, S(r)), (S(len(lb) + len(lfree) + i),)) for i, r in enumerate(rfree)]
    sigs += [Sig((S(l), S(r)), (P,)) for l, r in zip(lc, rc)]
    sigs += [Sig((P, B), (P,)), Sig((B, P), (P,))]
    return sigs


def _reduce(partial):
    """Reducing a split dim leaves a ``partial`` value (None: that dim must be whole)."""

    def signatures(eqn):
        axes = tuple(eqn.params["axes"])
        (x,) = eqn.invars
        sigs = []
        for d in range(rank(x)):
            if d in axes:
                if partial is not None and _partial_ok(partial, x):
                    sigs.append(Sig((S(d),), (partial,)))
            else:
                sigs.append(Sig((S(d),), (S(d - sum(a < d for a in axes)),)))
        if partial == P:
            sigs.append(Sig((P,), (P,)))
        return sigs

    return signatures


def _partial_ok(partial, x) -> bool:
    # A max over devices of complex numbers has no XLA all-reduce: reduce them whole.
    return partial.op == "sum" or not np.issubdtype(x.aval.dtype, np.complexfloating)


defrule(lax.reduce_sum_p)(_reduce(P))
defrule(lax.reduce_max_p)(_reduce(Partial("max")))
defrule(lax.reduce_min_p)(_reduce(Partial("min")))
defrule(lax.reduce_prod_p, lax.reduce_and_p, lax.reduce_or_p)(_reduce(None))


def _arg_signatures(eqn):
    """argmax / argmin: a split dim that is not reduced stays split; the reduced dim may be
    split too ("winners"): each block's winner and its value are all-gathered over the axes
    that split it — out-sized, where gathering the operand moves all of it — and the first
    winner among them taken, as one device takes the first of equal values (and a NaN, as its
    comparator does)."""
    (axis,) = eqn.params["axes"]
    return _reduce(None)(eqn) + [Sig((S(axis),), (B,), "winners")]


def _winners(eqn, ins, sigs, mesh) -> tuple:
    """The all_gathers the "winners" lowering runs: of each block's winning values and indices."""
    (x,), (out,) = eqn.invars, eqn.outvars
    (axis,) = eqn.params["axes"]
    axes = split_axes(ins[0], axis, mesh.axis_names)
    if not axes:
        return ()
    n = math.prod(axis_sizes(mesh)[a] for a in axes)
    block = local_shape(x.aval.shape, ins[0], mesh)
    block = block[:axis] + block[axis + 1 :]
    return tuple(
        Step(
            "all_gather",
            axes,
            0,
            local_shape=block,
            bytes=(n - 1) * math.prod(block) * dtype.itemsize,
            value=ShapedArray(out.aval.shape, dtype),
        )
        for dtype in (np.dtype(x.aval.dtype), np.dtype(out.aval.dtype))
    )


def _lower_arg(local, eqn, ins):
    (x,) = ins
    (axis,) = eqn.params["axes"]
    params = bind_params(eqn)
    index = eqn.primitive.bind(x, **params)
    axes = split_axes(decision_of(eqn).ins[0], axis, local.names)
    if not axes:
        return index
    value = jnp.squeeze(jnp.take_along_axis(x, jnp.expand_dims(index, axis), axis), axis)
    me, _ = local.shard_index(eqn.invars[0], axis)
    index = index + (me * x.shape[axis]).astype(index.dtype)
    name = axes if len(axes) > 1 else axes[0]
    values, indices = lax.all_gather(value, name, axis=0), lax.all_gather(index, name, axis=0)
    first = eqn.primitive.bind(values, **{**params, "axes": (0,)})
    return jnp.squeeze(jnp.take_along_axis(indices, first[None], 0), 0)


defrule(
    lax.argmax_p,
    lax.argmin_p,
    lower=_lower_arg,
    comm=_winners,
    comm_reason="gathers each block's winner over the axes that split its reduced dim",
)(_arg_signatures)


@defrule(lax.cumsum_p, lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p)
def _cumulative(eqn):
    (x,) = eqn.invars
    sigs = [Sig((S(d),), (S(d),)) for d in range(rank(x)) if d != eqn.params["axis"]]
    if eqn.primitive is lax.cumsum_p:
        sigs.append(Sig((P,), (P,)))  # linear: a partial sum stays partial
    return sigs
