"""dot_general, reductions and cumulative ops."""
from __future__ import annotations

import math

import numpy as np
from jax import lax

from shardflow.registry import Sig, defrule
from shardflow.rules.elementwise import rank
from shardflow.specs import B, P, Partial, S


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
defrule(lax.reduce_prod_p, lax.reduce_and_p, lax.reduce_or_p, lax.argmax_p, lax.argmin_p)(_reduce(None))


@defrule(lax.cumsum_p, lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p)
def _cumulative(eqn):
    (x,) = eqn.invars
    sigs = [Sig((S(d),), (S(d),)) for d in range(rank(x)) if d != eqn.params["axis"]]
    if eqn.primitive is lax.cumsum_p:
        sigs.append(Sig((P,), (P,)))      # linear: a partial sum stays partial
    return sigs
