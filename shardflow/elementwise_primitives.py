"""The elementwise primitives: linear ones (a partial sum passes them) and the rest, and
SHAPE_KEEPING, every primitive whose result has its operands' shape. Low in the layers: the
conversion planner and the passes ask which primitives keep shapes, the elementwise rule
(shardflow.rules.elementwise) registers their signatures."""

from __future__ import annotations

from jax import lax
from jax.extend.core import primitives as prims

from shardflow import _compat

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
