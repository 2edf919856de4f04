"""inline: flatten call wrappers and give every nested value its own Var.

Before: the jaxpr as traced — ``jit`` / ``closed_call`` / ``custom_jvp_call`` /
``custom_vjp_call`` wrappers, and nested jaxprs that JAX may share between call sites.
After: those wrappers are replaced by their bodies (differentiation is done, so custom rules
no longer matter); scan / while / cond / remat bodies are cloned per call site, so every Var occurs in exactly one
place and ``Program.sbp`` can be a plain dict. An equation whose traceback holds no frame of the
user's code (JAX's own bodies: a transposed gather's scatter-add, jnp helpers) takes the
traceback of the nearest enclosing call or loop that has one, so explain names the user's line.
The program computes the same values.
"""

from __future__ import annotations

from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr
from jax.extend.core import primitives as prims

from shardflow.program import REMAT_PRIMITIVES, Program, has_user_frame, is_literal, new_var, rebuild, subjaxprs
from shardflow.specs import ShardingError

# The call wrappers inlining flattens: differentiation is done, so custom rules no longer matter.
CALLS = frozenset(
    p
    for p in (
        prims.jit_p,
        prims.closed_call_p,
        prims.call_p,
        prims.custom_jvp_call_p,
        prims.custom_vjp_call_p,
        prims.custom_lin_p,
    )
    if p is not None
)


def _body(eqn, calls):
    """The ClosedJaxpr an inlinable call (of a primitive in ``calls``) evaluates, or None."""
    if eqn.primitive not in calls:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if isinstance(j, ClosedJaxpr):
            return j
        if isinstance(j, Jaxpr):
            return ClosedJaxpr(j, ())
    return None


def flatten(jaxpr: Jaxpr, calls=CALLS, traceback=None) -> tuple[Jaxpr, list]:
    """A copy of ``jaxpr`` with fresh Vars and the equations of ``calls`` primitives replaced by
    their bodies, nested jaxprs included, and the consts of the inlined bodies as (Var, value):
    the caller binds them (as its own consts, or as loop-body consts). ``traceback``: the
    enclosing user-code traceback, for equations that have none of their own."""
    env, hoisted = {}, []

    def read(a):
        return a if is_literal(a) else env.get(a, a)

    def fresh(v):
        if isinstance(v, DropVar):
            return DropVar(v.aval)
        env[v] = new_var(v.aval)
        return env[v]

    constvars = [fresh(v) for v in jaxpr.constvars]
    invars = [fresh(v) for v in jaxpr.invars]
    eqns = []

    def emit(eqn, traceback):
        if has_user_frame(eqn.source_info):
            traceback = eqn.source_info.traceback
        elif traceback is not None:
            eqn = eqn.replace(source_info=eqn.source_info.replace(traceback=traceback))
        body = _body(eqn, calls)
        if body is None:
            eqn, extra = _clone_nested(eqn, traceback, hoisted, calls)
            eqns.append(
                eqn.replace(invars=extra + [read(a) for a in eqn.invars], outvars=[fresh(v) for v in eqn.outvars])
            )
            return
        for v, c in zip(body.jaxpr.constvars, body.consts):
            env[v] = new_var(v.aval)
            hoisted.append((env[v], c))
        inner = body.jaxpr
        for v, a in zip(inner.invars, eqn.invars):
            env[v] = read(a)
        for e in inner.eqns:
            emit(e, traceback)
        for outer, res in zip(eqn.outvars, inner.outvars):
            if not isinstance(outer, DropVar):
                env[outer] = read(res)

    for eqn in jaxpr.eqns:
        emit(eqn, traceback)
    return Jaxpr(constvars, invars, [read(a) for a in jaxpr.outvars], eqns, jaxpr.effects, jaxpr.debug_info), hoisted


def _clone_nested(eqn, traceback, hoisted, calls):
    """The eqn with its nested jaxprs cloned, and the operands to prepend to its own. Consts
    hoisted out of a body become consts of that body's ClosedJaxpr (scan, while, cond), or — for
    a call whose operands are its body's inputs (remat) — leading inputs fed from fresh Vars of
    this level, which join ``hoisted``."""
    new, extra = {}, []

    def one(j):
        closed = isinstance(j, ClosedJaxpr)
        body, inner = flatten(j.jaxpr if closed else j, calls, traceback)
        if not inner:
            return ClosedJaxpr(body, j.consts) if closed else body
        vars_, values = [v for v, _ in inner], [c for _, c in inner]
        if closed:
            return ClosedJaxpr(body.replace(constvars=list(body.constvars) + vars_), list(j.consts) + values)
        if eqn.primitive not in REMAT_PRIMITIVES:
            raise ShardingError(
                f"a call inside {eqn.primitive.name} closes over {len(values)} constant array(s); "
                "shardflow cannot hoist them out of it — pass the arrays as arguments"
            )
        outer = [new_var(v.aval) for v in vars_]
        hoisted.extend(zip(outer, values))
        extra.extend(outer)
        return body.replace(invars=vars_ + list(body.invars))

    for name, value in subjaxprs(eqn.params):
        new[name] = rebuild(value, one) if isinstance(value, tuple) else one(value)
    return (eqn.replace(params={**eqn.params, **new}) if new else eqn), extra


def inline(program: Program) -> Program:
    closed = program.jaxpr
    jaxpr, hoisted = flatten(closed.jaxpr)
    jaxpr = Jaxpr(
        list(jaxpr.constvars) + [v for v, _ in hoisted],
        jaxpr.invars,
        jaxpr.outvars,
        jaxpr.eqns,
        jaxpr.effects,
        jaxpr.debug_info,
    )
    consts = list(closed.consts) + [c for _, c in hoisted]
    return program.replace(jaxpr=ClosedJaxpr(jaxpr, consts))
