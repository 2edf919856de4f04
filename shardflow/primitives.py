"""shardflow's own primitives: ``constrain`` (a user pin) and ``box`` (an inserted conversion).

Both are the identity on values; they exist so the passes — and JAX's jaxpr printer — see them.
``kernel_primitive`` makes the primitives that stand for a kernel (attention, routed experts).
"""

from __future__ import annotations

import functools

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from shardflow import _compat

constrain_p = Primitive("sf_constrain")
constrain_p.def_impl(lambda x, *, spec: x)
constrain_p.def_abstract_eval(lambda x, *, spec: x)
mlir.register_lowering(constrain_p, lambda ctx, x, *, spec: [x])
ad.deflinear2(
    constrain_p, lambda ct, x, *, spec: [constrain_p.bind(ct, spec=spec)] if not isinstance(ct, ad.Zero) else [ct]
)
batching.primitive_batchers[constrain_p] = lambda args, dims, *, spec: (constrain_p.bind(args[0], spec=spec), dims[0])


def constrain(x, spec):
    """Pin the sharding of ``x`` to ``spec`` (SBP or PartitionSpec) inside a parallelized function.

    Outside ``parallelize`` it is the identity. The gradient of a pinned value is pinned the
    same way (the transpose of a constraint is the constraint).
    """
    return constrain_p.bind(x, spec=_Hashable(spec))


class _Hashable:
    """Wraps a spec so it can sit in a jaxpr param (PartitionSpec/tuples already hash; strings too)."""

    __slots__ = ("spec",)

    def __init__(self, spec):
        self.spec = spec.spec if isinstance(spec, _Hashable) else spec

    def __hash__(self):
        return hash(repr(self.spec))

    def __eq__(self, other):
        return isinstance(other, _Hashable) and repr(self.spec) == repr(other.spec)

    def __repr__(self):
        return repr(self.spec)


box_p = Primitive("sf_box")
box_p.def_abstract_eval(lambda x, **_: x)


def kernel_primitive(name: str, kernel):
    """A primitive of several results computing ``kernel(config, *operands)``, its one param
    ``config``; lowered by tracing the kernel, its shapes by evaluating it abstractly.

    A kernel is a primitive rather than a named ``jit`` call for two reasons the compiler needs:
    JAX's partial evaluation (inside a differentiated scan) never splits a primitive, and a
    primitive rebinds at any operand shapes — the sharding passes run it on local blocks and its
    abstract evaluation gives the local result shapes."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(functools.partial(_compat.apply_primitive, prim))

    def abstract_eval(*avals, config):
        shapes = jax.eval_shape(functools.partial(kernel, config), *avals)
        return [jax.core.ShapedArray(x.shape, x.dtype) for x in shapes]

    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(lambda *args, config: kernel(config, *args), multiple_results=True))
    return prim
