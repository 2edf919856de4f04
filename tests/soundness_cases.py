"""The catalogue of tests/test_rule_soundness.py: small jnp/lax functions, one or more per
primitive with signatures, each with the shapes it is traced at and, where random normals do not
suit an operand, its values' generator; known-unsound signatures marked with a reason.
``EXCLUDED``: the primitives with signatures that have no case, and why."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as prims
from soundness_harness import GE1, POS, UNIT, Case, ints, nonzero, out_of_range, scaled, uniform

import shardflow as sf
import shardflow.attention  # noqa: F401  (registers the attention primitives' rule)
import shardflow.cross_entropy  # noqa: F401  (registers the fused cross-entropy's rule)
import shardflow.experts  # noqa: F401  (registers the routed experts' rule)
import shardflow.rules  # noqa: F401  (registers every rule)
from shardflow import _compat


def f32(*shape):
    return (shape, jnp.float32)


def i32(*shape):
    return (shape, jnp.int32)


def u32(*shape):
    return (shape, jnp.uint32)


def boolean(*shape):
    return (shape, jnp.bool_)


def c64(*shape):
    return (shape, jnp.complex64)


X = f32(4, 8)
V = f32(8)  # one elementwise op of each primitive: its rule is shared (dims: the cases after them)
CATALOG: list[Case] = []


def case(prim, name, fn, *args, values=(), xfail=()):
    if prim is None:  # a primitive this JAX version lacks
        return
    CATALOG.append(Case(name, prim, fn, tuple(args), tuple(values), tuple(xfail)))


# --- elementwise: unary
for _prim, _fn, _gen in [
    (lax.neg_p, jnp.negative, None),
    (lax.exp_p, jnp.exp, None),
    (lax.exp2_p, jnp.exp2, None),
    (lax.log_p, jnp.log, POS),
    (lax.log1p_p, jnp.log1p, POS),
    (lax.expm1_p, jnp.expm1, None),
    (lax.tanh_p, jnp.tanh, None),
    (lax.logistic_p, jax.nn.sigmoid, None),
    (lax.erf_p, lax.erf, None),
    (lax.erfc_p, lax.erfc, None),
    (lax.erf_inv_p, lax.erf_inv, UNIT),
    (lax.rsqrt_p, lax.rsqrt, POS),
    (lax.sqrt_p, jnp.sqrt, POS),
    (lax.cbrt_p, jnp.cbrt, None),
    (lax.sin_p, jnp.sin, None),
    (lax.cos_p, jnp.cos, None),
    (lax.tan_p, jnp.tan, UNIT),
    (lax.abs_p, jnp.abs, None),
    (lax.sign_p, lax.sign, None),
    (lax.floor_p, jnp.floor, scaled(4)),
    (lax.ceil_p, jnp.ceil, scaled(4)),
    (lax.round_p, lax.round, scaled(4)),
    (lax.is_finite_p, lax.is_finite, None),
    (lax.square_p, jnp.square, None),
    (prims.sinh_p, jnp.sinh, None),
    (prims.cosh_p, jnp.cosh, None),
    (prims.asin_p, jnp.arcsin, UNIT),
    (prims.acos_p, jnp.arccos, UNIT),
    (prims.atan_p, jnp.arctan, None),
    (prims.asinh_p, jnp.arcsinh, None),
    (prims.acosh_p, jnp.arccosh, GE1),
    (prims.atanh_p, jnp.arctanh, UNIT),
    (prims.lgamma_p, lax.lgamma, POS),
    (prims.digamma_p, lax.digamma, POS),
    (lax.integer_pow_p, lambda x: x**3, None),
    (lax.stop_gradient_p, lambda x: lax.stop_gradient_p.bind(x), None),
    (prims.copy_p, lambda x: prims.copy_p.bind(x), None),
    (_compat.one_minus_square_p, lambda x: _compat.one_minus_square_p.bind(x), None),
]:
    case(_prim, _prim.name if _prim is not None else "", _fn, V, values=((0, _gen),) if _gen else ())

case(lax.reduce_precision_p, "reduce_precision", lambda x: lax.reduce_precision(x, 5, 10), X)
case(lax.not_p, "not-bool", jnp.logical_not, boolean(4, 8))
case(lax.not_p, "not-int", jnp.invert, i32(4, 8))
case(prims.clz_p, "clz", lax.clz, i32(4, 8))
case(lax.population_count_p, "population_count", lax.population_count, i32(4, 8))
case(prims.real_p, "real", jnp.real, c64(4, 8))
case(prims.imag_p, "imag", jnp.imag, c64(4, 8))
case(prims.conj_p, "conj", jnp.conj, c64(4, 8))
case(lax.convert_element_type_p, "convert-f32-bf16", lambda x: x.astype(jnp.bfloat16), X)
case(lax.convert_element_type_p, "convert-i32-f32", lambda x: x.astype(jnp.float32), i32(4, 8))
case(lax.convert_element_type_p, "convert-bool-f32", lambda x: x.astype(jnp.float32), boolean(4, 8))
case(lax.convert_element_type_p, "convert-f32-i32", lambda x: x.astype(jnp.int32), X, values=((0, scaled(4)),))
case(lax.convert_element_type_p, "convert-f32-bool", lambda x: lax.convert_element_type(x, jnp.bool_), X)
case(
    lax.convert_element_type_p,
    "convert-i8-i32",
    lambda x: x.astype(jnp.int32),
    ((4, 8), jnp.int8),
    values=((0, ints(-100, 100)),),
)
case(
    lax.convert_element_type_p,
    "convert-i32-i8",
    lambda x: x.astype(jnp.int8),
    i32(4, 8),
    values=((0, ints(-1000, 1000)),),
)

# --- elementwise: binary and more
for _prim, _fn, _args, _gens in [
    (lax.add_p, jnp.add, (V, V), ()),
    (lax.sub_p, jnp.subtract, (V, V), ()),
    (lax.mul_p, jnp.multiply, (V, V), ()),
    (lax.div_p, jnp.divide, (V, V), ((1, POS),)),
    (lax.max_p, jnp.maximum, (V, V), ()),
    (lax.min_p, jnp.minimum, (V, V), ()),
    (lax.pow_p, lax.pow, (V, V), ((0, POS),)),
    (lax.atan2_p, jnp.arctan2, (V, V), ()),
    (lax.rem_p, lax.rem, (V, V), ((1, POS),)),
    (lax.nextafter_p, jnp.nextafter, (V, V), ()),
    (lax.eq_p, lax.eq, (i32(8), i32(8)), ()),
    (lax.ne_p, lax.ne, (V, V), ()),
    (lax.lt_p, lax.lt, (V, V), ()),
    (lax.le_p, lax.le, (i32(8), i32(8)), ()),
    (lax.gt_p, lax.gt, (V, V), ()),
    (lax.ge_p, lax.ge, (V, V), ()),
    (lax.and_p, jnp.logical_and, (boolean(8), boolean(8)), ()),
    (lax.or_p, jnp.bitwise_or, (i32(8), i32(8)), ()),
    (lax.xor_p, jnp.logical_xor, (boolean(8), boolean(8)), ()),
    (lax.shift_left_p, lax.shift_left, (i32(8), i32(8)), ((1, ints(0, 32)),)),
    (lax.shift_right_logical_p, lax.shift_right_logical, (i32(8), i32(8)), ((1, ints(0, 32)),)),
    (lax.shift_right_arithmetic_p, lax.shift_right_arithmetic, (i32(8), i32(8)), ((1, ints(0, 32)),)),
    (prims.add_jaxvals_p, lambda x, y: prims.add_jaxvals_p.bind(x, y), (V, V), ()),
    (prims.complex_p, lax.complex, (V, V), ()),
]:
    case(_prim, _prim.name, _fn, *_args, values=_gens)

case(lax.rem_p, "rem-int", lax.rem, i32(4, 8), i32(4, 8), values=((1, nonzero),))
case(lax.select_n_p, "select_n", lambda c, x, y: jnp.where(c, x, y), boolean(4, 8), X, X)
case(
    lax.select_n_p,
    "select_n-int-predicate",
    lambda c, x, y, z: lax.select_n(c, x, y, z),
    i32(4, 8),
    X,
    X,
    X,
    values=((0, ints(0, 3)),),
)
case(lax.clamp_p, "clamp-literals", lambda x: lax.clamp(-0.5, x, 0.5), X)
case(
    lax.clamp_p,
    "clamp-arrays",
    lambda lo, x, hi: lax.clamp(lo, x, hi),
    X,
    X,
    X,
    values=((0, uniform(-2, -0.1)), (2, uniform(0.1, 2))),
)
# operands broadcast along a dim: size 1 there, a rank-0 value, a literal
case(lax.mul_p, "mul-size1-dim", jnp.multiply, f32(4, 1, 8), f32(4, 4, 8))
case(lax.add_p, "add-size1-dims", jnp.add, f32(1, 8), X)
case(lax.mul_p, "mul-rank0", jnp.multiply, X, f32())
case(lax.add_p, "add-literal", lambda x: x + 1.5, X)
case(lax.add_p, "add-rank0-literal", lambda s: s + 1.5, f32())
case(lax.sub_p, "sub-rank0-literal", lambda s: 2.0 - s, f32())

# --- contraction, reductions, cumulative ops
case(lax.dot_general_p, "matmul", jnp.matmul, X, f32(8, 4))
case(lax.dot_general_p, "batched", lambda a, b: jnp.einsum("bij,bjk->bik", a, b), f32(4, 4, 8), f32(4, 8, 4))
case(lax.dot_general_p, "two-contracting", lambda a, b: jnp.einsum("bij,kji->kb", a, b), f32(4, 4, 8), f32(8, 8, 4))
case(lax.dot_general_p, "rowwise-dot", lambda a, b: jnp.einsum("ij,ij->i", a, b), X, X)
case(lax.reduce_sum_p, "reduce_sum", lambda x: jnp.sum(x, 1), X)
case(lax.reduce_sum_p, "reduce_sum-two-axes", lambda x: jnp.sum(x, (0, 2)), f32(4, 4, 8))
case(lax.reduce_max_p, "reduce_max", lambda x: jnp.max(x, 0), f32(4, 4, 8))
case(lax.reduce_max_p, "reduce_max-int", lambda x: jnp.max(x, (1, 2)), i32(4, 4, 8))
case(
    lax.reduce_max_p,
    "reduce_max-nan",
    lambda x: jnp.max(x, 1),
    X,
    values=(
        (
            0,
            lambda rng, shape, dtype: np.where(rng.random(shape) < 0.1, np.nan, rng.standard_normal(shape)).astype(
                dtype
            ),
        ),
    ),
)
case(lax.reduce_min_p, "reduce_min", lambda x: jnp.min(x, 1), X)
case(lax.reduce_prod_p, "reduce_prod", lambda x: jnp.prod(x, 0), X, values=((0, uniform(0.5, 1.5)),))
case(lax.reduce_and_p, "reduce_and", lambda x: jnp.all(x, 1), boolean(4, 8))
case(lax.reduce_or_p, "reduce_or", lambda x: jnp.any(x, 0), boolean(4, 8))
case(lax.argmax_p, "argmax", lambda x: jnp.argmax(x, 1), f32(4, 8, 4))
case(lax.argmin_p, "argmin", lambda x: jnp.argmin(x, 0), X)
case(lax.cumsum_p, "cumsum", lambda x: jnp.cumsum(x, 1), f32(4, 8, 4))
case(lax.cumprod_p, "cumprod", lambda x: jnp.cumprod(x, 0), X, values=((0, uniform(0.5, 1.5)),))
case(lax.cummax_p, "cummax", lambda x: lax.cummax(x, 1), X)
case(lax.cummin_p, "cummin", lambda x: lax.cummin(x, 0, reverse=True), X)
case(lax.cumlogsumexp_p, "cumlogsumexp", lambda x: lax.cumlogsumexp(x, 1), X)

# --- shape ops
case(lax.broadcast_in_dim_p, "broadcast-new-dim", lambda x: lax.broadcast_in_dim(x, (4, 4, 8), (0, 2)), X)
case(lax.broadcast_in_dim_p, "broadcast-size1", lambda x: jnp.broadcast_to(x, (4, 4, 8)), f32(4, 1, 8))
case(lax.reshape_p, "reshape-split-dim", lambda x: x.reshape(4, 2, 4), X)
case(lax.reshape_p, "reshape-merge-dims", lambda x: x.reshape(16, 8), f32(4, 4, 8))
case(lax.reshape_p, "reshape-flatten", lambda x: x.reshape(32), X)
case(lax.reshape_p, "reshape-regroup", lambda x: x.reshape(4, 8), f32(8, 4))
case(lax.reshape_p, "reshape-unit-dims", lambda x: x.reshape(4, 1, 8, 1), f32(4, 8))
case(lax.reshape_p, "reshape-to-short-leading-dim", lambda x: x.reshape(2, 16), X)
case(lax.reshape_p, "reshape-short-leading-dim", lambda x: x.reshape(8, 4), f32(2, 4, 4))
case(lax.transpose_p, "transpose", lambda x: jnp.transpose(x, (2, 0, 1)), f32(4, 8, 4))
case(lax.rev_p, "rev", lambda x: jnp.flip(x, 1), f32(4, 8, 4))
case(lax.squeeze_p, "squeeze", lambda x: jnp.squeeze(x, 1), f32(4, 1, 8))
case(lax.concatenate_p, "concatenate", lambda x, y: jnp.concatenate([x, y], 1), X, f32(4, 4))
case(_compat.stack_p, "stack", lambda x, y: _compat.stack_p.bind(x, y, axis=1), X, X)
case(_compat.unstack_p, "unstack", lambda x: _compat.unstack_p.bind(x, axis=1), f32(4, 2, 8))
case(lax.split_p, "split", lambda x: jnp.split(x, [4], axis=1), X)
case(lax.sort_p, "sort", lambda x: jnp.sort(x, 1), X)
case(lax.sort_p, "sort-two-operands", lambda x: jnp.argsort(x, 0), f32(8, 4, 4))
case(lax.top_k_p, "top_k", lambda x: lax.top_k(x, 4), f32(4, 4, 8))

# --- slicing, padding, gather, scatter
case(lax.pad_p, "pad", lambda x: jnp.pad(x, ((0, 0), (1, 3))), X)
# edge padding on a split dim: the halo signature's ppermuted rows (blocks of 1 row -> 3 rows)
case(lax.pad_p, "pad-halo-both-dims", lambda x: lax.pad(x, 0.5, ((2, 6, 0), (3, 1, 0))), X)
case(lax.pad_p, "pad-interior-negative", lambda x: lax.pad(x, 0.5, ((0, 0, 0), (-1, 2, 1), (0, 0, 0))), f32(4, 8, 4))
case(lax.pad_p, "pad-interior-blocks", lambda x: lax.pad(x, -1.0, ((0, 0, 0), (1, 2, 3))), X)
case(lax.slice_p, "slice", lambda x: x[:, 2:6], X)
case(lax.slice_p, "slice-strided", lambda x: x[:, :, ::2], f32(4, 4, 8))
case(
    lax.dynamic_slice_p,
    "dynamic_slice",
    lambda x, i: lax.dynamic_slice(x, (0, i, 0), (4, 4, 8)),
    f32(4, 8, 8),
    i32(),
    values=((2, ints(0, 5)),),
)
case(
    lax.dynamic_slice_p,
    "dynamic_slice-traced-full-dim",
    lambda x, i, j: lax.dynamic_slice(x, (i, j), (4, 4)),
    X,
    i32(),
    i32(),
    values=((1, ints(-3, 6)), (2, ints(-3, 8))),
)
case(
    lax.dynamic_update_slice_p,
    "dynamic_update_slice",
    lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)),
    X,
    f32(4, 4),
    i32(),
    values=((3, ints(0, 5)),),
)
case(
    lax.dynamic_update_slice_p,
    "dynamic_update_slice-clamped",
    lambda x, u, i, j: lax.dynamic_update_slice(x, u, (i, j, 2)),
    f32(4, 8, 4),
    f32(4, 4, 2),
    i32(),
    i32(),
    values=((2, ints(-3, 4)), (3, ints(-3, 10))),
)
case(lax.gather_p, "gather-take-rows", lambda x, i: x[i], f32(8, 4), i32(4), values=((1, ints(0, 8)),))
case(lax.gather_p, "gather-take-cols", lambda x, i: x[:, i], f32(4, 8), i32(4, 4), values=((1, ints(0, 8)),))
case(
    lax.gather_p,
    "gather-batching-dims",
    lambda x, i: jnp.take_along_axis(x, i, axis=1),
    f32(4, 8),
    i32(4, 4),
    values=((1, ints(0, 8)),),
)
case(
    lax.gather_p,
    "gather-two-components",
    lambda x, i, j: x[i, :, j],
    f32(8, 4, 8),
    i32(4),
    i32(4),
    values=((1, ints(0, 8)),),
)
# Out-of-range lookups: "clip" clamps them into the table, "fill" gives the fill value (NaN by
# default); the vocab signature must do the same with the rows spread over devices.
case(
    lax.gather_p,
    "gather-clip",
    lambda x, i: jnp.take(x, i, axis=0, mode="clip"),
    f32(8, 4),
    i32(4),
    values=((1, out_of_range(8)),),
)
case(
    lax.gather_p,
    "gather-fill",
    lambda x, i: jnp.take(x, i, axis=0, mode="fill", fill_value=-1.0),
    f32(8, 4),
    i32(4),
    values=((1, out_of_range(8)),),
)
case(
    lax.gather_p,
    "gather-fill-nan",
    lambda x, i: jnp.take(x, i, axis=0, mode="fill"),
    f32(8, 4),
    i32(4),
    values=((1, out_of_range(8)),),
)
case(
    lax.scatter_add_p,
    "scatter_add-rows",
    lambda x, i, u: x.at[i].add(u),
    f32(8, 4),
    i32(4),
    f32(4, 4),
    values=((1, ints(0, 8)),),
)
case(
    lax.scatter_add_p,
    "scatter_add-batching-dims",
    jax.vmap(lambda x, i, u: x.at[i].add(u)),
    f32(4, 8, 4),
    i32(4, 4),
    f32(4, 4, 4),
    values=((1, ints(0, 8)),),
)
case(
    lax.scatter_add_p,
    "scatter_add-clip",
    lambda x, i, u: x.at[i].add(u, mode="clip"),
    f32(8, 4),
    i32(4),
    f32(4, 4),
    values=((1, out_of_range(8)),),
)
case(
    lax.scatter_add_p,
    "scatter_add-drop",
    lambda x, i, u: x.at[i].add(u, mode="drop"),
    f32(8, 4),
    i32(4),
    f32(4, 4),
    values=((1, out_of_range(8)),),
)


# --- attention (the XLA implementation on CPU)
def _attention_fwd(q, k, v):
    return sf.attention.attention(q, k, v, causal=True, backend="xla")


def _attention_bwd(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(_attention_fwd(q, k, v))), (0, 1, 2))(q, k, v)


_QKV = (f32(4, 8, 4, 8),) * 3
case(sf.attention_primitives.sf_attention_fwd_p, "attention-fwd-causal", _attention_fwd, *_QKV)
case(
    sf.attention_primitives.sf_attention_fwd_p,
    "attention-fwd-segments",
    lambda q, k, v, s: sf.attention.attention(q, k, v, segment_ids=s, backend="xla"),
    *_QKV,
    i32(4, 8),
    values=((3, ints(0, 2)),),
)
case(
    sf.attention_primitives.sf_attention_fwd_p,
    "attention-fwd-gqa",
    lambda q, k, v: sf.attention.attention(q, k, v, backend="xla"),
    f32(4, 8, 8, 4),
    f32(4, 8, 4, 4),
    f32(4, 8, 4, 4),
)
case(
    sf.attention_primitives.sf_attention_bwd_p,
    "attention-bwd-causal",
    _attention_bwd,
    *_QKV,
    values=((4, uniform(1.0, 3.0)),),
)  # lse: a row's log-sum-exp, never far below its logits


# --- routed experts (dropless MoE; the padded exchange on CPU): tokens [4, 4], k=2 of 4 experts
def _experts_bwd(x, experts, *weights):
    def loss(x, *weights):
        return jnp.sum(jnp.sin(sf.experts.routed_experts(x, experts, *weights)))

    return jax.grad(loss, (0, 1, 2, 3))(x, *weights)


_EXPERTS = (f32(4, 4, 8), i32(4, 4, 2), f32(4, 8, 6), f32(4, 8, 6), f32(4, 6, 8))
case(
    sf.experts_primitives.sf_experts_fwd_p,
    "experts-fwd",
    sf.experts.routed_experts,
    *_EXPERTS,
    values=((1, ints(0, 4)),),
)
case(sf.experts_primitives.sf_experts_bwd_p, "experts-bwd", _experts_bwd, *_EXPERTS, values=((1, ints(0, 4)),))
# the forward's activations kept for the backward ([4, 4, 2, 2, 6]: with the tokens)
case(
    sf.experts_primitives.sf_experts_fwd_p,
    "experts-fwd-kept",
    functools.partial(sf.experts.routed_experts, keep_activations=True),
    *_EXPERTS,
    values=((1, ints(0, 4)),),
)
case(
    sf.experts_primitives.sf_experts_bwd_p,
    "experts-bwd-kept",
    lambda *operands: sf.experts_primitives.sf_experts_bwd_p.bind(
        *operands, config=sf.experts_primitives.ExpertsConfig("padded", keep_activations=True)
    ),
    *_EXPERTS,
    f32(4, 4, 2, 2, 6),
    f32(4, 4, 2, 8),
    values=((1, ints(0, 4)),),
)


# --- fused linear cross-entropy: tokens [4, 4], d 8, vocab 12 in tiles of 5 (the last shifted)
def _linear_ce_fwd(h, w, targets):
    return sf.cross_entropy.linear_cross_entropy(h, w, targets, chunk=5)


def _linear_ce_bwd(h, w, targets):
    return jax.grad(lambda h, w: jnp.sum(jnp.sin(_linear_ce_fwd(h, w, targets))), (0, 1))(h, w)


_LINEAR_CE = (f32(4, 4, 8), f32(8, 12), i32(4, 4))
case(
    sf.cross_entropy_primitives.sf_linear_ce_fwd_p,
    "linear-ce-fwd",
    _linear_ce_fwd,
    *_LINEAR_CE,
    values=((2, ints(0, 12)),),
)
case(
    sf.cross_entropy_primitives.sf_linear_ce_bwd_p,
    "linear-ce-bwd",
    _linear_ce_bwd,
    *_LINEAR_CE,
    values=((2, ints(0, 12)),),
)


# --- convolutions and windowed reductions (shardflow/rules/conv.py)
def _conv(*args, **kw):
    return lambda x, w: lax.conv_general_dilated(x, w, *args, **kw)


_CONV = lax.conv_general_dilated_p
case(_CONV, "conv-3x3-same", _conv((1, 1), "SAME"), f32(4, 4, 8, 8), f32(8, 4, 3, 3))
case(
    _CONV,
    "conv-patches-nhwc",
    _conv((2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")),
    f32(4, 8, 8, 4),
    f32(2, 2, 4, 8),
)
case(
    _CONV,
    "conv-patches-transposed",
    _conv((1, 1), ((1, 1), (1, 1)), lhs_dilation=(2, 2)),
    f32(4, 8, 4, 4),
    f32(4, 8, 2, 2),
)
case(
    _CONV, "conv-dilated-weight-gradient", _conv((1, 1), "VALID", rhs_dilation=(2, 2)), f32(4, 4, 8, 8), f32(4, 4, 4, 4)
)
case(_CONV, "conv-feature-groups", _conv((1, 1), "SAME", feature_group_count=4), f32(4, 8, 8, 4), f32(8, 2, 3, 3))
case(
    _CONV,
    "conv-batch-groups",
    _conv((1,), "SAME", dimension_numbers=("NHC", "HIO", "NHC"), batch_group_count=4),
    f32(8, 4, 4),
    f32(3, 4, 8),
)


def _window(init, op, window, strides, padding="VALID"):
    return lambda x: lax.reduce_window(x, init, op, window, strides, padding)


case(
    lax.reduce_window_sum_p,
    "reduce_window_sum-pool",
    _window(0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2)),
    f32(4, 4, 8, 8),
)
case(
    lax.reduce_window_sum_p,
    "reduce_window_sum-overlapping",
    _window(0.0, lax.add, (1, 1, 3, 3), (1, 1, 1, 1), "SAME"),
    f32(4, 4, 8, 8),
)
case(lax.reduce_window_max_p, "reduce_window_max-pool", _window(-jnp.inf, lax.max, (1, 2, 2), (1, 2, 2)), f32(4, 8, 8))
case(lax.reduce_window_min_p, "reduce_window_min-pool", _window(jnp.inf, lax.min, (1, 4), (1, 4)), f32(4, 8))
case(
    lax.reduce_window_p,
    "reduce_window-generic",
    _window(1.0, lax.mul, (1, 2, 2), (1, 2, 2)),
    f32(4, 8, 8),
    values=((0, uniform(0.5, 1.5)),),
)
_MAX_POOL = _window(-jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2))
case(
    lax.select_and_scatter_add_p,
    "select_and_scatter_add-pool",
    jax.grad(lambda x: jnp.sum(jnp.sin(_MAX_POOL(x)))),
    f32(4, 4, 8, 8),
)
case(
    lax.select_and_scatter_add_p,
    "select_and_scatter_add-overlapping",
    jax.grad(lambda x: jnp.sum(jnp.sin(_window(-jnp.inf, lax.max, (1, 3, 3), (1, 1, 1), "SAME")(x)))),
    f32(4, 8, 8),
)
case(
    getattr(lax, "select_and_gather_add_p", None),
    "select_and_gather_add-pool",
    lambda x, t: jax.jvp(_MAX_POOL, (x,), (t,))[1],
    f32(4, 4, 8, 8),
    f32(4, 4, 8, 8),
)

# --- random numbers (shardflow/rules/random.py)
_RANDOM = getattr(prims, "random_bits_p", None)
case(lax.bitcast_convert_type_p, "bitcast-same-width", lambda x: lax.bitcast_convert_type(x, jnp.int32), X)
case(lax.bitcast_convert_type_p, "bitcast-to-narrower", lambda x: lax.bitcast_convert_type(x, jnp.uint16), X)
case(
    lax.bitcast_convert_type_p,
    "bitcast-to-wider",
    lambda x: lax.bitcast_convert_type(x, jnp.float32),
    (((4, 8, 4), jnp.uint8)),
)
case(
    getattr(prims, "threefry2x32_p", None),
    "threefry2x32",
    lambda *a: prims.threefry2x32_p.bind(*a),
    u32(4, 8),
    u32(4, 8),
    u32(4, 8),
    u32(4, 8),
)
case(getattr(prims, "random_seed_p", None), "random_seed", jax.vmap(jax.vmap(jax.random.key)), u32(4, 8))
_KEY_DTYPE = jax.random.key(0).dtype
case(
    getattr(prims, "random_fold_in_p", None), "random_fold_in", jax.vmap(jax.random.fold_in), ((4,), _KEY_DTYPE), u32(4)
)
case(
    getattr(prims, "random_split_p", None),
    "random_split",
    jax.vmap(lambda k: jax.random.split(k, 4)),
    ((4,), _KEY_DTYPE),
)
case(getattr(_compat, "random_wrap_p", None), "random_wrap", jax.random.wrap_key_data, u32(4, 8, 2))
case(getattr(_compat, "random_unwrap_p", None), "random_unwrap", jax.random.key_data, ((4, 8), _KEY_DTYPE))
case(_RANDOM, "random_bits-u32", lambda k: jax.random.bits(k, (4, 8)), ((), _KEY_DTYPE))
case(_RANDOM, "random_bits-u8", lambda k: jax.random.bits(k, (4, 8, 4), jnp.uint8), ((), _KEY_DTYPE))
case(_RANDOM, "random_bits-key-array", jax.vmap(lambda k: jax.random.bits(k, (8, 4), jnp.uint16)), ((4,), _KEY_DTYPE))


# Primitives with signatures that deliberately have no case here (primitive name -> reason):
# none. Rules without signatures are not signatures to test: control flow (scan, while, cond,
# remat, a user's shard_map) chooses through its own ``propagate`` and runs its bodies through
# the rules tested here; pins (sf_constrain, sharding_constraint) lower to the identity; sf_box
# is the conversion itself (tests/test_random_programs.py checks every conversion); iota is made
# from nothing and always decided whole.
EXCLUDED: dict = {
    # XLA's own generators run whole by their rule (no signature to check): their bits depend on
    # the whole shape. tests/test_edges.py checks they run and are reported as no fallback.
    "rng_bit_generator": "runs whole: no signature",
    "rng_uniform": "runs whole: no signature",
}
