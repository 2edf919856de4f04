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
result has more elements than its largest operand (a broadcast of a scalar, an iota), or
computed from expansions alone: made again where used, as XLA's fusion makes them, rather
than one big value every use converts (and every gradient of one shape would add the same
squared zero, laid out for the first). Two equal expansions are still the same operand to
what reads them: optax's norm squares each gradient's imaginary part, a broadcast zero, once
per norm, and adds it to the square of the real part — with that, one sum per gradient, not
two. Equations whose results nobody reads any more are then dropped. The program computes
the same values.
"""
from __future__ import annotations

import math

from jax.extend.core import DropVar, Jaxpr

from shardflow.program import Program, is_literal, map_subjaxprs


def _operand_key(x, env, expanded):
    if is_literal(x):
        return ("literal", x.aval, repr(x.val))
    x = env.get(x, x)
    return expanded.get(x, x)


def _key(eqn, env, expanded, constant):
    """(what makes ``eqn``'s results, hashable — or None where it does not hash —, whether it
    is an expansion — larger than its operands, or a constant —, whether it is a constant:
    computed from literals alone, as a broadcast zero and its square)."""
    if eqn.effects:
        return None, False, False
    sizes = [math.prod(x.aval.shape) for x in eqn.invars if not is_literal(x) and hasattr(x.aval, "shape")]
    made = [math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
    key = (eqn.primitive, tuple(_operand_key(x, env, expanded) for x in eqn.invars), tuple(sorted(eqn.params.items())))
    try:
        hash(key)
    except TypeError:
        return None, False, False
    from_literals = all(env.get(x, x) in constant for x in eqn.invars if not is_literal(x))
    return key, from_literals or max(made, default=0) > max(sizes, default=0), from_literals


def _read(eqns: list, outvars) -> list:
    """``eqns`` without those whose results nothing reads (effects kept)."""
    read, kept = {x for x in outvars if not is_literal(x)}, []
    for eqn in reversed(eqns):
        if eqn.effects or any(v in read for v in eqn.outvars):
            read.update(x for x in eqn.invars if not is_literal(x))
            kept.append(eqn)
    return kept[::-1]


def _cse(jaxpr: Jaxpr) -> Jaxpr:
    env, seen, expanded, constant, eqns = {}, {}, {}, set(), []
    for eqn in jaxpr.eqns:
        eqn = map_subjaxprs(eqn, lambda _, body: _cse(body))
        key, expansion, from_literals = _key(eqn, env, expanded, constant)
        if expansion:
            if len(eqn.outvars) == 1:
                expanded[eqn.outvars[0]] = ("expanded", key)
            if from_literals:
                constant.update(eqn.outvars)
            key = None
        first = seen.get(key) if key is not None else None
        if first is not None and all(isinstance(v, DropVar) or not isinstance(u, DropVar)
                                     for u, v in zip(first.outvars, eqn.outvars)):
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
