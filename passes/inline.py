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

from jax._src import core

from shardflow.program import Program, has_user_frame, is_literal, map_subjaxprs, new_var
from shardflow.specs import ShardingError

INLINED = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
           "custom_vjp_call_jaxpr", "custom_lin"}


def _body(eqn):
    """The ClosedJaxpr an inlinable call evaluates, or None."""
    if eqn.primitive.name not in INLINED:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if isinstance(j, core.ClosedJaxpr):
            return j
        if isinstance(j, core.Jaxpr):
            return core.ClosedJaxpr(j, ())
    return None


def _clone(jaxpr: core.Jaxpr, hoisted: list | None, traceback=None) -> core.Jaxpr:
    """A copy of ``jaxpr`` with fresh Vars and inlined calls. ``hoisted`` collects the consts of
    inlined bodies as (Var, value) when this is the top level; nested levels must have none.
    ``traceback``: the enclosing user-code traceback, for equations that have none of their own."""
    env = {}

    def read(a):
        return a if is_literal(a) else env.get(a, a)

    def fresh(v):
        if isinstance(v, core.DropVar):
            return core.DropVar(v.aval)
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
        body = _body(eqn)
        if body is None:
            eqn = map_subjaxprs(eqn, lambda j: _clone(j, None, traceback))
            eqns.append(eqn.replace(invars=[read(a) for a in eqn.invars],
                                    outvars=[fresh(v) for v in eqn.outvars]))
            return
        if body.consts:
            if hoisted is None:
                raise ShardingError(
                    f"a {eqn.primitive.name} inside a loop or branch closes over {len(body.consts)} constant "
                    "array(s); shardflow cannot inline it there yet — pass the arrays as arguments")
            for v, c in zip(body.jaxpr.constvars, body.consts):
                env[v] = new_var(v.aval)
                hoisted.append((env[v], c))
        inner = body.jaxpr
        for v, a in zip(inner.invars, eqn.invars):
            env[v] = read(a)
        for e in inner.eqns:
            emit(e, traceback)
        for outer, res in zip(eqn.outvars, inner.outvars):
            if not isinstance(outer, core.DropVar):
                env[outer] = read(res)

    for eqn in jaxpr.eqns:
        emit(eqn, traceback)
    return core.Jaxpr(constvars, invars, [read(a) for a in jaxpr.outvars], eqns,
                      jaxpr.effects, jaxpr.debug_info)


def inline(program: Program) -> Program:
    hoisted = []
    closed = program.jaxpr
    jaxpr = _clone(closed.jaxpr, hoisted)
    jaxpr = core.Jaxpr(list(jaxpr.constvars) + [v for v, _ in hoisted], jaxpr.invars, jaxpr.outvars,
                       jaxpr.eqns, jaxpr.effects, jaxpr.debug_info)
    consts = list(closed.consts) + [c for _, c in hoisted]
    return program.replace(jaxpr=core.ClosedJaxpr(jaxpr, consts))
