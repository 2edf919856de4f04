"""SBP signature rules, one registry keyed by primitive (as JAX keeps its jvp/batching rules).

A rule maps an equation to the 1-D signatures it accepts on ONE mesh axis, OneFlow style:
each ``Sig`` says which SBP every operand must have and which SBP every output then has.
Propagation applies the rules axis by axis, so an nd signature is one 1-D signature per axis.
Every primitive also runs whole (all operands B -> all outputs B); that needs no entry, and a
primitive without an entry is run whole and reported as a fallback.

Scalars (rank-0 operands, literals) are always B. ``P`` flows only through ops that are linear
in it (add/sub of partials, negation, dtype casts, reductions, dot_general with a B partner,
reshapes); everything else needs the partial value reduced first.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from jax import lax
from jax._src import core

from shardflow.specs import B, P, Partial, S

class Sig(NamedTuple):
    ins: tuple
    outs: tuple


RULES: dict[core.Primitive, Callable[[core.JaxprEqn], list]] = {}


def rule(*prims):
    def register(fn):
        for p in prims:
            RULES[p] = fn
        return fn
    return register


def rank(x) -> int:
    return len(x.aval.shape)


def shape(x) -> tuple:
    return tuple(x.aval.shape)


def _all(n, sbp):
    return (sbp,) * n


# ------------------------------------------------------------------------------ elementwise

def _elementwise(eqn, *, partial_ok: bool):
    """Same-shape operands split alike. An operand broadcast along a dim (size 1 there, or a
    scalar) stays B on that dim's axis."""
    out_shape = shape(eqn.outvars[0])
    n_out = len(eqn.outvars)

    def operand_sbp(x, d):
        return S(d) if rank(x) == len(out_shape) and shape(x)[d] == out_shape[d] else B

    sigs = [Sig(tuple(operand_sbp(x, d) for x in eqn.invars), _all(n_out, S(d)))
            for d in range(len(out_shape)) if out_shape[d] > 1]
    if partial_ok and all(rank(x) == len(out_shape) for x in eqn.invars):
        sigs.append(Sig(_all(len(eqn.invars), P), _all(n_out, P)))
    return sigs


LINEAR = [lax.add_p, lax.sub_p, lax.neg_p, lax.convert_element_type_p, lax.reduce_precision_p]
NONLINEAR = [
    lax.mul_p, lax.div_p, lax.max_p, lax.min_p, lax.pow_p, lax.integer_pow_p, lax.exp_p, lax.exp2_p,
    lax.log_p, lax.log1p_p, lax.expm1_p, lax.tanh_p, lax.logistic_p, lax.erf_p, lax.erfc_p,
    lax.erf_inv_p, lax.rsqrt_p, lax.sqrt_p, lax.cbrt_p, lax.sin_p, lax.cos_p, lax.tan_p, lax.atan2_p,
    lax.abs_p, lax.sign_p, lax.floor_p, lax.ceil_p, lax.round_p, lax.is_finite_p, lax.square_p,
    lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p, lax.and_p, lax.or_p, lax.not_p,
    lax.xor_p, lax.rem_p, lax.nextafter_p, lax.select_n_p, lax.clamp_p, lax.shift_left_p,
    lax.shift_right_logical_p, lax.shift_right_arithmetic_p, lax.population_count_p, lax.stop_gradient_p,
]
# Elementwise primitives only some JAX versions have (0.11 differentiates tanh with one_minus_square).
from jax._src.lax import lax as _lax_internal  # noqa: E402
NONLINEAR += [p for p in (getattr(_lax_internal, n, None) for n in ("one_minus_square_p",)) if p is not None]
try:
    from jax._src.ad_util import add_jaxvals_p as _add_any_p
    LINEAR.append(_add_any_p)
except ImportError:  # pragma: no cover
    pass
try:
    from jax._src.lax.lax import copy_p as _copy_p
    LINEAR.append(_copy_p)
except ImportError:  # pragma: no cover
    pass

rule(*LINEAR)(lambda eqn: _elementwise(eqn, partial_ok=True))
rule(*NONLINEAR)(lambda eqn: _elementwise(eqn, partial_ok=False))


# ------------------------------------------------------------------------------ contractions

@rule(lax.dot_general_p)
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


# ------------------------------------------------------------------------------ reductions

def _reduce(partial):
    def rule_(eqn):
        axes = tuple(eqn.params["axes"])
        (x,) = eqn.invars
        sigs = []
        for d in range(rank(x)):
            if d in axes:
                if partial is not None:
                    sigs.append(Sig((S(d),), (partial,)))
            else:
                sigs.append(Sig((S(d),), (S(d - sum(a < d for a in axes)),)))
        if partial == P:
            sigs.append(Sig((P,), (P,)))
        return sigs
    return rule_


rule(lax.reduce_sum_p)(_reduce(P))
rule(lax.reduce_max_p)(_reduce(Partial("max")))
rule(lax.reduce_min_p, lax.reduce_prod_p, lax.reduce_and_p, lax.reduce_or_p, lax.argmax_p, lax.argmin_p)(
    _reduce(None))


@rule(lax.cumsum_p, lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p)
def _cumulative(eqn):
    (x,) = eqn.invars
    sigs = [Sig((S(d),), (S(d),)) for d in range(rank(x)) if d != eqn.params["axis"]]
    if eqn.primitive is lax.cumsum_p:
        sigs.append(Sig((P,), (P,)))
    return sigs


# ------------------------------------------------------------------------------ shape ops

@rule(lax.broadcast_in_dim_p)
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
                a *= in_shape[i]; i += 1
            elif j < len(out_shape):
                b *= out_shape[j]; j += 1
            else:
                break
            if a == b and a > 1 or (i == len(in_shape) and j == len(out_shape)):
                break
        d, e = leading(in_shape, gi, i), leading(out_shape, gj, j)
        if d is not None and e is not None:
            groups.append((d, e))
    return groups


@rule(lax.reshape_p)
def _reshape(eqn):
    x = eqn.invars[0]
    if eqn.params.get("dimensions") is not None or len(eqn.invars) > 1:
        return []
    groups = reshape_groups(shape(x), eqn.params["new_sizes"])
    return [Sig((S(d),), (S(e),)) for d, e in groups if shape(x)[d] > 1] + [Sig((P,), (P,))]


@rule(lax.transpose_p)
def _transpose(eqn):
    perm = eqn.params["permutation"]
    return [Sig((S(p),), (S(i),)) for i, p in enumerate(perm)] + [Sig((P,), (P,))]


@rule(lax.rev_p)
def _rev(eqn):
    dims = eqn.params["dimensions"]
    return [Sig((S(d),), (S(d),)) for d in range(rank(eqn.invars[0])) if d not in dims] + [Sig((P,), (P,))]


@rule(lax.squeeze_p)
def _squeeze(eqn):
    dims = eqn.params["dimensions"]
    kept = [d for d in range(rank(eqn.invars[0])) if d not in dims]
    return [Sig((S(d),), (S(i),)) for i, d in enumerate(kept)] + [Sig((P,), (P,))]


@rule(lax.concatenate_p)
def _concatenate(eqn):
    n, r, axis = len(eqn.invars), rank(eqn.outvars[0]), eqn.params["dimension"]
    return [Sig(_all(n, S(d)), (S(d),)) for d in range(r) if d != axis] + [Sig(_all(n, P), (P,))]


@rule(lax.pad_p)
def _pad(eqn):
    config = eqn.params["padding_config"]
    return [Sig((S(d), B), (S(d),)) for d, c in enumerate(config) if tuple(c) == (0, 0, 0)]


@rule(lax.slice_p)
def _slice(eqn):
    x = eqn.invars[0]
    start, limit, strides = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
    return [Sig((S(d),), (S(d),)) for d in range(rank(x))
            if start[d] == 0 and limit[d] == shape(x)[d] and (strides is None or strides[d] == 1)]


@rule(lax.dynamic_slice_p)
def _dynamic_slice(eqn):
    x, *idx = eqn.invars
    sizes = eqn.params["slice_sizes"]
    return [Sig((S(d),) + _all(len(idx), B), (S(d),)) for d in range(rank(x)) if sizes[d] == shape(x)[d]]


@rule(lax.dynamic_update_slice_p)
def _dynamic_update_slice(eqn):
    x, upd, *idx = eqn.invars
    return [Sig((S(d), S(d)) + _all(len(idx), B), (S(d),)) for d in range(rank(x)) if shape(upd)[d] == shape(x)[d]]


from jax._src.lax.lax import stack_p, unstack_p  # noqa: E402  (no public lax name yet)


@rule(stack_p)
def _stack(eqn):
    n, axis = len(eqn.invars), eqn.params["axis"]
    return ([Sig(_all(n, S(d)), (S(d if d < axis else d + 1),)) for d in range(rank(eqn.invars[0]))]
            + [Sig(_all(n, P), (P,))])


@rule(unstack_p)
def _unstack(eqn):
    n, axis = len(eqn.outvars), eqn.params["axis"]
    return ([Sig((S(d),), _all(n, S(d if d < axis else d - 1))) for d in range(rank(eqn.invars[0])) if d != axis]
            + [Sig((P,), _all(n, P))])


@rule(lax.split_p)
def _split(eqn):
    axis, n = eqn.params["axis"], len(eqn.outvars)
    return [Sig((S(d),), _all(n, S(d))) for d in range(rank(eqn.invars[0])) if d != axis] + [Sig((P,), _all(n, P))]


@rule(lax.sort_p)
def _sort(eqn):
    n, dim = len(eqn.invars), eqn.params["dimension"]
    return [Sig(_all(n, S(d)), _all(n, S(d))) for d in range(rank(eqn.invars[0])) if d != dim]


@rule(lax.top_k_p)
def _top_k(eqn):
    r = rank(eqn.invars[0])
    return [Sig((S(d),), (S(d), S(d))) for d in range(r - 1)]


# ------------------------------------------------------------------------------ gather / scatter

def gather_dims(eqn):
    """Dim bookkeeping of a gather: which operand/indices dims map to which output dims."""
    operand, indices = eqn.invars
    dn = eqn.params["dimension_numbers"]
    out_rank = rank(eqn.outvars[0])
    offset_out = tuple(dn.offset_dims)
    batch_out = [d for d in range(out_rank) if d not in offset_out]
    idx_batch = [d for d in range(rank(indices)) if d != rank(indices) - 1]  # index vector dim is last
    operand_offset = [d for d in range(rank(operand))
                      if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    return dn, offset_out, batch_out, idx_batch, operand_offset


@rule(lax.gather_p)
def _gather(eqn):
    operand, indices = eqn.invars
    dn, offset_out, batch_out, idx_batch, operand_offset = gather_dims(eqn)
    sizes = eqn.params["slice_sizes"]
    sigs = []
    for od, out_d in zip(operand_offset, offset_out):     # untouched operand dims
        if od not in dn.start_index_map and sizes[od] == shape(operand)[od]:
            sigs.append(Sig((S(od), B), (S(out_d),)))
    for ob, ib in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        sigs.append(Sig((S(ob), S(ib)), (S(batch_out[idx_batch.index(ib)]),)))
    for ib, out_d in zip(idx_batch, batch_out):           # split the lookups, whole table
        if ib not in dn.start_indices_batching_dims:
            sigs.append(Sig((B, S(ib)), (S(out_d),)))
    for k in dn.start_index_map:                          # vocab-split table: masked local lookup
        if k in dn.collapsed_slice_dims and sizes[k] == 1:
            sigs.append(Sig((S(k), B), (P,)))
    return sigs


@rule(lax.scatter_add_p)
def _scatter_add(eqn):
    operand, indices, updates = eqn.invars
    dn = eqn.params["dimension_numbers"]
    upd_window = tuple(dn.update_window_dims)
    operand_window = [d for d in range(rank(operand))
                      if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    upd_scatter = [d for d in range(rank(updates)) if d not in upd_window]
    idx_batch = [d for d in range(rank(indices)) if d != rank(indices) - 1]
    sigs = []
    for od, ud in zip(operand_window, upd_window):
        if od not in dn.scatter_dims_to_operand_dims and shape(updates)[ud] == shape(operand)[od]:
            sigs.append(Sig((S(od), B, S(ud)), (S(od),)))
    for ob, ib in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        sigs.append(Sig((S(ob), S(ib), S(upd_scatter[idx_batch.index(ib)])), (S(ob),)))
    for ib, ud in zip(idx_batch, upd_scatter):            # each device adds its own updates
        if ib not in dn.scatter_indices_batching_dims:
            sigs.append(Sig((P, S(ib), S(ud)), (P,)))
    for k in dn.scatter_dims_to_operand_dims:             # vocab-split table: masked local scatter
        if k in dn.inserted_window_dims:
            sigs.append(Sig((S(k), B, B), (S(k),)))
    sigs.append(Sig((P, B, P), (P,)))
    return sigs


# ------------------------------------------------------------------------------ kernels

# Attention kernels (shardflow.ops.attention) are independent per batch row and per head.
# Layouts: q/k/v/out/dout/dq/dk/dv [B, S, H, D], lse [B, H, S], segment ids [B, S], offsets scalars.
_ATTENTION_DIMS = {"batch": {4: 0, 3: 0, 2: 0}, "heads": {4: 2, 3: 1}}


def attention_signatures(eqn):
    """Registered by shardflow.ops for its sf_attention_fwd / sf_attention_bwd primitives.

    Besides batch and heads, queries may be split along the sequence with whole keys and values
    (all-gather context parallelism): each shard attends its queries to every key, its causal
    mask shifted by the shard's offset (shardflow.ops lowers that); the backward's dk and dv are
    then partial sums over the query shards. Not with segment ids, which q and kv share.
    """
    sigs = []
    for dims in _ATTENTION_DIMS.values():
        ins = tuple(S(dims[rank(x)]) if rank(x) in dims else B for x in eqn.invars)
        outs = tuple(S(dims[rank(x)]) for x in eqn.outvars)
        sigs.append(Sig(ins, outs))
    if not any(rank(x) == 2 for x in eqn.invars):
        query_split = {4: S(1), 3: S(2)}  # q/out/dout [B, S, H, D]; lse/dlse [B, H, S]
        ins = tuple(B if i in (1, 2) else query_split.get(rank(x), B) for i, x in enumerate(eqn.invars))
        outs = (S(1), S(2)) if len(eqn.outvars) == 2 else (S(1), P, P)
        sigs.append(Sig(ins, outs))
    return sigs




def signatures(eqn):
    """The 1-D signatures of ``eqn``, or None when it has no rule (it then runs whole)."""
    fn = RULES.get(eqn.primitive)
    if fn is None:
        return [] if not eqn.invars else None  # made from nothing (iota, empty, rng): whole, B
    return fn(eqn)

