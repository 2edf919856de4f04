"""boxing: make every sharding change an explicit ``sf_box`` equation.

Before: a propagated Program: ``sbp`` for every Var, ``uses`` / ``results`` saying what each
operand and each jaxpr output needs. After: wherever a use needs another NdSbp than its value
has, an ``sf_box[src, dst, steps]`` equation converts it (``steps`` from
``shardflow.conversion.plan``: the collectives and local ops, with their bytes), and the use
reads the converted value. A value converted to the same NdSbp twice in one jaxpr is converted
once. Every operand now has exactly the NdSbp its use needs; ``uses`` and ``results`` are
consumed.
"""
from __future__ import annotations

from jax._src import core

from shardflow import conversion
from shardflow.primitives import box_p
from shardflow.program import Program, is_literal, map_subjaxprs, new_var, source_line
from shardflow.specs import B, format_sbp


class Boxing:
    def __init__(self, program: Program):
        self.p = program
        self.sbp = dict(program.sbp)
        self.made_at: dict = {}

    def of(self, atom):
        return (B,) * len(self.p.axis_names) if is_literal(atom) else self.sbp[atom]

    def jaxpr(self, jaxpr: core.Jaxpr, arg_names=None) -> core.Jaxpr:
        for i, v in enumerate(jaxpr.invars):
            self.made_at.setdefault(v, arg_names[i] if arg_names else "loop/branch input")
        cache, eqns = {}, []

        def convert(x, want, reason, used_at):
            have = self.of(x)
            if have == want:
                return x
            key = (x.val.item() if is_literal(x) else x, x.aval, want)
            if key not in cache:
                steps = conversion.plan(x.aval.shape, x.aval.dtype, have, want, self.p.mesh)
                out = new_var(x.aval)
                made_at = "literal" if is_literal(x) else self.made_at.get(x, "<unknown>")
                params = dict(src=have, dst=want, steps=steps, reason=reason, source=made_at, used_at=used_at)
                eqns.append(core.new_jaxpr_eqn([x], [out], box_p, params, frozenset()))
                self.sbp[out] = want
                self.made_at[out] = made_at
                cache[key] = out
            return cache[key]

        for eqn in jaxpr.eqns:
            uses = self.p.uses.get(id(eqn))
            eqn = map_subjaxprs(eqn, self.jaxpr)
            used_at = source_line(eqn)
            invars = list(eqn.invars)
            if uses is not None:
                for k, (x, want) in enumerate(zip(invars, uses)):
                    have = self.of(x)
                    if have != want:
                        reason = f"{eqn.primitive.name} needs {format_sbp(want)} of operand {k}, has {format_sbp(have)}"
                        invars[k] = convert(x, want, reason, used_at)
            eqns.append(eqn.replace(invars=invars))
            for v in eqn.outvars:
                self.made_at[v] = used_at
        outvars = list(jaxpr.outvars)
        results = self.p.results.get(id(jaxpr))
        if results is not None:
            for k, (x, want) in enumerate(zip(outvars, results)):
                if want is not None and not is_literal(x) and self.sbp[x] != want:
                    reason = f"output {k} is wanted as {format_sbp(want)}, has {format_sbp(self.sbp[x])}"
                    outvars[k] = convert(x, want, reason, "output")
        return core.Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, eqns, jaxpr.effects, jaxpr.debug_info)


def boxing(program: Program, arg_names=None) -> Program:
    box = Boxing(program)
    closed = program.jaxpr
    jaxpr = box.jaxpr(closed.jaxpr, arg_names)
    return program.replace(jaxpr=core.ClosedJaxpr(jaxpr, closed.consts), sbp=box.sbp, uses={}, results={})
