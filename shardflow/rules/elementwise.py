"""Elementwise primitives: same-shape operands split alike; an operand broadcast along a dim
(size 1 there, or a scalar) stays B on that dim's axis."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as prims

from shardflow.elementwise_primitives import LINEAR, NONLINEAR
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
