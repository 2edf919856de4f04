"""Convolutions and windowed reductions: conv_general_dilated, reduce_window_{sum,max,min},
generic reduce_window, and max-pool's derivatives select_and_scatter_add / select_and_gather_add.

conv_general_dilated, with lhs (N, C, spatial), rhs (O, I, spatial), out (N, C, spatial) read
from its dimension_numbers, G = feature_group_count, BG = batch_group_count (one of them is 1):

* batch:           lhs S(N), rhs B      -> out S(N)      (BG == 1)
* output feature:  lhs B,    rhs S(O)   -> out S(C)
* input feature:   lhs S(C), rhs S(I)   -> P             (G == 1: every output sums over all C)
* groups:          lhs S(C), rhs S(O)   -> out S(C)      (G > 1: a device holds whole groups)
                   lhs S(N), rhs S(O)   -> out S(C)      (BG > 1: lhs batch is BG groups, major)
* linear:          (P, B) -> P, (B, P) -> P
* spatial, only where no halo is needed: non-overlapping windows (kernel == stride, no padding,
  e.g. a patch embedding or a 1x1 conv) and their transposes (lhs dilated by the kernel size,
  padded kernel - 1 on both sides: S -> S; the weight gradient's rhs dilated by the stride,
  lhs == rhs x dilation: S, S -> P).

JAX's transposes emit convs with swapped dimension numbers, which these cover as they are: the
weight gradient takes the activations' batch dim as its lhs feature dim and the cotangent's
batch dim as its rhs input-feature dim, so data parallelism splits both and the weight gradient
comes out P, reduced by one all-reduce; the input gradient is a conv with the kernel's O and I
swapped (out-feature split -> input-feature split). A grouped conv's weight gradient has
BG = G, whose groups signature is a channel-parallel depthwise conv's weight gradient.

With groups (G or BG > 1) an output-feature split is only local if each device's block of O is
whole groups and its lhs block holds their channels (batch entries): the number of blocks of O
must divide the group count and the axes splitting the lhs group dim must be a mesh-order prefix
of those splitting O. One 1-D signature per axis cannot say that: the rule ``admits`` only such
decisions (greedy chooses again without the group signatures). The lowering slices the lhs
channels (batch) of the device's groups and binds with the local group count.

Spatial splitting with halos (a 3x3 conv, an overlapping pool, avg-pool's gradient, which pads
with interior padding before an overlapping window) is not offered: it needs a neighbour
exchange (ppermute) that the conversion plans cannot express, so such dims stay whole.

Windowed reductions: a dim whose windows do not overlap (window == stride, no padding, no
dilation, the size a multiple of the window — a size-1 window with stride 1 is the common case:
batch and channels) splits S -> S, bound unchanged (window params are per dim). reduce_window_sum
is linear (P -> P), reduce_window_max keeps a partial max (P(max) -> P(max)), and max-pool's
derivatives are linear in the cotangent / tangent (P, B -> P).
"""

from __future__ import annotations

import math

from jax import lax

from shardflow.registry import Sig, bind_params, defrule
from shardflow.rules.elementwise import every, shape
from shardflow.specs import B, P, Partial, S, axis_sizes


def _local_window(n_in, n_out, window, stride, pad, base_dil=1, win_dil=1) -> bool:
    """Whether splitting a dim of ``n_in`` elements and its ``n_out`` results into equal blocks
    lets each device compute its block from its own block with the params unchanged."""
    if win_dil != 1 or window < 1:
        return False
    lo, hi = pad
    # non-overlapping windows: block b of the result reads exactly block b of the operand
    if stride == window and (lo, hi) == (0, 0) and base_dil == 1 and n_in == n_out * window:
        return True
    # their transpose: each result reads one operand element, operand dilated by the window
    return stride == 1 and base_dil == window and (lo, hi) == (window - 1, window - 1) and n_out == n_in * window


# ------------------------------------------------------------------------------ conv_general_dilated


def _conv_dims(eqn):
    lhs_spec, rhs_spec, out_spec = eqn.params["dimension_numbers"]
    return lhs_spec, rhs_spec, out_spec


def _group_dim(eqn):
    """(the lhs dim whose blocks are groups, the group count), or None without groups."""
    lhs_spec, _, _ = _conv_dims(eqn)
    g, bg = eqn.params["feature_group_count"], eqn.params["batch_group_count"]
    if g > 1:
        return lhs_spec[1], g
    if bg > 1:
        return lhs_spec[0], bg
    return None


def _conv_signatures(eqn):
    lhs, rhs = eqn.invars
    out = eqn.outvars[0]
    (ln, lc, *lsp), (ro, ri, *rsp), (on, oc, *osp) = _conv_dims(eqn)
    p = eqn.params
    g, bg = p["feature_group_count"], p["batch_group_count"]
    grouped = g > 1 or bg > 1
    sigs = []
    if bg == 1:
        sigs.append(Sig((S(ln), B), (S(on),)))
    sigs.append(Sig((B, S(ro)), (S(oc),), "group_out" if grouped else ""))
    if g == 1:
        sigs.append(Sig((S(lc), S(ri)), (P,)))
    if g > 1:
        sigs.append(Sig((S(lc), S(ro)), (S(oc),), "groups"))
    if bg > 1:
        sigs.append(Sig((S(ln), S(ro)), (S(oc),), "groups"))
    strides, pads = p["window_strides"], p["padding"]
    lhs_dil, rhs_dil = p["lhs_dilation"], p["rhs_dilation"]
    for i, (l, r, o) in enumerate(zip(lsp, rsp, osp)):
        n_l, n_r, n_o = shape(lhs)[l], shape(rhs)[r], shape(out)[o]
        if _local_window(n_l, n_o, n_r, strides[i], tuple(pads[i]), lhs_dil[i], rhs_dil[i]):
            sigs.append(Sig((S(l), B), (S(o),)))
        elif strides[i] == 1 and lhs_dil[i] == 1 and tuple(pads[i]) == (0, 0) and n_r > 1 and n_l == n_r * rhs_dil[i]:
            # out[k] = sum_j lhs[j * dil + k] rhs[j]: the weight gradient of non-overlapping windows
            sigs.append(Sig((S(l), S(r)), (P,)))
    sigs += [Sig((P, B), (P,)), Sig((B, P), (P,))]
    return sigs


def _whole_groups(eqn, decision, mesh) -> bool:
    """Whether the decision's split of rhs O is whole groups whose lhs part each device holds."""
    grouped = _group_dim(eqn)
    if grouped is None or decision is None:
        return True
    gdim, groups = grouped
    ro = _conv_dims(eqn)[1][0]
    on_l = [i for i, s in enumerate(decision.ins[0]) if s == S(gdim)]
    on_r = [i for i, s in enumerate(decision.ins[1]) if s == S(ro)]
    k_r = math.prod(axis_sizes(mesh)[mesh.axis_names[i]] for i in on_r)
    return groups % k_r == 0 and on_l == on_r[: len(on_l)]


def _lower_conv(local, eqn, ins):
    lhs, rhs = ins
    params = dict(bind_params(eqn))
    grouped = _group_dim(eqn)
    if grouped is not None:
        gdim, groups = grouped
        ro = _conv_dims(eqn)[1][0]
        idx_r, k_r = local.shard_index(eqn.invars[1], ro)
        idx_l, k_l = local.shard_index(eqn.invars[0], gdim)
        if k_r > 1:
            per_group = eqn.invars[0].aval.shape[gdim] // groups
            mine = groups // k_r  # groups of this device's block of O
            if k_l != k_r:  # the lhs block holds more groups: take ours
                start = (idx_r * mine - idx_l * (groups // k_l)) * per_group
                lhs = lax.dynamic_slice_in_dim(lhs, start, mine * per_group, gdim)
            key = "feature_group_count" if params["feature_group_count"] > 1 else "batch_group_count"
            params[key] = mine
    return lax.conv_general_dilated_p.bind(lhs, rhs, **params)


def _conv_flops(eqn, in_shapes, out_shapes):
    """Each output element: a multiply-add per kernel element of its output feature."""
    rhs = in_shapes[1]
    features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * math.prod(out_shapes[0]) * math.prod(rhs) / features


defrule(lax.conv_general_dilated_p, lower=_lower_conv, flops=_conv_flops, admits=_whole_groups)(_conv_signatures)


# ------------------------------------------------------------------------------ windowed reductions


def _window_dims(eqn, operand, result):
    p = eqn.params
    n = len(shape(operand))
    base = p.get("base_dilation", (1,) * n)
    wdil = p.get("window_dilation", (1,) * n)
    return [
        d
        for d in range(n)
        if _local_window(
            shape(operand)[d],
            shape(result)[d],
            p["window_dimensions"][d],
            p["window_strides"][d],
            tuple(p["padding"][d]),
            base[d],
            wdil[d],
        )
    ]


def _reduce_window(partial):
    def signatures(eqn):
        (x,) = eqn.invars
        sigs = [Sig((S(d),), (S(d),)) for d in _window_dims(eqn, x, eqn.outvars[0])]
        if partial is not None:
            sigs.append(Sig((partial,), (partial,)))
        return sigs

    return signatures


defrule(lax.reduce_window_sum_p)(_reduce_window(P))
defrule(lax.reduce_window_max_p)(_reduce_window(Partial("max")))
defrule(lax.reduce_window_min_p)(_reduce_window(Partial("min")))


@defrule(lax.reduce_window_p)
def _reduce_window_generic(eqn):
    n = len(eqn.outvars)  # operands, then as many init values
    dims = _window_dims(eqn, eqn.invars[0], eqn.outvars[0])
    return [Sig(every(n, S(d)) + every(n, B), every(n, S(d))) for d in dims]


@defrule(lax.select_and_scatter_add_p)
def _select_and_scatter_add(eqn):
    source, operand = eqn.invars  # source: shaped like the pooled result
    dims = _window_dims(eqn, operand, source)
    return [Sig((S(d), S(d)), (S(d),)) for d in dims] + [Sig((P, B), (P,))]


@defrule(lax.select_and_gather_add_p)
def _select_and_gather_add(eqn):
    tangents, operand = eqn.invars
    dims = _window_dims(eqn, operand, eqn.outvars[0])
    return [Sig((S(d), S(d)), (S(d),)) for d in dims] + [Sig((P, B), (P,))]
