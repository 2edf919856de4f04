"""propagate: give every value an NdSbp and every equation a Decision.

Requires: an inlined Program (``passes.inline``); its inputs have the NdSbp of ``in_specs``.
Ensures ("sharded"): ``program.sbp[v]`` for every Var of every (nested) jaxpr, and
``eqn.params["sf"]`` — a ``registry.Decision`` — on every equation: the NdSbp each operand must
have, the NdSbp of each result, the 1-D signature chosen per mesh axis, and for control flow the
NdSbp each body output must have. ``program.out_sbp`` is complete. Where a use wants another
NdSbp than its value has, ``passes.boxing`` inserts the conversion.

How: a backward sweep first spreads *demands* — the NdSbp that ``out_specs`` and
``sf.constrain`` ask for — to the values that feed them through shape-preserving ops. Then a
forward sweep in program order picks, per equation and per mesh axis, the 1-D signature of the
equation's rule that is cheapest: the conversions of its operands (free if already made), plus
converting its outputs to their demands, each priced as the conversion plan that would run
(``conversion.seconds``, the one pricer). Control flow is registered in the same table
(``shardflow.rules.control``); loop carries iterate to a fixed point. Pins (in_specs,
out_specs, constraints) are never changed. Ties go to the first signature of the rule, so the
result is deterministic.
"""

from __future__ import annotations

import contextlib
import math

from jax import lax
from jax.extend.core import DropVar, Jaxpr

from shardflow import conversion, registry, rules  # noqa: F401  (rules: registers every rule)
from shardflow.costs import STATIONARY_PENALTY, moves, stationary_values
from shardflow.elementwise_primitives import SHAPE_KEEPING
from shardflow.program import Program, all_eqns, is_literal, nested, open_jaxpr, rebody, source_line
from shardflow.registry import DECISION, Call, Decision, Loop, Sig
from shardflow.specs import (
    B,
    Partial,
    ShardingError,
    Split,
    check_divisible,
    describe,
    divides,
    stacked,
    to_sbp,
    unstacked,
)


class Propagation:
    def __init__(self, program: Program, prices: dict | None = None):
        """``prices``: a memo of conversion prices (``seconds``) to share with other
        Propagations of the same program."""
        self.program = program
        self.mesh = program.mesh
        self.names = program.axis_names
        self.whole = (B,) * len(self.names)
        self.sbp: dict = {}
        self.demand: dict = {}
        self.demanded_by: dict = {}  # var -> the equation whose output's demand it took
        self.made: dict = {}  # var -> NdSbps it is already converted to
        self.fallbacks: list = []
        self.constrained: dict = {}  # var -> (NdSbp, source) of sf.constrain on it
        self.graph = None  # (users, producer) for the lookahead
        self._arguments = None  # the arguments and their casts and loop views
        self.held: set = set()  # axes bodies may not split (a pipeline's stages)
        self._prices: dict = {} if prices is None else prices
        self._valid: dict = {}
        self.stationary = stationary_values(program)  # var -> mesh axes it may not move over

    def seeded(self) -> Propagation:
        """Itself, with the program's constants B and its inputs at their in_specs (but those
        the solver chooses, sf.AUTO)."""
        for v in self.program.jaxpr.jaxpr.constvars:
            self.set(v, self.whole)
        for v, s in zip(self.program.jaxpr.jaxpr.invars, self.program.in_sbp):
            if s is not None:
                self.set(v, s, "in_specs")
        return self

    # ---------------------------------------------------------------- values

    def of(self, atom):
        return self.whole if is_literal(atom) else self.sbp[atom]

    def set(self, var, sbp, source=""):
        if isinstance(var, DropVar):
            return
        check_divisible(var.aval.shape, var.aval.dtype, sbp, self.mesh, what="value", source=source)
        self.sbp[var] = tuple(sbp)

    # ---------------------------------------------------------------- pricing

    def seconds(self, aval, src, dst) -> float:
        return self.pricer(aval)(tuple(src), tuple(dst))

    def pricer(self, aval) -> conversion.Pricer:
        """``seconds`` for values of ``aval``'s shape and dtype, as a function of (src, dst)
        NdSbp tuples: the same conversion of same-shaped values priced once."""
        key = (aval.shape, aval.dtype)
        if key not in self._prices:
            self._prices[key] = conversion.Pricer(aval.shape, aval.dtype, self.mesh, self.program.links)
        return self._prices[key]

    def use_seconds(self, x, src, dst) -> float:
        """Converting ``x`` to ``dst``, from ``src`` or from a conversion of it already made; a
        stationary value moved over its axes at ``STATIONARY_PENALTY`` more."""
        seconds = min([self.seconds(x.aval, src, dst)] + [self.seconds(x.aval, m, dst) for m in self.made.get(x, ())])
        axes = self.stationary.get(x)
        return seconds + STATIONARY_PENALTY if axes and moves(src, dst, axes) else seconds

    def valid(self, aval, sbp) -> bool:
        key = (aval.shape, sbp)
        if key not in self._valid:
            self._valid[key] = divides(aval.shape, sbp, self.mesh)
        return self._valid[key]

    # ---------------------------------------------------------------- demands (backward sweep)

    def spread_demands(self, jaxpr, out_demands):
        for v, d in zip(jaxpr.outvars, out_demands):
            if d is not None and not is_literal(v):
                self.demand.setdefault(v, d)
        for eqn in reversed(jaxpr.eqns):
            rule = registry.rule_of(eqn.primitive)
            if rule is not None and rule.pin is not None:
                self.demand.setdefault(eqn.invars[0], self.pinned(eqn))
                continue
            out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
            d = self.demand.get(out) if out is not None else None
            if d is None:
                continue
            if eqn.primitive in SHAPE_KEEPING:
                for x in eqn.invars:
                    if not is_literal(x) and x.aval.shape == out.aval.shape and x not in self.demand:
                        self.demand[x], self.demanded_by[x] = d, eqn
            elif eqn.primitive is lax.transpose_p and eqn.invars[0] not in self.demand:
                perm = eqn.params["permutation"]
                self.demand[eqn.invars[0]] = tuple(Split(perm[s.dim]) if isinstance(s, Split) else s for s in d)
                self.demanded_by[eqn.invars[0]] = eqn

    def pinned(self, eqn):
        """The NdSbp a pinning equation (sf.constrain, with_sharding_constraint) asks for."""
        x = eqn.invars[0]
        src = source_line(eqn)
        spec = registry.rule_of(eqn.primitive).pin(eqn)
        sbp = to_sbp(spec, self.mesh, len(x.aval.shape), what=f"constraint of {describe(x.aval)} at {src}")
        check_divisible(x.aval.shape, x.aval.dtype, sbp, self.mesh, what="constraint of", source=src)
        return sbp

    # ---------------------------------------------------------------- forward sweep

    def run(self, jaxpr: Jaxpr) -> Jaxpr:
        """``jaxpr`` with every equation's Decision, and the NdSbp of every value it defines."""
        eqns = []
        for eqn in jaxpr.eqns:
            rule = registry.rule_of(eqn.primitive)
            if rule is not None and rule.propagate is not None:
                eqns.append(rule.propagate(self, eqn))
            elif isinstance(region := registry.region_of(eqn), Loop):
                eqns.append(self.loop_region(eqn, region))
            elif isinstance(region, Call):
                eqns.append(self.call_region(eqn, region))
            else:
                eqns.append(self.generic(eqn))
        return jaxpr.replace(eqns=eqns)

    def decide(self, eqn, decision: Decision, source: str = "", **params):
        """``eqn`` annotated with ``decision`` (and new params, e.g. annotated bodies); its
        results take the decision's NdSbps."""
        for v, s in zip(eqn.outvars, decision.outs):
            self.set(v, s, source or source_line(eqn))
        return eqn.replace(params={**eqn.params, **params, DECISION: decision})

    def generic(self, eqn):
        sigs = registry.signatures(eqn)
        cur = [self.of(a) for a in eqn.invars]
        if sigs is None:
            self.fallbacks.append((eqn.primitive.name, source_line(eqn)))
            return self.decide(
                eqn, Decision((self.whole,) * len(eqn.invars), (self.whole,) * len(eqn.outvars), fallback=True)
            )
        rule = registry.rule_of(eqn.primitive)
        admits = rule.admits if rule is not None else None
        made = {x: set(self.made.get(x, ())) for x in eqn.invars if not is_literal(x)}
        decision = self.choose(eqn, cur, sigs)
        while admits is not None and not admits(eqn, decision, self.mesh):
            # the named signatures that combined into a decision the rule refuses, dropped
            refused = {s.name for s in decision.sigs if s.name and s in sigs}
            if not refused:
                raise ShardingError(
                    f"{source_line(eqn)}: {eqn.primitive.name}'s rule refuses {decision}, "
                    f"which uses none of its named signatures"
                )
            for x, m in made.items():  # a refused choice's conversions are not made
                self.made[x] = set(m)
            sigs = [s for s in sigs if s.name not in refused]
            decision = self.choose(eqn, cur, sigs)
        return self.decide(eqn, decision)

    def choose(self, eqn, cur, sigs, candidates=None) -> Decision:
        """The cheapest signature per mesh axis, in mesh order, of ``sigs`` and running whole;
        ``candidates(i, whole)``, where given, lists axis ``i``'s instead. An equation with
        flops (a matmul) runs whole on an axis only where none of its signatures fits, or on
        operands that are whole there already or arguments (a weight gathered, as FSDP does):
        the cost here prices conversions, not local work, so gathering an activation to run
        whole looked cheaper than dividing — the 1b step under 2d gathered attention's output
        and ran its output projection whole on both model devices, dearer by the model overall."""
        n_ax = len(self.names)
        whole = Sig((B,) * len(eqn.invars), (B,) * len(eqn.outvars), "whole")
        rule = registry.rule_of(eqn.primitive)
        divides = candidates is None and rule is not None and rule.flops is not None
        req = [list(c) for c in cur]
        outs = [[B] * n_ax for _ in eqn.outvars]
        met = [None if v in self.demand else self.affinity(v) for v in eqn.outvars]  # walked once
        chosen = []
        # Axes are chosen in mesh order, each priced with the later axes as the operands are.
        # An equation whose own lowering runs collectives prices them on every axis at once:
        # its axes are chosen once more, each with the others as chosen (a pad on dim 0 split
        # over both axes of {data: 2, model: 4}: the halo over data costs two rounds while
        # model still splits the rows, so data was gathered too — 3,584 bytes where 1,536 do).
        again = n_ax > 1 and rule is not None and rule.comm is not None
        for i in list(range(n_ax)) + list(range(n_ax) if again else ()):
            best, best_cost = None, math.inf
            if i < len(chosen):  # the second time: another signature only if it is cheaper
                best, best_cost = chosen[i], self.cost(eqn, cur, req, outs, i, chosen[i], chosen, met)
            for sig in [whole] if i in self.held else candidates(i, whole) if candidates else list(sigs) + [whole]:
                if (
                    sig is whole
                    and divides
                    and best is not None
                    and any(
                        not is_literal(x) and c[i] != B and x not in self.arguments() for x, c in zip(eqn.invars, cur)
                    )
                ):
                    break
                cost = self.cost(eqn, cur, req, outs, i, sig, chosen, met)
                if cost < best_cost:
                    best, best_cost = sig, cost
            if best is None:
                shapes = ", ".join(describe(x.aval) for x in eqn.invars if not is_literal(x))
                raise ShardingError(
                    f"{source_line(eqn)}: no signature of {eqn.primitive.name} fits mesh axis "
                    f"{self.names[i]!r} ({self.mesh.devices.shape[i]} devices) for {shapes}"
                )
            chosen[i : i + 1] = [best]
            for k, s in enumerate(best.ins):
                req[k][i] = s
            for j, s in enumerate(best.outs):
                outs[j][i] = s
        req = [tuple(r) for r in req]
        for x, c, r in zip(eqn.invars, cur, req):
            if not is_literal(x) and c != r:
                self.made.setdefault(x, set()).add(r)
        return Decision(tuple(req), tuple(tuple(o) for o in outs), tuple(chosen))

    def cost(self, eqn, cur, req, outs, i, sig, chosen, met) -> float:
        """Seconds that choosing ``sig`` on axis ``i`` costs; ``met``: per output, the NdSbp it
        will meet downstream (``affinity``) or None."""
        total = 0.0
        creates_partial = not any(isinstance(self.of(x)[i], Partial) for x in eqn.invars)
        for k, (x, s) in enumerate(zip(eqn.invars, sig.ins)):
            trial = tuple(req[k][:i] + [s] + req[k][i + 1 :])
            if not self.valid(x.aval, trial):
                return math.inf
            if is_literal(x):
                if isinstance(s, Split):
                    return math.inf
                total += self.seconds(x.aval, self.whole, trial)  # B -> P of a literal: a local mask
                continue
            total += self.use_seconds(x, cur[k], trial)
            want = self.demand.get(x)
            # its other users will pay this (a demand taken from this equation's output is
            # charged there, below). Where it is not yet as they want it, they convert it
            # whatever this one does: a split they must undo is charged too (a gradient partial
            # over data, split over an unused axis for its square in the global norm, saved a
            # quarter of a small all-reduce and cost a gather for the optimizer)
            if want is not None and want[i] != s and cur[k] != want and self.demanded_by.get(x) is not eqn:
                total += self.use_seconds(x, trial, _with(trial, i, want[i]))
        for j, (v, s) in enumerate(zip(eqn.outvars, sig.outs)):
            trial = tuple(outs[j][:i] + [s] + outs[j][i + 1 :])
            if not self.valid(v.aval, trial):
                return math.inf
            want = self.demand.get(v)
            if want is None and met[j] is not None and met[j][i] is not None:
                want = met[j]
            if want is not None and want[i] != s:
                to_want = self.seconds(v.aval, trial, _with(trial, i, want[i]))
                total += self.deferred(eqn, i, s, creates_partial, to_want)
            elif want is None and isinstance(s, Partial):
                # A partial value is reduced sooner or later: charge the cheapest reduction now,
                # so a P output is not mistaken for a free one.
                total += self.deferred(eqn, i, s, creates_partial, self.reduction_seconds(v, trial, i))
        return total + self.own_collectives(eqn, req, i, sig, chosen)

    def deferred(self, eqn, i, s, creates_partial, reduce_out) -> float:
        """What reducing an output of SBP ``s`` on axis ``i`` (``reduce_out`` seconds) costs this
        equation. A partial operand flowing through defers its own reduction to the output:
        only what that costs more is charged (an MoE's dispatched tokens [e, c, d] carried into
        the experts' [e, c, h]; a sum of partial terms reduced once, not each term — the
        global norm of tensor-parallel gradients)."""
        if creates_partial or not isinstance(s, Partial):
            return reduce_out
        reduce_in = max(
            self.reduction_seconds(x, self.of(x), i)
            for x in eqn.invars
            if not is_literal(x) and isinstance(self.of(x)[i], Partial)
        )
        return max(0.0, reduce_out - reduce_in)

    def reduction_seconds(self, v, sbp, i) -> float:
        """The cheapest reduction of a value partial on axis ``i``: to B or a split it divides."""
        return min(self.seconds(v.aval, sbp, _with(sbp, i, t)) for t in _reductions(v, sbp, i, self))

    def own_collectives(self, eqn, req, i, sig, chosen) -> float:
        """Seconds of the collectives an equation's own lowering runs (a pad's halo exchange)."""
        rule = registry.rule_of(eqn.primitive)
        if rule is None or rule.comm is None:
            return 0.0
        ins = tuple(tuple(r[:i]) + (s,) + tuple(r[i + 1 :]) for r, s in zip(req, sig.ins))
        steps = rule.comm(eqn, ins, tuple(chosen[:i]) + (sig,) + tuple(chosen[i + 1 :]), self.mesh)
        return conversion.steps_seconds(steps, self.program.links)

    # ---------------------------------------------------------------- lookahead

    def affinity(self, v):
        """What ``v`` will meet downstream, per mesh axis over ``v``'s dims (None where any
        layout will do), or None. That is the first value of known sharding that ``v`` meets
        elementwise — demanded by an out_spec or constraint, already decided, or computed
        elementwise from a decided value; a B met there is sliced for free. Where ``v`` grew
        on the way (made larger than its operands, or broadcast), a contraction met counts
        too: the layout it needs of ``v`` given its other operands as decided (``_needed``),
        a B there included — a large value is cheapest laid out where it is made, for the
        price of moving its small operands.

        Greedy choice alone prices an equation's output as free when nothing demands it; its
        users then pay. A per-channel statistic reduce-scattered to a channel split (cheaper
        than an all-reduce, by a little) and broadcast over the activations it normalises made
        every BatchNorm backward all-gather activation-sized tensors; random bits split on the
        first dim met an all_to_all at the dropout's select. Pricing the output's conversion to
        what it will meet fixes both. An MoE's slot of each routed token (a one-hot over the
        capacity, from a position summed over the experts' axis) met the dispatch einsum, whose
        routing mask splits the experts: reduce-scattering the position over tokens instead of
        all-reducing it split the dispatched tokens' contraction, and every expert's input was
        reduced over that axis too (3.5x GSPMD's bytes). The whole-program solver replaces this."""
        users, producer = self._graph()
        start = producer.get(v)
        grown = start is not None and all(
            math.prod(x.aval.shape) < math.prod(v.aval.shape) for x in start.invars if not is_literal(x)
        )
        frontier, seen, budget = [(v, tuple(range(len(v.aval.shape))), grown)], {v}, [_LOOK]
        while frontier and budget[0] > 0:
            u, dims, grown = frontier.pop(0)  # dims[d]: the dim of u that dim d of v became
            budget[0] -= 1
            if u is not v and u in self.demand:
                return _carried_back(self.demand[u], dims, v, u)
            for eqn in users.get(u, ()):
                if _elementwise_on(eqn, u):
                    for other in eqn.invars:
                        if other is u or is_literal(other) or other.aval.shape != u.aval.shape:
                            continue
                        known = self._known(other, producer, budget)
                        if known is not None:
                            return _carried_back(known, dims, v, u)
                    nxt, bigger = dims, grown
                elif eqn.primitive is lax.broadcast_in_dim_p:
                    nxt, bigger = tuple(eqn.params["broadcast_dimensions"][e] for e in dims), True
                else:
                    needed = self._needed(eqn, u) if grown else None
                    if needed is not None:
                        return _carried_back(needed, dims, v, u, free=())
                    continue
                out = eqn.outvars[0]
                if out not in seen:
                    seen.add(out)
                    frontier.append((out, nxt, bigger))
        return None

    def _needed(self, eqn, u):
        """Per mesh axis, the layout of operand ``u`` that the first signature of ``eqn``
        fitting its other operands as decided asks for (None where none fits, or where it asks
        for a partial); None unless ``eqn`` has flops (a contraction) and its other operands
        are decided values, not arguments (a weight moves: FSDP gathers it)."""
        rule = registry.rule_of(eqn.primitive)
        others = [(k, x) for k, x in enumerate(eqn.invars) if x is not u and not is_literal(x)]
        if (
            rule is None
            or rule.flops is None
            or not others
            or any(x not in self.sbp or x in self.arguments() for _, x in others)
        ):
            return None
        k_u = eqn.invars.index(u)
        needed, sigs = [], registry.signatures(eqn)
        for i in range(len(self.names)):
            fits = [sig.ins[k_u] for sig in sigs if all(sig.ins[k] == self.sbp[x][i] for k, x in others)]
            needed.append(fits[0] if fits and not isinstance(fits[0], Partial) else None)
        return None if all(s is None for s in needed) else tuple(needed)

    def _known(self, v, producer, budget):
        """The NdSbp of ``v``: decided, or that of a decided value it is computed from elementwise."""
        todo = [v]
        while todo and budget[0] > 0:
            u = todo.pop(0)
            budget[0] -= 1
            if u in self.sbp:
                return self.sbp[u]
            eqn = producer.get(u)
            if eqn is not None and _elementwise_on(eqn, u):
                todo += [w for w in eqn.invars if not is_literal(w) and w.aval.shape == u.aval.shape]
        return None

    def arguments(self) -> set:
        """The program's arguments and the same tensors further on: a cast of one, and inside a
        loop or remat its view of one (a scan's per-layer slice, a const; not a carry)."""
        if self._arguments is None:
            args = set(self.program.jaxpr.jaxpr.invars)
            for eqn in all_eqns(self.program.jaxpr.jaxpr):  # an equation before its bodies
                x = eqn.invars[0] if eqn.invars else None
                if _same_value(eqn) and not is_literal(x) and x in args:
                    args.add(eqn.outvars[0])
                carries = range(*_carry_positions(eqn))
                for body in nested(eqn):
                    if len(body.invars) == len(eqn.invars):
                        args.update(
                            v
                            for k, (x, v) in enumerate(zip(eqn.invars, body.invars))
                            if k not in carries and not is_literal(x) and x in args
                        )
            self._arguments = args
        return self._arguments

    def _graph(self):
        """(users, producer) of every Var of the program, nested bodies included."""
        if self.graph is None:
            users, producer = {}, {}
            for eqn in all_eqns(self.program.jaxpr.jaxpr):
                for x in eqn.invars:
                    if not is_literal(x):
                        users.setdefault(x, []).append(eqn)
                for v in eqn.outvars:
                    producer[v] = eqn
            self.graph = users, producer
        return self.graph

    # ---------------------------------------------------------------- nested jaxprs

    @contextlib.contextmanager
    def holding(self, axis: int):
        """Within: equations run whole on mesh axis ``axis`` (inside a pipeline's stage every
        device of the axis runs its own stage: the axis is not there to split work over)."""
        held, self.held = self.held, self.held | {axis}
        try:
            yield
        finally:
            self.held = held

    def run_body(self, jaxpr, in_sbp, source):
        """(annotated body, NdSbp of its outputs) with its inputs at ``in_sbp``."""
        for v, s in zip(jaxpr.invars, in_sbp):
            self.set(v, s, source)
        for v in jaxpr.constvars:
            self.set(v, self.whole, source)
        body = self.run(jaxpr)
        return body, [self.of(v) for v in body.outvars]

    def loop_region(self, eqn, loop: Loop):
        """A loop's operands as they come but a stacked input's stacked dim (never split), its
        body laid out at a fixed point of its carries; a stacked output wanted split per trip
        (a per-layer gradient that must end up split) is reduce-scattered inside the loop, not
        stacked whole and scattered after."""
        nc, nk = loop.consts, loop.carries
        closed = eqn.params[loop.body]
        body = open_jaxpr(closed)
        cur = [self.of(a) for a in eqn.invars]
        consts, init, xs = cur[:nc], cur[nc : nc + nk], cur[nc + nk :]
        xs_outer = [tuple(B if s == Split(0) else s for s in x) for x in xs]
        xs_inner = [unstacked(x) for x in xs_outer]
        src = source_line(eqn)
        ys_wanted = [unstacked(self.demand.get(v)) for v in eqn.outvars[nk:]]
        self.spread_demands(body, [None] * nk + ys_wanted)
        annotated = []

        def run(carry):
            new, outs = self.run_body(body, consts + list(carry) + xs_inner, src)
            annotated.append(new)
            return outs[:nk]

        carry = self.loop(run, init)
        ys = [want or self.of(v) for v, want in zip(body.outvars[nk:], ys_wanted)]
        decision = Decision(
            tuple(consts + carry + xs_outer),
            tuple(carry) + tuple(stacked(s) for s in ys),
            bodies=((loop.body, tuple(carry) + tuple(ys_wanted)),),
        )
        return self.decide(eqn, decision, src, **{loop.body: rebody(closed, annotated[-1])})

    def call_region(self, eqn, call: Call):
        """A call's body runs on the operands as they are."""
        cur = [self.of(a) for a in eqn.invars]
        closed = eqn.params[call.body]
        new, outs = self.run_body(open_jaxpr(closed), cur, source_line(eqn))
        decision = Decision(tuple(cur), tuple(outs), bodies=((call.body, None),))
        return self.decide(eqn, decision, **{call.body: rebody(closed, new)})

    def loop(self, run_bodies, carry_init, attempts=3):
        """Fixed point of loop carries. ``run_bodies(carry)`` propagates through the loop bodies
        and returns the carry NdSbps they produce. A produced carry is adopted (the initial value
        is converted once, before the loop) until it stops changing; if it keeps changing, the
        body's result is converted back to the carry at the end of each iteration."""
        carry = list(carry_init)
        for _ in range(attempts):
            produced = run_bodies(carry)
            if produced == carry:
                return carry
            adopt = [p if p != c and _adoptable(p) else c for p, c in zip(produced, carry)]
            if adopt == carry:
                break
            carry = adopt
        run_bodies(carry)
        return carry


_LOOK = 64  # values the lookahead visits at most, each way


def _elementwise_on(eqn, v) -> bool:
    """Whether ``eqn`` maps ``v`` elementwise to its one result (same shape)."""
    return (
        len(eqn.outvars) == 1
        and eqn.outvars[0].aval.shape == v.aval.shape
        and (eqn.primitive in SHAPE_KEEPING or eqn.primitive is lax.bitcast_convert_type_p)
    )


def _carried_back(sbp, dims, v, u, free=(B,)):
    """``sbp`` of ``u`` carried back to ``v``: S(dims[d]) -> S(d) where that dim of ``v`` was
    not broadcast on the way; a layout in ``free`` (any will do there) or a dim broadcast on
    the way -> None; B stays B."""
    out = []
    for s in sbp:
        d = dims.index(s.dim) if isinstance(s, Split) and s.dim in dims else None
        if isinstance(s, Split):
            out.append(Split(d) if d is not None and v.aval.shape[d] == u.aval.shape[s.dim] else None)
        else:
            out.append(B if s is B and B not in free else None)
    return tuple(out)


def _with(sbp, i, s) -> tuple:
    return tuple(sbp[:i]) + (s,) + tuple(sbp[i + 1 :])


def _reductions(v, trial, i, prop):
    """Where a new partial value can be reduced to on axis ``i``: B, or S(d) of a dim it divides."""
    out = [B]
    for d in range(len(v.aval.shape)):
        cand = _with(trial, i, Split(d))
        if prop.valid(v.aval, cand):
            out.append(Split(d))
            break
    return out


def _same_value(eqn) -> bool:
    rule = registry.rule_of(eqn.primitive)
    return rule is not None and rule.same_value


def _carry_positions(eqn) -> tuple[int, int]:
    """(first, end) of a loop's carries among its operands; (0, 0) for other equations."""
    region = registry.region_of(eqn)
    if not isinstance(region, Loop):
        return 0, 0
    return region.consts, region.consts + region.carries


def _adoptable(sbp) -> bool:
    return all(not (isinstance(s, Partial) and s.op != "sum") for s in sbp)


def reduced(sbp):
    """An output left to propagation is never partial: P axes become B."""
    return tuple(B if isinstance(s, Partial) else s for s in sbp)


def propagate(program: Program) -> Program:
    if program.auto_inputs:
        raise ShardingError(
            f"in_specs sf.AUTO for {', '.join(program.auto_inputs)}: the greedy planner takes "
            "every input's layout as given; sf.AUTO needs the solver "
            "(sf.parallelize(..., passes=sf.passes.SOLVER))"
        )
    if program.memory_budget is not None:
        raise ShardingError(
            f"memory_budget={program.memory_budget:,}: the greedy planner does not keep to a "
            "memory budget; use the solver (sf.parallelize(..., passes=sf.passes.SOLVER))"
        )
    prop = Propagation(program).seeded()
    closed = program.jaxpr
    prop.spread_demands(closed.jaxpr, program.out_sbp)
    jaxpr = prop.run(closed.jaxpr)
    out_sbp = tuple(s if s is not None else reduced(prop.of(v)) for v, s in zip(jaxpr.outvars, program.out_sbp))
    return program.replace(jaxpr=closed.replace(jaxpr=jaxpr), sbp=prop.sbp, out_sbp=out_sbp, fallbacks=prop.fallbacks)
