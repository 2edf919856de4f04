"""Random numbers: key plumbing, bit casts, and random bits generated where they are used.

Keys are typed key arrays (``key<fry>[...]``): their shapes exclude the key data dim, so every
key primitive is elementwise over the key dims and binds unchanged on local blocks.

``random_bits`` with its output split on a dim of the bits (the key B) generates only this
device's block. With ``jax_threefry_partitionable`` (on by default in jax 0.10 and 0.11)
threefry's bits are counter based: element ``i`` of the bits — ``i`` its row-major index in the
global shape, as a uint64 split into two uint32 halves (hi, lo) — is
``threefry2x32(key, (hi, lo))``, folded to the bit width (``_threefry_random_bits_partitionable``
and ``iota_2x32_shape`` in jax's prng module). The lowering builds the global counters of its own block from the block
offsets, so each device hashes 1/n of the elements and the bits equal one device's exactly.
Other PRNG implementations (rbg) and threefry with the flag off draw from a sequence that does
not partition: the lowering then generates the whole bits on every device and keeps its block
(still the right bits; the flops are those of running it whole, the ops after it run split).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as prims

from shardflow import _compat
from shardflow.registry import Sig, bind_params, defrule
from shardflow.rules.elementwise import elementwise, rank, shape
from shardflow.specs import B, S


def _same_dims(eqn, n):
    """S(d) -> S(d) on the first ``n`` dims (those the operand and result share)."""
    out = shape(eqn.outvars[0])
    return [Sig((S(d),), (S(d),)) for d in range(n) if out[d] > 1]


# ------------------------------------------------------------------------------ bit casts


@defrule(lax.bitcast_convert_type_p)
def _bitcast_convert_type(eqn):
    # Equal itemsizes: elementwise. A wider result drops the operand's trailing dim (the ratio
    # of itemsizes), a narrower one adds it: the dims before it are elementwise, that one whole.
    return _same_dims(eqn, min(rank(eqn.invars[0]), rank(eqn.outvars[0])))


# ------------------------------------------------------------------------------ keys

# The threefry hash: elementwise in its four uint32 operands (two key halves, two counts).
defrule(prims.threefry2x32_p)(lambda eqn: elementwise(eqn, partial_ok=False))
# Seeds -> keys and (keys, messages) -> keys: elementwise over the key dims.
defrule(prims.random_seed_p, prims.random_fold_in_p)(lambda eqn: elementwise(eqn, partial_ok=False))
# Key data uint32[..., 2] -> key<impl>[...] (wrap), back (unwrap), and key<>[...] ->
# key<>[..., *shape] (split): the key dims keep their split; the data dim and the new dims of a
# split are whole.
defrule(_compat.random_wrap_p)(lambda eqn: _same_dims(eqn, rank(eqn.outvars[0])))
defrule(_compat.random_unwrap_p, prims.random_split_p)(lambda eqn: _same_dims(eqn, rank(eqn.invars[0])))
# XLA's own generators: their bits depend on the whole shape, so they run whole (B), as intended.
defrule(lax.rng_bit_generator_p, lax.rng_uniform_p)(lambda eqn: [])


# ------------------------------------------------------------------------------ random bits


def _random_bits_signatures(eqn):
    keys, out = eqn.invars[0], eqn.outvars[0]
    k = rank(keys)
    # A dim of the bits: the key B, each device generates its block ("bits", see the lowering).
    sigs = [Sig((B,), (S(d),), "bits") for d in range(k, rank(out)) if shape(out)[d] > 1]
    # A key dim: each device draws the bits of the keys it holds (binds unchanged).
    sigs += [Sig((S(d),), (S(d),)) for d in range(k) if shape(out)[d] > 1]
    return sigs


def _partitionable(keys_aval) -> bool:
    return _compat.prng_impl_name(keys_aval.dtype) == "threefry2x32" and bool(jax.config.jax_threefry_partitionable)


def _lower_random_bits(local, eqn, ins):
    (keys,) = ins
    params = bind_params(eqn)
    out = eqn.outvars[0]
    k = rank(eqn.invars[0])
    whole = tuple(params["shape"])  # one key's bits, global
    block = tuple(local.shape(out)[k:])  # one key's bits, this device's block
    if block == whole:  # split on key dims only (or not at all): each key's bits are whole
        return eqn.primitive.bind(keys, **params)
    starts = []
    for d, (w, b) in enumerate(zip(whole, block)):
        idx, _ = local.shard_index(out, k + d)
        starts.append(idx * b if b != w else jnp.int32(0))
    if not _partitionable(eqn.invars[0].aval):
        # Not counter based: generate every bit, keep this device's block.
        bits = eqn.primitive.bind(keys, **params)
        return lax.dynamic_slice(bits, [jnp.int32(0)] * k + starts, tuple(keys.shape) + block)
    data = jax.random.key_data(keys)  # uint32[*keys, 2]
    hi, lo = _global_counters(whole, block, starts)
    k1, k2 = data[..., 0], data[..., 1]
    if k:  # a key array: every key hashes the same counters (as vmap of random_bits does)
        full = tuple(keys.shape) + block
        k1, k2 = (lax.broadcast_in_dim(h, full, tuple(range(k))) for h in (k1, k2))
        hi, lo = (lax.broadcast_in_dim(c, full, tuple(range(k, len(full)))) for c in (hi, lo))
    bits1, bits2 = prims.threefry2x32_p.bind(k1, k2, hi, lo)
    return _fold(bits1, bits2, params["bit_width"])


def _fold(bits1, bits2, bit_width):
    """Two uint32 hash words -> bits of ``bit_width``, as JAX's partitionable threefry does."""
    dtype = jnp.dtype(f"uint{bit_width}")
    if bit_width == 64:
        hi = lax.convert_element_type(bits1, dtype)
        lo = lax.convert_element_type(bits2, dtype)
        return lax.shift_left(hi, jnp.asarray(32, dtype=dtype)) | lo
    if bit_width == 32:
        return bits1 ^ bits2
    return lax.convert_element_type(bits1 ^ bits2, dtype)


_U32 = np.dtype("uint32")
_LOW16 = np.uint32(0xFFFF)


def _global_counters(whole, block, starts):
    """(hi, lo): the uint64 row-major index in ``whole`` of each element of the ``block`` that
    starts at ``starts`` (traced ints), as two uint32 arrays of the block's shape."""
    strides = [math.prod(whole[d + 1 :]) for d in range(len(whole))]
    index = [lax.broadcasted_iota(_U32, block, d) + starts[d].astype(_U32) for d in range(len(block))]
    if math.prod(whole) < 2**32:  # every index and stride fits in the low word
        lo = sum((i * np.uint32(s) for i, s in zip(index, strides) if s), jnp.zeros(block, _U32))
        return jnp.zeros(block, _U32), lo
    hi = lo = jnp.zeros(block, _U32)
    for i, s in zip(index, strides):
        term_hi, term_lo = _mul_wide(i, s & 0xFFFFFFFF)
        term_hi = term_hi + i * np.uint32(s >> 32)  # mod 2**64: the index is < 2**64
        lo = lo + term_lo
        hi = hi + term_hi + (lo < term_lo).astype(_U32)  # the carry out of the low word
    return hi, lo


def _mul_wide(x, c: int):
    """(hi, lo) of the 64-bit product of a uint32 array ``x`` and a constant ``c`` < 2**32."""
    x0, x1 = x & _LOW16, lax.shift_right_logical(x, np.uint32(16))
    c0, c1 = np.uint32(c & 0xFFFF), np.uint32(c >> 16)
    p00, p01, p10, p11 = x0 * c0, x0 * c1, x1 * c0, x1 * c1
    shift = np.uint32(16)
    mid = lax.shift_right_logical(p00, shift) + (p01 & _LOW16) + (p10 & _LOW16)
    hi = (
        p11
        + lax.shift_right_logical(p01, shift)
        + lax.shift_right_logical(p10, shift)
        + lax.shift_right_logical(mid, shift)
    )
    return hi, x * np.uint32(c)


defrule(prims.random_bits_p, lower=_lower_random_bits)(_random_bits_signatures)
