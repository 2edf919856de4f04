"""sf.pipeline in the whole-program solver: the pipeline rule's ``solve`` hook lays its five bodies
out with the program through the solver's builder interface (``passes.solve.build.Builder``),
and its entry assembles the chosen layouts back into the equation."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

from shardflow import conversion, registry
from shardflow.passes.solve.build import by_layout, layouts
from shardflow.pipeline_executor import Bodies, aux_count
from shardflow.pipelining import operand_groups, outer_sbp, pipeline_axis
from shardflow.program import open_jaxpr, rebody
from shardflow.registry import DECISION, Decision
from shardflow.specs import B, Partial, Split


class PipelineEntry(NamedTuple):
    """An sf.pipeline solved with its bodies: per body its entries, per body input and output
    the (layouts, columns) of the value it is; per operand and result of the equation the same,
    its layouts as outside the bodies."""

    eqn: object
    bodies: dict  # body name -> its entries
    body_ins: dict  # body name -> per invar (layouts, columns)
    body_outs: dict  # body name -> per outvar (layouts, columns): what is wanted of it
    ins: list  # per operand (layouts outside, columns)
    outs: list  # per result (layouts outside, columns)

    def assemble(self, prop, pick, assemble_body):
        """The equation with the chosen layouts: ``pick(options, cols)`` the chosen one,
        ``assemble_body(entries)`` a body's equations with theirs."""
        eqn, params = self.eqn, self.eqn.params
        new = {}
        for name, entries in self.bodies.items():
            body = open_jaxpr(params[name])
            for v in body.constvars:
                prop.set(v, prop.whole)
            for v, choice in zip(body.invars, self.body_ins[name]):
                prop.set(v, pick(*choice))
            new[name] = rebody(params[name], body.replace(eqns=assemble_body(entries)))
        wanted = tuple((name, tuple(pick(*c) for c in self.body_outs[name])) for name in Bodies._fields)
        decision = Decision(tuple(pick(*c) for c in self.ins), tuple(pick(*c) for c in self.outs), bodies=wanted)
        return eqn.replace(params={**params, **new, DECISION: decision})


def solve_pipeline(b, eqn, scale) -> PipelineEntry:
    """sf.pipeline's five bodies solved with the program (``pipelining._propagate`` is
    greedy's layout of it): one layout each for what crosses between them — the chunk's
    weights, the activation (and its gradient, laid out alike), each residual forward
    stores, each value B stashes for W, the weights' gradients (partial too), the head's
    parameters, arguments, loss and gradients —; on the pipeline axis every body runs whole
    (a device runs its own stages) but the head where its parameters may come split over
    it, its gradients then lying as its parameters do. Each body's work counts as often as
    it runs (the rule's ``trips``). Partial, and said so: memory held across the pipeline is not
    bounded (a budget counts the loops outside it)."""
    params, prop = eqn.params, b.prop
    ax = pipeline_axis(eqn, prop.mesh)
    bodies = {name: open_jaxpr(params[name]) for name in Bodies._fields}
    stage, head, xs, args = operand_groups(params, list(eqn.invars))
    off_axis = lambda a: ax is None or a[ax] == B  # noqa: E731
    unsummed_on_axis = lambda a: ax is None or not isinstance(a[ax], Partial)  # noqa: E731

    def choose(v, partial=False, keep=off_axis):
        options = [a for a in layouts(prop, v.aval, partial) if keep(a)]
        return options, b.choice([0.0] * len(options))

    forward, head_body, backward = bodies["forward"], bodies["head"], bodies["backward"]
    n, nh = len(stage), len(head)
    chunk = [choose(v) for v in forward.invars[:n]]
    x = choose(forward.invars[n])
    n_aux = aux_count(Bodies(**{name: params[name] for name in Bodies._fields}))
    aux = [choose(v, partial=True) for v in forward.outvars[1 : 1 + n_aux]]
    stored = [choose(v) for v in forward.outvars[1 + n_aux :]]
    stash = [choose(v) for v in bodies["backward_x"].outvars[1:]]
    d_chunk = [choose(v, partial=True) for v in backward.outvars[:-1]]
    # The head runs on every device of the pipeline axis: split over it as its parameters
    # may come (a vocab split over the stages shares its work out), else whole.
    split_head = ax is not None and any(isinstance(a[ax], Split) for v in head for a in b.at(v))
    head_params = [choose(v, keep=lambda a: split_head or off_axis(a)) for v in head_body.invars[:nh]]
    head_args = [choose(v) for v in head_body.invars[nh + 1 :]]
    loss = choose(head_body.outvars[0], partial=True)
    d_head = [choose(v, partial=True, keep=unsummed_on_axis) for v in head_body.outvars[1:-1]]
    if ax is not None:  # a head gradient on the pipeline axis as its parameter lies
        for (hs, hc), (ds, dc) in zip(head_params, d_head):
            for entry in {a[ax] for a in hs} | {a[ax] for a in ds}:
                b.m.row(
                    [(c, 1.0) for a, c in zip(hs, hc) if a[ax] == entry]
                    + [(c, -1.0) for a, c in zip(ds, dc) if a[ax] == entry],
                    0.0,
                    0.0,
                )
    body_ins = dict(
        forward=chunk + [x],
        head=head_params + [x] + head_args,
        backward=chunk + stored + [x],
        backward_x=chunk + stored + [x],
        backward_w=chunk + stored + stash,
    )
    body_outs = dict(
        forward=[x] + aux + stored,
        head=[loss] + d_head + [x],
        backward=d_chunk + [x],
        backward_x=[x] + stash,
        backward_w=d_chunk,
    )
    entries = {}
    b.loop_depth += 1
    for name, body in bodies.items():
        assert len(body.invars) == len(body_ins[name]) and len(body.outvars) == len(body_outs[name]), name
        for v, (options, cols) in zip(body.invars, body_ins[name]):
            b.produced[v] = by_layout(options, cols)
        held = ax is not None and not (name == "head" and split_head)
        with prop.holding(ax) if held else contextlib.nullcontext():
            entries[name] = b.jaxpr(body, scale * registry.trips_of(eqn, name, prop.mesh))
        for v, choice in zip(body.outvars, body_outs[name]):
            b.use(v, *choice)
    b.loop_depth -= 1
    outside = lambda choice, lead, on_axis=B: (
        [outer_sbp(a, ax, lead, on_axis) for a in choice[0]],  # noqa: E731
        choice[1],
    )
    ins = [outside(c, 2, Split(0)) for c in chunk] + head_params + [outside(x, 1)] + [outside(c, 1) for c in head_args]
    for v, choice in zip(eqn.invars, ins):
        b.use(v, *choice)
    outs = (
        [loss]
        + [outside(c, 2, Split(0)) for c in d_chunk]
        + d_head
        + [outside(x, 1)]
        + [outside(c, 2, Split(0)) for c in aux]
    )
    for v, (options, cols) in zip(eqn.outvars, outs):
        b.produced[v], b.scale[v] = by_layout(options, cols), scale
    for a, c in zip(*ins[n + nh]):  # its own collectives: a micro-batch's activation
        operands = [None] * len(eqn.invars)
        operands[n + nh] = a
        b.m.cost[c] += scale * conversion.steps_seconds(
            registry.rule_of(eqn.primitive).comm(eqn, operands, None, prop.mesh), prop.program.links
        )
    return PipelineEntry(eqn, entries, body_ins, body_outs, ins, outs)
