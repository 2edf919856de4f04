"""boxing: make every sharding change an explicit ``sf_box`` equation.

Requires "sharded" (``passes.propagate``): every equation has its Decision, every value its
NdSbp. Ensures "boxed": wherever an operand's NdSbp differs from what its equation's Decision
needs — or a jaxpr output from what is wanted of it (``out_sbp``, a Decision's ``bodies``) — an
``sf_box[src, dst, steps]`` equation converts it (``steps`` from ``conversion.route``: the
collectives and local ops, with their bytes), and the use reads the converted value. A value
converted to one NdSbp twice in a jaxpr is converted once, and a conversion starts from
whichever of the value and its earlier conversions is cheapest to convert from (what
propagation priced).
"""

from __future__ import annotations

from jax.extend.core import Jaxpr, new_jaxpr_eqn

from shardflow import conversion, registry
from shardflow.primitives import box_p
from shardflow.program import Program, is_literal, map_subjaxprs, new_var, source_line
from shardflow.registry import DECISION, Decision, Loop, decision_of
from shardflow.specs import B, format_sbp


class Boxing:
    def __init__(self, program: Program):
        self.p = program
        self.sbp = dict(program.sbp)
        self.made_at: dict = {}
        self.lines: set = set()  # the lines equations were made at (not the arguments' names)

    def of(self, atom):
        return (B,) * len(self.p.axis_names) if is_literal(atom) else self.sbp[atom]

    def jaxpr(self, jaxpr: Jaxpr, wanted, arg_names=None, taken_at: str = "<unknown>", operands=()) -> Jaxpr:
        """``jaxpr`` with its conversions boxed; its inputs made at ``arg_names`` (the program's
        arguments), else ``operands`` (per input, where a value the loop or branch passes was
        made, or None), else where the loop or branch is (``taken_at``, its user line)."""
        for i, v in enumerate(jaxpr.invars):
            made = operands[i] if len(operands) == len(jaxpr.invars) else None
            self.made_at.setdefault(v, arg_names[i] if arg_names else made or taken_at)
        converted, eqns = {}, []  # x -> {NdSbp: Var holding x converted to it}

        def convert(x, want, reason, used_at):
            sources = {self.of(x): x, **({} if is_literal(x) else converted.get(x, {}))}
            if want in sources:
                return sources[want]
            src = min(sources, key=lambda s: self.seconds(x, s, want))
            steps = conversion.route(x.aval.shape, x.aval.dtype, src, want, self.p.mesh, self.p.links)
            out = new_var(x.aval)
            made_at = "literal" if is_literal(x) else self.made_at.get(x, "<unknown>")
            params = dict(src=src, dst=want, steps=steps, reason=reason, source=made_at, used_at=used_at)
            params[DECISION] = Decision((src,), (want,))
            eqns.append(new_jaxpr_eqn([sources[src]], [out], box_p, params, frozenset()))
            self.sbp[out] = want
            self.made_at[out] = made_at
            if not is_literal(x):
                converted.setdefault(x, {})[want] = out
            return out

        for eqn in jaxpr.eqns:
            decision = decision_of(eqn)
            used_at = source_line(eqn)
            boxed_bodies = []

            def box_body(name, body, eqn=eqn, decision=decision, used_at=used_at):
                boxed = self.jaxpr(body, decision.body_outs(name), taken_at=used_at, operands=self.origins(eqn))
                boxed_bodies.append(boxed)
                return boxed

            eqn = map_subjaxprs(eqn, box_body, names={name for name, _ in decision.bodies})
            invars = list(eqn.invars)
            for k, (x, want) in enumerate(zip(invars, decision.ins)):
                have = self.of(x)
                if have != want:
                    reason = f"{eqn.primitive.name} needs {format_sbp(want)} of operand {k}, has {format_sbp(have)}"
                    invars[k] = convert(x, want, reason, used_at)
            eqns.append(eqn.replace(invars=invars))
            self.lines.add(used_at)
            for v in eqn.outvars:
                self.made_at[v] = used_at
            if len(boxed_bodies) == 1 and len(boxed_bodies[0].outvars) == len(eqn.outvars):
                for v, w in zip(eqn.outvars, boxed_bodies[0].outvars):  # a loop's results: where its body made them
                    if not is_literal(w):
                        self.made_at[v] = self.made_at.get(w, used_at)
        outvars = list(jaxpr.outvars)
        for k, (x, want) in enumerate(zip(outvars, wanted or ())):
            if want is not None and self.of(x) != want:
                reason = f"output {k} is wanted as {format_sbp(want)}, has {format_sbp(self.of(x))}"
                outvars[k] = convert(x, want, reason, "output")
        return jaxpr.replace(outvars=outvars, eqns=eqns)

    def origins(self, eqn) -> list:
        """Per operand of a loop or branch, the line its body's input names as made at: the line
        of the equation that made the operand (a layer's residual, made in the forward loop and
        read by the backward's), or None for a carry (made anew each trip) and an argument."""
        region = registry.region_of(eqn)
        carries = range(region.consts, region.consts + region.carries) if isinstance(region, Loop) else ()
        return [
            None if k in carries or is_literal(x) or self.made_at.get(x) not in self.lines else self.made_at[x]
            for k, x in enumerate(eqn.invars)
        ]

    def seconds(self, x, src, dst) -> float:
        return conversion.seconds(x.aval.shape, x.aval.dtype, src, dst, self.p.mesh, self.p.links)


def _reorder(box: Boxing, x, orders, to_mesh_order: bool, name: str):
    """(the value ``x`` whose blocks are in ``orders`` as a Var in mesh order, or back; its sf_box
    equations). The NdSbp does not change: only which device holds which block."""
    sbp, eqns = box.sbp[x], []
    for dim, axes in orders:
        steps = conversion.reorder(x.aval.shape, x.aval.dtype, sbp, dim, axes, box.p.mesh, to_mesh_order=to_mesh_order)
        out = new_var(x.aval)
        reason = (
            f"{name} splits dim {dim} over {axes}, against mesh order"
            if to_mesh_order
            else f"{name} is wanted split over {axes} on dim {dim}, against mesh order"
        )
        params = dict(src=sbp, dst=sbp, steps=steps, reason=reason, source=name, used_at=name)
        params[DECISION] = Decision((sbp,), (sbp,))
        eqns.append(new_jaxpr_eqn([x], [out], box_p, params, frozenset()))
        box.sbp[out] = sbp
        x = out
    return x, eqns


def boxing(program: Program) -> Program:
    box = Boxing(program)
    closed = program.jaxpr
    jaxpr = box.jaxpr(closed.jaxpr, program.out_sbp, program.arg_names)
    # A dim split against mesh order at the boundary (in_specs / out_specs) is permuted once.
    invars, head = list(jaxpr.invars), []
    for i, orders in enumerate(program.in_orders):
        if orders:
            raw = new_var(invars[i].aval)
            box.sbp[raw] = box.sbp[invars[i]]
            _, eqns = _reorder(box, raw, orders, True, program.arg_names[i])
            eqns[-1] = eqns[-1].replace(outvars=[invars[i]])
            head += eqns
            invars[i] = raw
    outvars, tail = list(jaxpr.outvars), []
    for k, orders in enumerate(program.out_orders):
        if orders:
            outvars[k], eqns = _reorder(box, outvars[k], orders, False, f"output {k}")
            tail += eqns
    jaxpr = jaxpr.replace(invars=invars, outvars=outvars, eqns=head + list(jaxpr.eqns) + tail)
    return program.replace(jaxpr=closed.replace(jaxpr=jaxpr), sbp=box.sbp)
