"""cse: one equation per computation — a second equation of the same primitive, params and
operands reads the first one's results.

Before: the jaxpr as inlined. A training step computes some values twice: optax's
``clip_by_global_norm`` squares every gradient for the norm it clips by, and the step squares
them again for the norm it logs; JAX's transposes broadcast the same cotangent once per use.
After: each such repeat is gone and its uses read the first; nested bodies are done alike,
each on its own. XLA merges them too when it compiles, but the planner sees the jaxpr: the 7b
step's duplicated squares alone cost its integer program 10k rows (every gradient converted
to every layout, once per square) and the greedy planner a conversion chosen twice.

Not merged: equations with effects; equations whose params do not hash (compared by value
they could be, but none of the repeats seen has them); and expansions — an equation whose
result has more elements than its largest operand (a broadcast of a scalar, an iota): made
again where used, as XLA's fusion makes them, rather than one big value every use converts.
Two equal expansions are still the same operand to what reads them: optax's norm squares
each gradient's imaginary part, a broadcast zero made once per norm, and adds it to the
square of the real part — with that, one add and one sum per gradient, not two. A constant
(computed from literals alone: that zero's square) is merged only with one computed from the
same operands, as any value: were equal constants one, every gradient of a shape would add
the same squared zero, laid out for the first. Equations whose results nobody reads any
more are then dropped. The program computes the same values.
"""

from __future__ import annotations

import math

from jax.extend.core import DropVar, Jaxpr

from shardflow.program import Program, is_literal, map_subjaxprs


def _key(eqn, env, named):
    """What makes ``eqn``'s results — its primitive, params and operands, an operand named as
    ``named`` names it (an expansion by what it computes) —, hashable; None where it may not
    be merged (effects, params that do not hash)."""
    if eqn.effects:
        return None
    operands = tuple(
        ("literal", x.aval, repr(x.val)) if is_literal(x) else named.get(env.get(x, x), env.get(x, x))
        for x in eqn.invars
    )
    key = (eqn.primitive, operands, tuple(sorted(eqn.params.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _grows(eqn) -> bool:
    """Whether ``eqn`` is an expansion: a result larger than its largest operand."""
    sizes = [math.prod(x.aval.shape) for x in eqn.invars if not is_literal(x) and hasattr(x.aval, "shape")]
    return max((math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")), default=0) > max(
        sizes, default=0
    )


def _read(eqns: list, outvars) -> list:
    """``eqns`` without those whose results nothing reads (effects kept)."""
    read, kept = {x for x in outvars if not is_literal(x)}, []
    for eqn in reversed(eqns):
        if eqn.effects or any(v in read for v in eqn.outvars):
            read.update(x for x in eqn.invars if not is_literal(x))
            kept.append(eqn)
    return kept[::-1]


def _cse(jaxpr: Jaxpr) -> Jaxpr:
    env, seen, eqns = {}, {}, []
    expanded = {}  # an expansion or a constant -> the key of what it computes
    constant = set()  # values computed from literals alone
    for eqn in jaxpr.eqns:
        eqn = map_subjaxprs(eqn, lambda _, body: _cse(body))
        key, grows = _key(eqn, env, expanded), _grows(eqn)
        from_literals = all(env.get(x, x) in constant for x in eqn.invars if not is_literal(x))
        if key is not None and (from_literals or grows):
            if len(eqn.outvars) == 1:
                expanded[eqn.outvars[0]] = ("expanded", key)
            if from_literals:
                constant.update(eqn.outvars)
            key = None if grows else _key(eqn, env, {})
        first = seen.get(key) if key is not None else None
        if first is not None and all(
            isinstance(v, DropVar) or not isinstance(u, DropVar) for u, v in zip(first.outvars, eqn.outvars)
        ):
            for u, v in zip(first.outvars, eqn.outvars):
                if not isinstance(v, DropVar):
                    env[v] = u
            continue
        eqn = eqn.replace(invars=[x if is_literal(x) else env.get(x, x) for x in eqn.invars])
        if key is not None:
            seen.setdefault(key, eqn)
        eqns.append(eqn)
    outvars = [x if is_literal(x) else env.get(x, x) for x in jaxpr.outvars]
    return jaxpr.replace(eqns=_read(eqns, outvars), outvars=outvars)


def cse(program: Program) -> Program:
    closed = program.jaxpr
    return program.replace(jaxpr=closed.replace(jaxpr=_cse(closed.jaxpr)))
