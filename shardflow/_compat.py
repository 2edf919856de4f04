"""Every private JAX name shardflow uses, in one place.

Everything else imports public API (``jax.extend.core``, ``jax.interpreters.*``, ``jax.tree``).
Each name here is private because JAX has no public spelling for it yet; the comment says what
it is for. Checked on jax 0.10.2 (CI) and 0.11.2 (the device machine).
"""

from __future__ import annotations

from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import source_info_util as _source_info_util
from jax._src import xla_bridge as _xla_bridge
from jax._src.lax import lax as _lax
from jax._src.lax import parallel as _parallel

# lax.stack / lax.unstack and tanh's derivative (jax 0.11) have no public primitive names.
stack_p = _lax.stack_p
unstack_p = _lax.unstack_p
one_minus_square_p = getattr(_lax, "one_minus_square_p", None)

# Which files are user code in JAX's view (not JAX, the stdlib or a registered exclusion), and a
# registration that overrides an exclusion for a path under it (jax.extend has only exclusions).
is_user_filename = _source_info_util.is_user_filename
register_inclusion = _source_info_util.register_inclusion


def traceback_frames(traceback) -> list:
    """The frames (``file_name``, ``start_line``, ...) of an equation's traceback (None: there is
    none), innermost first."""
    code, lasti = traceback.raw_frames() if traceback is not None else ((), ())
    return [_source_info_util.raw_frame_to_frame(c, i) for c, i in zip(code, lasti)]


# A primitive's eager implementation by compiling it (for primitives with a lowering only).
apply_primitive = _dispatch.apply_primitive


def backends_are_initialized() -> bool:
    """Whether JAX has created its backends (after which XLA_FLAGS are read and fixed)."""
    return _xla_bridge.backends_are_initialized()


def shard_map_primitive():
    """The primitive of ``jax.shard_map`` (a user's own shard_map inside a parallelized fn)."""
    from jax._src import shard_map

    return shard_map.shard_map_p


def tpu_info():
    """The chip table Pallas' Mosaic TPU lowering reads (a test lowers for a v5e without a TPU)."""
    from jax._src.pallas.mosaic import tpu_info as info

    return info


# random_wrap / random_unwrap (uint32 key data <-> a typed key array) have no public primitive
# names (jax.extend.core.primitives lists random_bits/split/fold_in/seed but not these two).
try:  # jax 0.10 and 0.11: jax/_src/random/prng.py
    from jax._src.random import prng as _prng
except ImportError:  # older layout: jax/_src/prng.py
    from jax._src import prng as _prng
random_wrap_p = getattr(_prng, "random_wrap_p", None)
random_unwrap_p = getattr(_prng, "random_unwrap_p", None)


def prng_impl_name(dtype) -> str | None:
    """The PRNG implementation's name ("threefry2x32", "rbg", ...) of a key array's dtype, read
    from its aval (jax.random.key_impl needs an array): shardflow's random_bits lowering
    reproduces only threefry2x32's counter-based bits."""
    return getattr(getattr(dtype, "_impl", None), "name", None)


def scan_params(params, jaxpr, *, consts: int, carries: int, xs: int, ys: int) -> dict:
    """A scan equation's params for a new body ``jaxpr`` of these operand and result groups,
    the others (length, reverse, unroll) as in ``params``."""
    new = dict(params, jaxpr=jaxpr)
    if "num_consts" in params:
        new.update(num_consts=consts, num_carry=carries)
        if "linear" in params:
            new["linear"] = (False,) * (consts + carries + xs)
        return new
    from jax._src import flattree as ft

    new.update(
        ft_in=ft.pack((ft.nones(consts), ft.nones(carries), ft.nones(xs))),
        ft_out=ft.pack((ft.nones(carries), ft.nones(ys))),
    )
    return new


# A shard_map body traced with varying-axis types (check_vma) casts with pvary and reduces with
# psum_invariant; neither has a public primitive name.
pvary_p = getattr(_core, "pvary_p", None)
psum_invariant_p = getattr(_parallel, "psum_invariant_p", None)
