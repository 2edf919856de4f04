"""build: the integer program of a jaxpr (``model.Model``): per equation its strategies, per
value where it is made and what its uses want, and the conversions between, priced; scans,
remats and sf.pipeline with their bodies, other control flow at greedy's layout."""

from __future__ import annotations

import collections
import itertools
import math
from typing import NamedTuple

import numpy as np

from shardflow import conversion, registry
from shardflow.costs import STATIONARY_PENALTY, combined_key, moves
from shardflow.passes.propagate import Propagation, _adoptable, reduced
from shardflow.passes.solve.coarsen import coarsened_tail, within
from shardflow.passes.solve.model import Model, Unsolvable
from shardflow.program import Program, is_literal, open_jaxpr, source_line
from shardflow.registry import Call, Decision, Loop, Sig
from shardflow.specs import B, P, ShardingError, Split, stacked, unstacked


def strategies(prop: Propagation, eqn, given: dict | None = None) -> list:
    """(Decision, own seconds) of every strategy of ``eqn``, duplicates (same NdSbps) dropped.
    An equation with flops (a matmul) keeps only the strategies that divide them most, as
    Alpa does: by the model a small program would rather run its matmuls whole than reduce
    their results, but nobody splits a batch over devices to have each compute all of it.
    Control flow (a rule that chooses for itself) has one strategy, its Decision in ``given``
    (greedy's), else the program is Unsolvable."""
    rule = registry.rule_of(eqn.primitive)
    if rule is not None and rule.pin is not None:
        sbp = prop.pinned(eqn)
        return [(Decision((sbp,), (sbp,)), 0.0)]
    if given is not None and eqn in given:  # laid out as greedy laid it out
        return [(registry.decision_of(given[eqn]), 0.0)]
    if lays_itself_out(eqn):
        raise Unsolvable(f"{eqn.primitive.name} at {source_line(eqn)} chooses its own sharding")
    sigs = registry.signatures(eqn)
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    whole = Sig((B,) * n_in, (B,) * n_out, "whole")
    if sigs is None:
        prop.fallbacks.append((eqn.primitive.name, source_line(eqn)))
        whole = Decision((prop.whole,) * n_in, (prop.whole,) * n_out, fallback=True)
        return [(whole, conversion.local_seconds(eqn, whole.ins, whole.outs, prop.mesh, prop.program.links))]
    out, seen = [], set()
    for chosen in itertools.product(
        *[[whole] if i in prop.held else list(sigs) + [whole] for i in range(len(prop.names))]
    ):
        ins = tuple(tuple(sig.ins[k] for sig in chosen) for k in range(n_in))
        outs = tuple(tuple(sig.outs[j] for sig in chosen) for j in range(n_out))
        if (ins, outs) in seen:
            continue
        if not all(prop.valid(x.aval, s) for x, s in zip(eqn.invars, ins)) or not all(
            prop.valid(v.aval, s) for v, s in zip(eqn.outvars, outs)
        ):
            continue
        if any(is_literal(x) and any(isinstance(t, Split) for t in s) for x, s in zip(eqn.invars, ins)):
            continue
        decision = Decision(ins, outs, tuple(chosen))
        if rule is not None and rule.admits is not None and not rule.admits(eqn, decision, prop.mesh):
            continue
        seen.add((ins, outs))
        flops, nbytes = conversion.local_work(eqn, ins, outs, prop.mesh)
        own = prop.program.links.compute_seconds(flops, nbytes)
        if rule is not None and rule.comm is not None:
            own += conversion.steps_seconds(rule.comm(eqn, ins, chosen, prop.mesh), prop.program.links)
        own += sum(prop.seconds(x.aval, prop.whole, s) for x, s in zip(eqn.invars, ins) if is_literal(x))
        out.append((decision, own, flops))
    if not out:
        raise Unsolvable(f"no strategy of {eqn.primitive.name} at {source_line(eqn)} divides its operands")
    least = min(flops for _, _, flops in out)
    return [(decision, own) for decision, own, flops in out if flops <= least]


def lays_itself_out(eqn) -> bool:
    """Whether ``eqn``'s rule chooses its layout itself, by its own ``propagate``, so that the
    solver takes greedy's choice (control flow, a pipeline, attention with an explicit context):
    a rule with ``admits`` is solved wherever it admits a decision at all."""
    rule = registry.rule_of(eqn.primitive)
    if rule is None or rule.propagate is None or rule.pin is not None:
        return False
    return rule.admits is None or not rule.admits(eqn, None, None)  # (None: any decision)


def layouts(prop: Propagation, aval, partial: bool = False) -> list:
    """Every NdSbp of B or S(d) on each mesh axis under which ``aval`` divides (B alone on an
    axis the bodies of a pipeline hold): the choices for an sf.AUTO input; with ``partial``, P
    too (a loop's stacked output)."""
    per_axis = [B] + [P] * partial + [Split(d) for d in range(len(aval.shape))]
    axes = [[B] if i in prop.held else per_axis for i in range(len(prop.names))]
    return [sbp for sbp in itertools.product(*axes) if prop.valid(aval, sbp)]


def fixed_input_bytes(prop: Propagation) -> int:
    """Bytes per device of the inputs whose layout is given (not sf.AUTO)."""
    return sum(
        conversion.local_bytes(v.aval, s, prop.mesh)
        for v, s in zip(prop.program.jaxpr.jaxpr.invars, prop.program.in_sbp)
        if s is not None
    )


def budget(program: Program) -> int | None:
    """Bytes per device the plan may hold (explain's ``memory_bytes``): ``memory_budget``, else
    the smallest memory of the mesh's GPUs (``hetero.devices.memory_limit``: on mixed kinds and
    over hosts), else no bound."""
    from shardflow.hetero.devices import memory_limit

    if program.memory_budget is not None:
        return program.memory_budget
    try:
        return memory_limit(program.mesh.devices.flat)
    except ValueError as e:
        raise ShardingError(f"{e}: give the plan a memory_budget (bytes per device)") from None


class LoopEntry(NamedTuple):
    """A loop solved with its body: per body input and per stacked output, the layouts it may
    take and their columns (one chosen); ``body`` the body's entries."""

    eqn: object
    loop: Loop
    body: list
    ins: list  # per body invar: (layouts, columns)
    ys: list  # per stacked output: (layouts, columns)


class CallEntry(NamedTuple):
    """A call solved with its body, which sees the operands as they are."""

    eqn: object
    call: Call
    body: list


def solved_with_bodies(eqn) -> bool:
    """Whether the solver lays out ``eqn``'s bodies with the program: a loop or call region, or
    a rule with its own ``solve`` hook."""
    rule = registry.rule_of(eqn.primitive)
    return rule is not None and (rule.solve is not None or isinstance(registry.region_of(eqn), (Loop, Call)))


class Builder:
    """The integer program of a jaxpr, loops and calls included (``registry.Loop`` / ``Call``:
    a scan, a remat): a loop's body is one copy
    of its equations whose costs count ``trips`` times, its consts, carries and sliced inputs
    one chosen layout each (converted outside the loop; a carry's the same at the start and
    end of every iteration), its stacked outputs one layout each — partial too: a layer's
    gradient reduced inside the loop, hidden behind the next layer's compute, or all layers'
    at once after it, one collective where the loop ran one per layer. A call's body sees its
    operands as they are. A rule's own ``solve`` hook (sf.pipeline's) adds its columns through
    this interface: ``choice``, ``use``, ``at``, ``wants``, ``layout_choice``, ``jaxpr`` (a body's
    entries at a scale), ``produced`` / ``scale`` (what a value is made as, how often it runs),
    ``m.row`` / ``m.cost`` (constraints and prices), ``loop_depth`` and ``prop`` (shapes, mesh,
    links, ``holding``). Any other control flow is laid out as greedy laid it out."""

    def __init__(self, prop: Propagation, given: dict | None, tail: dict | None = None, known: dict | None = None):
        self.prop, self.given, self.m = prop, given or {}, Model()
        self.known = {} if known is None else known  # eqn -> its strategies (shared by one build's walks)
        self.tail = tail or {}  # elementwise eqn -> the out_spec its result goes to alone (``pinned_tail``)
        self.produced = {v: {s: None} for v, s in prop.sbp.items()}  # var -> {NdSbp: x columns}; None: fixed
        self.uses = {}  # var -> [{NdSbp required: x columns}], one per use; None: always
        self.scale = {}  # var -> how many times its jaxpr runs per step
        self.hideable = {}  # var, or id of a use -> the scan whose compute may overlap its conversions
        self.alias = {}  # a remat body's input (or passed-through output) -> the value it is
        self.held = []  # (column, bytes per device) of the stacked outputs of loops not in a loop
        self.taken = {}  # (var, layout) -> x columns of loops not in a loop taking it there (not a carry)
        self.stacked_outputs = set()  # those loops' stacked outputs
        self.loop_depth = 0

    def resolve(self, v):
        return self.alias.get(v, v)

    def choice(self, costs) -> list:
        """Columns of one choice among ``len(costs)`` options, each at its cost."""
        cols = [self.m.var(cost, integral=True) for cost in costs]
        self.m.row([(c, 1.0) for c in cols], 1.0, 1.0)
        return cols

    def jaxpr(self, jaxpr, scale: float) -> list:
        for v in jaxpr.constvars:
            self.produced[v], self.scale[v] = {self.prop.whole: None}, scale
        for v in jaxpr.invars:
            self.scale[v] = scale
        return [self.entry(eqn, scale) for eqn in jaxpr.eqns]

    def entry(self, eqn, scale):
        if eqn in self.given:
            return self.plain(eqn, scale)
        rule = registry.rule_of(eqn.primitive)
        if rule is not None and rule.solve is not None:
            return rule.solve(self, eqn, scale)
        region = registry.region_of(eqn)
        if isinstance(region, Loop):
            return self.loop(eqn, region, scale)
        if isinstance(region, Call):
            return self.call(eqn, region, scale)
        return self.plain(eqn, scale)

    def plain(self, eqn, scale):
        if eqn not in self.known:
            self.known[eqn] = strategies(self.prop, eqn, self.given)
        options = self.known[eqn]
        if eqn in self.tail:
            pin = self.tail[eqn]
            options = [o for o in options if within(o[0].outs[0], pin)] or options
        cols = self.choice([own * scale for _, own in options])
        for k, x in enumerate(eqn.invars):
            if not is_literal(x):
                use = {}
                for (decision, _), c in zip(options, cols):
                    use.setdefault(decision.ins[k], []).append(c)
                self.uses.setdefault(self.resolve(x), []).append(use)
        for j, v in enumerate(eqn.outvars):
            self.scale[v] = scale
            for (decision, _), c in zip(options, cols):
                self.produced.setdefault(v, {}).setdefault(decision.outs[j], []).append(c)
        return eqn, options, cols

    def use(self, v, options, cols):
        """``v`` wanted at one of ``options``, as chosen by ``cols`` (a literal is where it is wanted)."""
        if not is_literal(v):
            self.uses.setdefault(self.resolve(v), []).append(by_layout(options, cols))

    def wants(self, v) -> set:
        return {r for use in self.uses.get(v, ()) for r in use}

    def at(self, x) -> set:
        return {self.prop.whole} if is_literal(x) else set(self.produced.get(self.resolve(x), ()))

    def layout_choice(self, aval, candidates):
        options = sorted(
            {a for a in candidates if a is not None and self.prop.valid(aval, a) and _adoptable(a)}, key=str
        )
        return options, self.choice([0.0] * len(options))

    def call(self, eqn, call: Call, scale):
        """A call's body sees its operands as they are (aliased: an operand may be a loop body's
        input, whose layouts come after its body)."""
        body = open_jaxpr(eqn.params[call.body])
        for x, v in zip(eqn.invars, body.invars):
            if is_literal(x):
                self.produced[v] = {self.prop.whole: None}
            else:
                self.alias[v] = self.resolve(x)
        entries = self.jaxpr(body, scale)
        for v, o in zip(body.outvars, eqn.outvars):
            self.scale[o] = scale
            if is_literal(v):
                self.produced[o] = {self.prop.whole: None}
            else:
                self.alias[o] = self.resolve(v)
        return CallEntry(eqn, call, entries)

    def loop(self, eqn, loop: Loop, scale):
        body = open_jaxpr(eqn.params[loop.body])
        nc, nk = loop.consts, loop.carries
        inner = scale * loop.trips
        self.loop_depth += 1
        entries = self.jaxpr(body, inner)
        self.loop_depth -= 1
        ins = []
        for k, (x, v) in enumerate(zip(eqn.invars, body.invars)):
            if k < nc:  # a const: converted once, before the loop
                options, cols = self.layout_choice(v.aval, self.wants(v) | self.at(x))
                outer = options
            elif k < nc + nk:  # a carry: the same layout in and out
                out = body.outvars[k - nc]
                options, cols = self.layout_choice(v.aval, self.wants(v) | self.at(x) | self.at(out))
                outer = options
                self.use(out, options, cols)
                self.produced[eqn.outvars[k - nc]] = by_layout(options, cols)
                self.scale[eqn.outvars[k - nc]] = scale
            else:  # a slice of a stacked input
                options, cols = self.layout_choice(v.aval, self.wants(v) | {unstacked(a) for a in self.at(x)})
                outer = [stacked(a) for a in options]
                self.hideable[v] = eqn  # a layer's weight, gathered ahead
            if not is_literal(x):
                self.uses.setdefault(self.resolve(x), []).append(by_layout(outer, cols))
                if not self.loop_depth and not nc <= k < nc + nk:
                    for a, c in zip(outer, cols):
                        self.taken.setdefault((self.resolve(x), a), []).append(c)
            self.produced[v] = by_layout(options, cols)
            ins.append((options, cols))
        ys = []
        for v, o in zip(body.outvars[nk:], eqn.outvars[nk:]):
            options = [self.prop.whole] if is_literal(v) else layouts(self.prop, v.aval, partial=True)
            options = [a for a in options if self.prop.valid(o.aval, stacked(a))]
            cols = self.choice([0.0] * len(options))
            if not self.loop_depth:  # held across the step (costs.held_bytes)
                self.held += [
                    (c, float(conversion.local_bytes(o.aval, stacked(a), self.prop.mesh)))
                    for a, c in zip(options, cols)
                ]
                self.stacked_outputs.add(o)
            if not is_literal(v):
                use = by_layout(options, cols)
                self.uses.setdefault(self.resolve(v), []).append(use)
                self.hideable[id(use)] = eqn  # a layer's gradient, reduced behind the next
            self.produced[o], self.scale[o] = by_layout([stacked(a) for a in options], cols), scale
            ys.append((options, cols))
        return LoopEntry(eqn, loop, entries, ins, ys)


def by_layout(options, cols) -> dict:
    """{layout: [its column]}: where a value is, or what a use requires, as one choice."""
    return {a: [c] for a, c in zip(options, cols)}


def _walk(prop: Propagation, jaxpr, given, tail, known) -> tuple:
    """(the builder with ``jaxpr``'s strategies and uses, its entries, the sf.AUTO inputs'
    choices): ``build`` before the conversions are priced."""
    b, auto = Builder(prop, given, tail, known), []
    for v, s in zip(jaxpr.invars, prop.program.in_sbp):
        b.scale[v] = 1
        if s is None:  # sf.AUTO: one of its layouts, free of cost itself
            options = layouts(prop, v.aval)
            cols = b.choice([0.0] * len(options))
            b.produced[v] = by_layout(options, cols)
            auto.append((v, options, cols))
    return b, b.jaxpr(jaxpr, 1), auto


def build(prop: Propagation, jaxpr, out_sbp, given: dict | None = None, combined: dict | None = None):
    """(model, per equation of ``jaxpr`` its entry — (eqn, its strategies, their x columns), or
    a ``Region`` — and per sf.AUTO input (var, its layouts, their columns)), or raise
    Unsolvable. ``given``: control flow equations -> the equation as greedy laid it out;
    ``combined``: greedy's combinable collectives (``CombinedGroups``). A loop's hideable conversions
    are priced at the share of them it leaves exposed when the model is solved
    (``Model.costs``), so one model serves solves at other shares."""
    known = {}
    b, entries, auto = _walk(prop, jaxpr, given, None, known)
    edges = sum(len(at) * len(use) for v, at in b.produced.items() for use in b.uses.get(v, ()))
    tail = coarsened_tail(edges, jaxpr, prop.program.in_sbp, out_sbp)
    if tail:
        b, entries, auto = _walk(prop, jaxpr, given, tail, known)
    m = b.m
    allowed = budget(prop.program)
    if allowed is not None:  # explain's memory_bytes: the inputs and what the loops hold
        m.row(
            [
                (c, float(conversion.local_bytes(v.aval, a, prop.mesh)) / 1e6)
                for v, options, cols in auto
                for a, c in zip(options, cols)
            ]
            + [(c, nbytes / 1e6) for c, nbytes in b.held + _taken(b, jaxpr)],
            -math.inf,
            float(allowed - fixed_input_bytes(prop)) / 1e6,
        )
        m.lazy.append(len(m.lb) - 1)
    unspecified = set()
    for v, want in zip(jaxpr.outvars, out_sbp):
        if is_literal(v):
            continue
        v = b.resolve(v)
        if want is None:
            unspecified.add(v)
        else:
            b.uses.setdefault(v, []).append({want: None})
    groups = CombinedGroups(prop, combined or {})
    for v, at in b.produced.items():
        if v in unspecified:  # no out_spec: a partial output is reduced (inputs never are partial)
            for a, cols in at.items():
                for c in cols or ():
                    m.cost[c] += prop.seconds(v.aval, a, reduced(a))
        _conversions(m, prop, v, at, b.uses.get(v, ()), b.scale.get(v, 1), b.hideable, groups)
    return m, entries, auto


class CombinedGroups:
    """The collectives the solver may count as run together, as XLA's combiners run them and
    explain prices them (``costs.combined_levels``): greedy's plan's, by key and level
    (``greedy``: var -> {key: level}, the value each converts). A top-level conversion of such a
    value that is one collective of such a key is charged 1/n of its latency, n the group's
    size in greedy's plan: the whole latency once where the solver converts as greedy does. A
    value greedy converts by a collective of the same kind and operation over other axes keeps
    its level under the solver's axes, one more in that group (a gradient greedy reduces over
    data and model, reduced over data alone with the others GSPMD-style).
    Fewer of the group are charged less than they cost, the error that keeps the integer
    program as it was (a fixed charge per group made branch and bound 10x slower); explain
    prices the plan exactly, and the solver keeps greedy's plan where that is cheaper. The
    groups are greedy's because which collectives depend on which is a plan's own; values
    greedy converts independently stay independent in any plan."""

    def __init__(self, prop: Propagation, greedy: dict):
        self.prop, self.greedy = prop, greedy
        self.sizes = collections.Counter((key, level) for levels in greedy.values() for key, level in levels.items())

    def discount(self, v, a, r) -> float:
        """Seconds of the latency of converting ``v`` from ``a`` to ``r`` its group bears."""
        levels = self.greedy.get(v)
        if not levels:
            return 0.0
        key = combined_key(self.prop.pricer(v.aval).steps(a, r), v.aval)
        if key is None:
            return 0.0
        if key in levels:
            n = self.sizes[key, levels[key]]
        else:  # greedy runs a collective of this kind on v over other axes: v keeps its level
            level = max((lv for k, lv in levels.items() if k[0] == key[0] and k[2:] == key[2:]), default=None)
            if level is None or (key, level) not in self.sizes:
                return 0.0
            n = self.sizes[key, level] + 1
        return self.prop.program.links.latency(key[1]) * (1 - 1 / n)


def _taken(b: Builder, jaxpr) -> list:
    """(column, bytes per device) of each value the loops not in a loop take (not as a carry)
    at a layout, once however many take it there (costs.held_bytes): one more column, at
    least each taking loop's choice of that layout. An argument, or another loop's stacked
    output, taken where it is, is counted as that already."""
    counted = set(jaxpr.invars) | b.stacked_outputs
    out = []
    for (v, a), takers in b.taken.items():
        at = b.produced.get(v, {})
        if a in at and at[a] is None:  # an argument at its spec
            continue
        held = b.m.var()
        made = [(c, 1.0) for c in at.get(a, ())] if v in counted else []
        for c in takers:
            b.m.row([(held, 1.0), (c, -1.0)] + made, 0.0, math.inf)
        out.append((held, float(conversion.local_bytes(v.aval, a, b.prop.mesh))))
    return out


def _conversions(m: Model, prop, v, z, uses, scale=1, hideable=None, groups: CombinedGroups | None = None):
    """Columns and rows pricing ``v``'s conversions: per use, a transportation edge e[a, r]
    (sum_r e = z[a], the columns producing ``v`` at a — None: fixed there, the constant 1 —,
    sum_a e = the use's choice of r: tight for one edge); per conversion
    a -> r to a layout several uses may want, q >= every use's e[a, r], paid once (boxing
    converts once for all users; 6k of the 7b step's 92k rows are of layouts one use wants). A
    conversion a loop may overlap with its compute (``hideable``: by var, or by id of a use)
    is priced at the share of it the loop leaves exposed, given when the model is solved. A
    conversion of a value run once a step, in no loop's overlap, that greedy's plan runs with
    others is charged its share of their latency (``groups``)."""
    uses = [use for use in uses if not all(a == r for a in z for r in use)]
    if not uses:
        return
    here = list(z)
    price, pinned = prop.pricer(v.aval), prop.stationary.get(v)
    seconds = {
        (a, r): 0.0 if a == r else price(a, r) * scale + (STATIONARY_PENALTY if pinned and moves(a, r, pinned) else 0.0)
        for r in {r for use in uses for r in use}
        for a in here
    }
    if groups is not None and scale == 1 and (hideable is None or v not in hideable):
        for a, r in seconds:
            if a != r:
                seconds[a, r] -= groups.discount(v, a, r)
    shared = {}
    wanters = collections.Counter(r for use in uses for r in use)
    for use in uses:
        loop = None if hideable is None else hideable.get(v, hideable.get(id(use)))
        wanted = list(use)
        # a layout no other use wants: its edges carry the price themselves (q = e)
        prices = np.array([[seconds[a, r] if wanters[r] == 1 else 0.0 for r in wanted] for a in here])
        edges = m.vars(prices, loop)
        m.balance(edges, [z[a] for a in here])
        m.balance(edges.T, [use[r] for r in wanted])
        converted = [
            (i, j)
            for (i, a), (j, r) in itertools.product(enumerate(here), enumerate(wanted))
            if a != r and wanters[r] > 1
        ]
        new = list(dict.fromkeys((here[i], wanted[j]) for i, j in converted if (here[i], wanted[j]) not in shared))
        shared.update(zip(new, m.vars(np.array([seconds[pair] for pair in new]), loop).tolist()))
        m.at_least([shared[here[i], wanted[j]] for i, j in converted], [int(edges[i, j]) for i, j in converted])
