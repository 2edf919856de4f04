"""Per-rule soundness: for every signature of every rule, the equation run on local
blocks equals the equation run whole — the way JAX tests its batching rules against vmap.

A catalog holds small jnp/lax functions, one or more per primitive with signatures. For each
entry the equation of its primitive is taken out of the traced jaxpr and run alone: once whole
(``jaxpr_as_fun`` under ``jax.jit``, the reference), and once as a one-equation Program whose
equation carries a forced Decision (one signature per mesh axis), through ``boxing`` and
``lower``. Every operand starts as the signature needs it; a P operand is fed as random
per-device parts (a stacked input split over the partial axes, one squeeze equation ahead),
so a signature that is not linear in a partial operand shows; P outputs are reduced by the
boxing (P -> B all-reduce), so a wrong partial shows as a wrong sum.

``test_catalog_covers_every_rule`` fails when a primitive with a ``signatures`` function has no
catalog entry: a new rule needs a soundness case here (or an explicit exclusion with a reason).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, Var, jaxpr_as_fun, new_jaxpr_eqn
from jax.extend.core import primitives as prims

import shardflow as sf
import shardflow.ops  # noqa: F401  (registers the attention primitives' rule)
import shardflow.rules  # noqa: F401  (registers every rule)
from shardflow import _compat, passes, registry
from shardflow.program import Program
from shardflow.registry import DECISION, Decision, Sig
from shardflow.specs import B, Partial, ShardingError, Split, check_divisible

EXAMPLES = int(os.environ.get("SHARDFLOW_SOUNDNESS_EXAMPLES", "3"))  # per signature, 1 axis
EXAMPLES_2D = int(os.environ.get("SHARDFLOW_SOUNDNESS_EXAMPLES_2D", "2"))  # per case, 2x2 mesh
SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)


# ------------------------------------------------------------------------------ values


def is_key(dtype) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _normal(rng, shape, dtype):
    if is_key(dtype):  # typed PRNG keys: distinct keys from a drawn seed
        keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), max(1, math.prod(shape)))
        return keys.reshape(shape)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.unsignedinteger):
        return rng.integers(0, 17, shape).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-8, 9, shape).astype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def uniform(lo, hi):
    return lambda rng, shape, dtype: rng.uniform(lo, hi, shape).astype(dtype)


def ints(lo, hi):
    """Integers in [lo, hi)."""
    return lambda rng, shape, dtype: rng.integers(lo, hi, shape).astype(dtype)


def nonzero(rng, shape, dtype):
    return (rng.integers(1, 9, shape) * rng.choice([-1, 1], shape)).astype(dtype)


def scaled(s):
    return lambda rng, shape, dtype: (s * rng.standard_normal(shape)).astype(dtype)


def out_of_range(size):
    """Indices into a dim of ``size``: in [-4, size + 4), the first always above, the last below."""

    def gen(rng, shape, dtype):
        x = rng.integers(-4, size + 4, shape)
        x.flat[0], x.flat[-1] = size + 1, -2
        return x.astype(dtype)

    return gen


POS, UNIT, GE1 = uniform(0.5, 2.0), uniform(-0.9, 0.9), uniform(1.1, 3.0)


# ------------------------------------------------------------------------------ the catalog


@dataclasses.dataclass(frozen=True, repr=False)
class Case:
    name: str  # test id
    prim: object  # the primitive whose equation is tested
    fn: Callable
    args: tuple  # (shape, dtype) of fn's arguments, for tracing
    values: tuple = ()  # (operand index of the equation, generator) where not _normal
    xfail: tuple = ()  # (signature repr, reason): known unsound signatures

    def __repr__(self):
        return f"Case({self.name!r})"


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
    return sf.ops.attention(q, k, v, causal=True, backend="xla")


def _attention_bwd(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(_attention_fwd(q, k, v))), (0, 1, 2))(q, k, v)


_QKV = (f32(4, 8, 4, 8),) * 3
case(sf.ops.sf_attention_fwd_p, "attention-fwd-causal", _attention_fwd, *_QKV)
case(
    sf.ops.sf_attention_fwd_p,
    "attention-fwd-segments",
    lambda q, k, v, s: sf.ops.attention(q, k, v, segment_ids=s, backend="xla"),
    *_QKV,
    i32(4, 8),
    values=((3, ints(0, 2)),),
)
case(
    sf.ops.sf_attention_fwd_p,
    "attention-fwd-gqa",
    lambda q, k, v: sf.ops.attention(q, k, v, backend="xla"),
    f32(4, 8, 8, 4),
    f32(4, 8, 4, 4),
    f32(4, 8, 4, 4),
)
case(
    sf.ops.sf_attention_bwd_p, "attention-bwd-causal", _attention_bwd, *_QKV, values=((4, uniform(1.0, 3.0)),)
)  # lse: a row's log-sum-exp, never far below its logits


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


# ------------------------------------------------------------------------------ the harness


def _find(jaxpr, prim):
    """The first equation of ``prim`` in ``jaxpr`` or its nested jaxprs (jnp wraps ops in jits)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is prim:
            return eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, (Jaxpr, ClosedJaxpr)):
                    found = _find(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub, prim)
                    if found is not None:
                        return found
    return None


@functools.cache
def traced(c: Case):
    """(the equation of ``c.prim``, with every result a fresh Var; its signatures, () while the
    primitive has no rule)."""
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in c.args]
    eqn = _find(jax.make_jaxpr(c.fn)(*args).jaxpr, c.prim)
    assert eqn is not None, f"{c.name}: no {c.prim.name} equation in the traced function"
    eqn = eqn.replace(outvars=[Var(v.aval) for v in eqn.outvars])  # DropVars become results
    return eqn, tuple(registry.signatures(eqn) or ())


def operands(eqn):
    """The distinct non-literal operands of ``eqn``, in order of first use."""
    out = []
    for x in eqn.invars:
        if not isinstance(x, Literal) and x not in out:
            out.append(x)
    return out


@functools.cache
def mesh(sizes: tuple):
    return sf.make_mesh(dict(zip("xy", sizes)))


def nd(sigs, field, k):
    return tuple(getattr(s, field)[k] for s in sigs)


def decision(eqn, sigs) -> Decision:
    return Decision(
        ins=tuple(nd(sigs, "ins", k) for k in range(len(eqn.invars))),
        outs=tuple(nd(sigs, "outs", j) for j in range(len(eqn.outvars))),
        sigs=tuple(sigs),
    )


def valid(c: Case, eqn, sigs, m) -> bool:
    """Whether per-axis signatures ``sigs`` together fit ``eqn`` on mesh ``m`` as propagation
    checks it: every split dim divides, no complex P(max), no literal split, and the rule
    ``admits`` it."""
    admits = registry.rule_of(eqn.primitive).admits
    if admits is not None and not admits(eqn, decision(eqn, sigs), m):
        return False
    for atoms, field in ((eqn.invars, "ins"), (eqn.outvars, "outs")):
        for k, x in enumerate(atoms):
            sbp = nd(sigs, field, k)
            if isinstance(x, Literal) and any(isinstance(s, Split) for s in sbp):
                return False
            try:
                check_divisible(x.aval.shape, x.aval.dtype, sbp, m, what="value")
            except ShardingError:
                return False
    return True


def _debug_info(c: Case, invars, outvars) -> DebugInfo:
    return DebugInfo(
        "test_rule_soundness",
        c.name,
        tuple(f"x{k}" for k in range(len(invars))),
        tuple(f"[{j}]" for j in range(len(outvars))),
    )


@dataclasses.dataclass
class Built:
    fn: Callable  # the lowered SPMD callable
    stacked: list  # per program input: None, or (leading dims, their ops) of stacked parts


@functools.cache
def build(c: Case, sig_idx: tuple, sizes: tuple) -> Built:
    """The one-equation Program of ``c`` with signature ``sigs[i]`` on mesh axis ``i``, boxed
    and lowered."""
    eqn, all_sigs = traced(c)
    sigs = tuple(all_sigs[i] for i in sig_idx)
    m = mesh(sizes)
    d = decision(eqn, sigs)
    ins, outs = d.ins, d.outs
    body = eqn.replace(params={**eqn.params, DECISION: d})
    eqns, invars, in_sbp, stacked, sbp = [], [], [], [], {}
    for x in operands(eqn):
        want = ins[eqn.invars.index(x)]  # as its first use needs it; boxing converts for others
        sbp[x] = want
        p_axes = [i for i, s in enumerate(want) if isinstance(s, Partial)]
        if not p_axes:
            invars.append(x)
            in_sbp.append(want)
            stacked.append(None)
            continue
        # A partial operand: its parts are a program input with one leading dim per P axis,
        # split over that axis; a squeeze (its decision forced too) makes the local part.
        lead = len(p_axes)
        parts = Var(jax.core.ShapedArray(tuple(sizes[i] for i in p_axes) + tuple(x.aval.shape), x.aval.dtype))
        parts_sbp = tuple(
            Split(p_axes.index(i)) if isinstance(s, Partial) else Split(s.dim + lead) if isinstance(s, Split) else s
            for i, s in enumerate(want)
        )
        squeeze = new_jaxpr_eqn(
            [parts],
            [x],
            lax.squeeze_p,
            {"dimensions": tuple(range(lead)), DECISION: Decision((parts_sbp,), (want,))},
            frozenset(),
        )
        eqns.append(squeeze)
        invars.append(parts)
        in_sbp.append(parts_sbp)
        sbp[parts] = parts_sbp
        stacked.append((tuple(sizes[i] for i in p_axes), tuple(want[i].op for i in p_axes)))
    sbp.update(zip(eqn.outvars, outs))
    jaxpr = Jaxpr([], invars, list(eqn.outvars), eqns + [body], debug_info=_debug_info(c, invars, eqn.outvars))
    out_sbp = tuple(tuple(B if isinstance(s, Partial) else s for s in o) for o in outs)
    program = Program(
        ClosedJaxpr(jaxpr, []),
        m,
        in_sbp=tuple(in_sbp),
        out_sbp=out_sbp,
        sbp=sbp,
        facts=frozenset({"inlined", "sharded"}),
    )
    program = passes.run(program, [p for p in passes.DEFAULT if p.name in ("boxing", "unroll", "lower")])
    fn, _ = program.lowered
    return Built(fn, stacked)


@functools.cache
def reference(c: Case):
    eqn, _ = traced(c)
    jaxpr = Jaxpr([], operands(eqn), list(eqn.outvars), [eqn], debug_info=_debug_info(c, operands(eqn), eqn.outvars))
    return jax.jit(jaxpr_as_fun(ClosedJaxpr(jaxpr, [])))


def _combine(parts, ops):
    """The global value of stacked parts: the sum (max, min) over each leading dim."""
    for op in ops:
        if parts.dtype == np.bool_:
            parts = parts.any(0)
        else:
            parts = {"sum": lambda p: p.sum(0, dtype=p.dtype), "max": lambda p: p.max(0), "min": lambda p: p.min(0)}[
                op
            ](parts)
    return parts


def _parts(rng, x, lead, gen):
    """Random parts of a partial operand (a bool's first part is the value, the others False)."""
    shape = tuple(lead) + tuple(x.aval.shape)
    dtype = np.dtype(x.aval.dtype)
    if dtype == np.bool_:
        parts = np.zeros(shape, bool)
        parts[(0,) * len(lead)] = gen(rng, x.aval.shape, dtype)
        return parts
    return gen(rng, shape, dtype)


def _tolerance(expected, inputs):
    """(rtol, atol): exact for ints and bools; 1e-5 for fp32, 1e-2 for 16-bit floats, atol scaled
    by the largest finite magnitude of the result and the operands and parts (a partial's parts
    round on their own scale)."""
    if not jnp.issubdtype(expected.dtype, jnp.inexact):
        return 0.0, 0.0
    eps = 1e-2 if expected.dtype.itemsize <= 2 else 1e-5
    scale = 1.0
    for x in [expected, *inputs]:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            finite = np.abs(x[np.isfinite(x)]).astype(np.float64)
            scale = max(scale, float(finite.max()) if finite.size else 1.0)
    return eps, eps * scale


def check(c: Case, sig_idx: tuple, sizes: tuple, seed: int):
    """The lowered one-equation Program of ``c`` under signatures ``sig_idx`` (one per axis of the
    mesh of ``sizes``) equals the equation run whole, on values drawn from ``seed``."""
    eqn, _ = traced(c)
    built = build(c, sig_idx, sizes)
    rng = np.random.default_rng(seed)
    gens = dict(c.values)
    sigs = [traced(c)[1][i] for i in sig_idx]
    where = f"{c.name} under {' / '.join(map(sig_repr, sigs))} on mesh {dict(zip('xy', sizes))}, seed {seed}"
    args, whole = [], []
    for x, stacked in zip(operands(eqn), built.stacked):
        gen = gens.get(eqn.invars.index(x)) or _normal
        if stacked is None:
            value = gen(rng, x.aval.shape, x.aval.dtype)
            args.append(value)
            whole.append(value)
        else:
            lead, ops = stacked
            parts = _parts(rng, x, lead, gen)
            args.append(parts)
            whole.append(_combine(parts, ops))
    actual = built.fn(*args)
    expected = reference(c)(*whole)
    assert len(actual) == len(expected)
    values = [x for x in args + whole if not is_key(x.dtype)]
    for j, (a, e) in enumerate(zip(actual, expected)):
        if is_key(e.dtype):
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        a, e = np.asarray(a), np.asarray(e)
        assert (a.shape, a.dtype) == (e.shape, e.dtype), f"result {j} of {where}"
        rtol, atol = _tolerance(e, values)
        if e.dtype.itemsize <= 2 and jnp.issubdtype(e.dtype, jnp.floating):
            a, e = a.astype(np.float32), e.astype(np.float32)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"result {j} of {where}")


# ------------------------------------------------------------------------------ the tests


def sig_repr(sig: Sig) -> str:
    fmt = lambda atoms: ",".join(map(repr, atoms))  # noqa: E731
    return f"{fmt(sig.ins)}->{fmt(sig.outs)}" + (f":{sig.name}" if sig.name else "")


def _xfails(c: Case) -> dict:
    return dict(c.xfail)


def _signature_params():
    params = []
    for c in CATALOG:
        _, sigs = traced(c)
        for i, sig in enumerate(sigs):
            reason = _xfails(c).get(sig_repr(sig))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(c, i, id=f"{c.name}:{sig_repr(sig)}", marks=marks))
    return params


def test_catalog_covers_every_rule():
    """Every primitive whose rule has signatures has a case (or an exclusion with a reason);
    every case's equation has signatures, and every xfail names one of them."""
    covered = {c.prim for c in CATALOG}
    missing = sorted(
        p.name
        for p, rule in registry.RULES.items()
        if rule.signatures is not None and p not in covered and p.name not in EXCLUDED
    )
    assert not missing, f"rules without a soundness case in tests/test_rule_soundness.py: {missing}"
    names = [c.name for c in CATALOG]
    assert len(set(names)) == len(names), "case names are test ids: make them unique"
    for c in CATALOG:
        eqn, sigs = traced(c)
        assert sigs, f"{c.name}: {eqn.primitive.name} has no signature here (no rule registered?)"
        assert set(_xfails(c)) <= {sig_repr(s) for s in sigs}, f"{c.name}: stale xfail {c.xfail}"
    stale = sorted(set(EXCLUDED) - {p.name for p, rule in registry.RULES.items() if rule.signatures is not None})
    assert not stale, f"exclusions of primitives without signatures: {stale}"


@pytest.mark.parametrize("c, i", _signature_params())
@settings(max_examples=EXAMPLES, **SETTINGS)
@given(n=st.sampled_from([2, 4]), seed=st.integers(0, 2**32 - 1))
@example(n=4, seed=1)
def test_signature_is_sound(c, i, n, seed):
    """One signature on a mesh {"x": n}: blocks computed locally equal the whole result."""
    eqn, sigs = traced(c)
    assert valid(c, eqn, (sigs[i],), mesh((2,))), f"{c.name}: pick shapes that {sig_repr(sigs[i])} splits"
    assume(valid(c, eqn, (sigs[i],), mesh((n,))))
    check(c, (i,), (n,), seed)


def _two_axis_params():
    params = []
    for c in CATALOG:
        eqn, sigs = traced(c)
        sound = [i for i, s in enumerate(sigs) if sig_repr(s) not in _xfails(c)]
        if sound:
            params.append(pytest.param(c, id=c.name))
    return params


@pytest.mark.parametrize("c", _two_axis_params())
@settings(max_examples=EXAMPLES_2D, **SETTINGS)
@given(data=st.data())
def test_two_signatures_on_a_2x2_mesh_are_sound(c, data):
    """One signature per axis of {"x": 2, "y": 2}, drawn among the pairs that fit together (the
    known-unsound signatures left out): the nd Decision propagation would make."""
    eqn, sigs = traced(c)
    m = mesh((2, 2))
    sound = [i for i, s in enumerate(sigs) if sig_repr(s) not in _xfails(c)]
    pairs = [(a, b) for a in sound for b in sound if valid(c, eqn, (sigs[a], sigs[b]), m)]
    assert pairs
    a, b = data.draw(st.sampled_from(pairs), label="signatures")
    check(c, (a, b), (2, 2), data.draw(st.integers(0, 2**32 - 1), label="seed"))
