"""Elementwise primitives: same-shape operands split alike; an operand broadcast along a dim
(size 1 there, or a scalar) stays B on that dim's axis."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as prims

from shardflow import _compat
from shardflow.registry import Sig, defrule
from shardflow.specs import B, P, S


def rank(x) -> int:
    return len(x.aval.shape)


def shape(x) -> tuple:
    return tuple(x.aval.shape)


def every(n, sbp) -> tuple:
    return (sbp,) * n


def elementwise(eqn, *, partial_ok: bool):
    out_shape = shape(eqn.outvars[0])
    n_out = len(eqn.outvars)

    def operand_sbp(x, d):
        return S(d) if rank(x) == len(out_shape) and shape(x)[d] == out_shape[d] else B

    sigs = [
        Sig(tuple(operand_sbp(x, d) for x in eqn.invars), every(n_out, S(d)))
        for d in range(len(out_shape))
        if out_shape[d] > 1
    ]
    if partial_ok and all(rank(x) == len(out_shape) for x in eqn.invars):
        sigs.append(Sig(every(len(eqn.invars), P), every(n_out, P)))
    return sigs


LINEAR = [lax.add_p, lax.sub_p, lax.neg_p, prims.add_jaxvals_p, prims.copy_p, prims.real_p, prims.imag_p, prims.conj_p]
NONLINEAR = [
    lax.mul_p,
    lax.div_p,
    lax.max_p,
    lax.min_p,
    lax.pow_p,
    lax.integer_pow_p,
    lax.exp_p,
    lax.exp2_p,
    lax.log_p,
    lax.log1p_p,
    lax.expm1_p,
    lax.tanh_p,
    lax.logistic_p,
    lax.erf_p,
    lax.erfc_p,
    lax.erf_inv_p,
    lax.rsqrt_p,
    lax.sqrt_p,
    lax.cbrt_p,
    lax.sin_p,
    lax.cos_p,
    lax.tan_p,
    lax.atan2_p,
    lax.abs_p,
    lax.sign_p,
    lax.floor_p,
    lax.ceil_p,
    lax.round_p,
    lax.is_finite_p,
    lax.square_p,
    lax.eq_p,
    lax.ne_p,
    lax.lt_p,
    lax.le_p,
    lax.gt_p,
    lax.ge_p,
    lax.and_p,
    lax.or_p,
    lax.not_p,
    lax.xor_p,
    lax.rem_p,
    lax.nextafter_p,
    lax.select_n_p,
    lax.clamp_p,
    lax.shift_left_p,
    lax.shift_right_logical_p,
    lax.shift_right_arithmetic_p,
    lax.population_count_p,
    lax.stop_gradient_p,
    lax.reduce_precision_p,  # rounding each part is not rounding their sum
    prims.sinh_p,
    prims.cosh_p,
    prims.asin_p,
    prims.acos_p,
    prims.atan_p,
    prims.asinh_p,
    prims.acosh_p,
    prims.atanh_p,
    prims.clz_p,
    prims.lgamma_p,
    prims.digamma_p,
    prims.complex_p,
    _compat.one_minus_square_p,
]
SHAPE_KEEPING = frozenset(p for p in LINEAR + NONLINEAR + [lax.convert_element_type_p] if p is not None)

defrule(*LINEAR)(lambda eqn: elementwise(eqn, partial_ok=True))
defrule(*NONLINEAR)(lambda eqn: elementwise(eqn, partial_ok=False))


def _partial_passes(src, dst) -> bool:
    """Whether a partial sum may pass a cast from ``src`` to ``dst``: the cast of the sum is the
    sum of the casts, in the program's precision. Between integers narrowing or keeping the
    width (two's complement wraps alike; a widening one does not: the narrow parts' sum wraps,
    the wide one does not); to a float from a float or an integer of the same width. Not a
    wider float: the sum would move in it (the 1b step under tp reduce-scattered RMSNorm's
    backward in f32, twice the bytes of Megatron's bf16 all-reduce). Not a narrower float: each
    part rounded before the sum is not the program's one rounding of it (f32 parts of a
    64-term dot cast to bf16 and summed: 20 % off where they cancel). Not to or from bool, nor
    float -> int (truncation)."""
    src, dst = np.dtype(src), np.dtype(dst)
    integer = lambda d: jnp.issubdtype(d, jnp.integer)  # noqa: E731
    if jnp.issubdtype(dst, jnp.inexact):
        return (jnp.issubdtype(src, jnp.inexact) or integer(src)) and dst.itemsize == src.itemsize
    return integer(src) and integer(dst) and dst.itemsize <= src.itemsize


defrule(lax.convert_element_type_p, prims.copy_p, same_value=True)  # a weight cast is still the weight


@defrule(lax.convert_element_type_p)
def _convert_element_type(eqn):
    (x,) = eqn.invars
    return elementwise(eqn, partial_ok=_partial_passes(x.aval.dtype, eqn.params["new_dtype"]))
