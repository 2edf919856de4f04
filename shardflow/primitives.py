"""shardflow's own primitives: ``constrain`` (a user pin) and ``box`` (an inserted conversion).

Both are the identity on values; they exist so the passes — and JAX's jaxpr printer — see them.
"""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

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
