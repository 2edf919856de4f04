"""propagate: give every value an NdSbp, and every use the NdSbp it needs.

Before: an inlined Program (``passes.inline``) whose inputs have the NdSbp of ``in_specs``.
After: ``program.sbp[v]`` is set for every Var of every (nested) jaxpr; ``program.uses[id(eqn)]``
holds the NdSbp each operand of ``eqn`` must have, and ``program.results[id(jaxpr)]`` the NdSbp
each output of ``jaxpr`` must have (``out_specs``, scan/while carries). Where a use wants another
NdSbp than the value has, ``passes.boxing`` inserts the conversion.

How: a backward sweep first spreads *demands* — the NdSbp that ``out_specs`` and
``sf.constrain`` ask for — to the values that feed them through shape-preserving ops. Then a
forward sweep in program order picks, per equation and per mesh axis, the 1-D signature of
``shardflow.rules`` that is cheapest under the α-β link model: the conversions of its
operands (free if that conversion is already made), plus converting its outputs to their
demands. Loop carries are iterated to a fixed point. Pins (in_specs, out_specs, constraints)
are never changed. Ties go to the first signature of the rule, so the result is deterministic.
"""
from __future__ import annotations

import math

from jax import lax
from jax._src import core

from shardflow import rules
from shardflow.primitives import constrain_p
from shardflow.program import REMAT, Program, is_literal, open_jaxpr, scan_arity, source_line
from shardflow.rules import Sig
from shardflow.specs import (B, Broadcast, Partial, ShardingError, Split, axis_sizes, check_divisible,
                             describe, format_sbp, to_sbp)

EPSILON = 1e-12  # price of local-only conversions (slices, masks): free, but not for nothing

# Ops a primitive needs nothing to be "run whole" for: randomness and constants are B anyway.
_QUIET_FALLBACKS = {"random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
                    "random_split", "threefry2x32", "rng_bit_generator", "rng_uniform"}


class Propagation:
    def __init__(self, program: Program):
        self.program = program
        self.mesh = program.mesh
        self.names = program.axis_names
        self.sizes = axis_sizes(program.mesh)
        self.sbp: dict = {}
        self.uses: dict = {}
        self.results: dict = {}
        self.demand: dict = {}
        self.made: set = set()          # (var, axis index, 1-D sbp) conversions already paid for
        self.fallbacks: list = []
        self.constrained: dict = {}     # var -> (NdSbp, source) of sf.constrain on it

    # ---------------------------------------------------------------- values

    def of(self, atom):
        if is_literal(atom):
            return (B,) * len(self.names)
        return self.sbp[atom]

    def set(self, var, sbp, source=""):
        if isinstance(var, core.DropVar):
            return
        check_divisible(var.aval.shape, var.aval.dtype, sbp, self.mesh, what="value", source=source)
        self.sbp[var] = tuple(sbp)

    # ---------------------------------------------------------------- pricing

    def local_bytes(self, aval, sbp) -> float:
        n = math.prod(aval.shape) * aval.dtype.itemsize
        for a, s in zip(self.names, sbp):
            if isinstance(s, Split):
                n /= self.sizes[a]
        return n

    def price(self, aval, sbp, i, want) -> float:
        """Seconds to convert axis ``i`` of a value with NdSbp ``sbp`` to 1-D ``want``."""
        have = sbp[i]
        if have == want:
            return 0.0
        axis, n = self.names[i], self.sizes[self.names[i]]
        L = self.local_bytes(aval, sbp)
        if isinstance(have, Broadcast):
            return EPSILON  # slice (-> S) or mask (-> P): local
        if isinstance(have, Split):
            sent = (n - 1) / n * L if isinstance(want, Split) else (n - 1) * L
        else:  # Partial
            sent = (n - 1) / n * L if isinstance(want, Split) else 2 * (n - 1) / n * L
        return self.program.links.seconds((axis,), sent) + (EPSILON if isinstance(want, Partial) else 0.0)

    def valid(self, aval, sbp) -> bool:
        for d, size in enumerate(aval.shape):
            k = math.prod(self.sizes[a] for a, s in zip(self.names, sbp) if s == Split(d))
            if size % k:
                return False
        return True

    # ---------------------------------------------------------------- demands (backward sweep)

    def spread_demands(self, jaxpr, out_demands):
        for v, d in zip(jaxpr.outvars, out_demands):
            if d is not None and not is_literal(v):
                self.demand.setdefault(v, d)
        for eqn in reversed(jaxpr.eqns):
            if eqn.primitive is constrain_p:
                self.demand.setdefault(eqn.invars[0], self.pinned(eqn))
                continue
            out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
            d = self.demand.get(out) if out is not None else None
            if d is None:
                continue
            if eqn.primitive in _SHAPE_KEEPING:
                for x in eqn.invars:
                    if not is_literal(x) and x.aval.shape == out.aval.shape:
                        self.demand.setdefault(x, d)
            elif eqn.primitive is lax.transpose_p:
                perm = eqn.params["permutation"]
                self.demand.setdefault(eqn.invars[0], tuple(Split(perm[s.dim]) if isinstance(s, Split) else s
                                                            for s in d))

    def pinned(self, eqn):
        x = eqn.invars[0]
        spec = eqn.params["spec"].spec
        src = source_line(eqn)
        sbp = to_sbp(spec, self.mesh, len(x.aval.shape), what=f"sf.constrain of {describe(x.aval)} at {src}")
        check_divisible(x.aval.shape, x.aval.dtype, sbp, self.mesh, what="sf.constrain of", source=src)
        return sbp

    # ---------------------------------------------------------------- forward sweep

    def run(self, jaxpr: core.Jaxpr):
        for eqn in jaxpr.eqns:
            handler = _HANDLERS.get(eqn.primitive.name)
            if handler is not None:
                handler(self, eqn)
            else:
                self.generic(eqn)

    def generic(self, eqn):
        sigs = rules.signatures(eqn)
        src = source_line(eqn)
        cur = [self.of(a) for a in eqn.invars]
        if sigs is None:
            if eqn.primitive.name not in _QUIET_FALLBACKS or any(c != (B,) * len(self.names) for c in cur):
                self.fallbacks.append((eqn.primitive.name, src))
            req = [(B,) * len(self.names)] * len(eqn.invars)
            outs = [(B,) * len(self.names)] * len(eqn.outvars)
        else:
            req, outs = self.choose(eqn, cur, sigs)
        self.uses[id(eqn)] = tuple(req)
        for v, s in zip(eqn.outvars, outs):
            self.set(v, s, src)

    def choose(self, eqn, cur, sigs):
        n_ax = len(self.names)
        whole = Sig((B,) * len(eqn.invars), (B,) * len(eqn.outvars))
        req = [list(c) for c in cur]
        outs = [[B] * n_ax for _ in eqn.outvars]
        for i in range(n_ax):
            best, best_cost = None, math.inf
            for sig in list(sigs) + [whole]:
                cost = self.cost(eqn, req, outs, i, sig)
                if cost < best_cost:
                    best, best_cost = sig, cost
            for k, s in enumerate(best.ins):
                req[k][i] = s
                if not is_literal(eqn.invars[k]) and cur[k][i] != s:
                    self.made.add((eqn.invars[k], i, s))
            for j, s in enumerate(best.outs):
                outs[j][i] = s
        return [tuple(r) for r in req], [tuple(o) for o in outs]

    def cost(self, eqn, req, outs, i, sig) -> float:
        total = 0.0
        creates_partial = not any(isinstance(self.of(x)[i], Partial) for x in eqn.invars)
        for k, (x, s) in enumerate(zip(eqn.invars, sig.ins)):
            trial = req[k][:i] + [s] + req[k][i + 1:]
            if not self.valid(x.aval, trial):
                return math.inf
            if is_literal(x):
                if isinstance(s, Split):
                    return math.inf
                total += 0.0 if s == B else EPSILON  # B -> P of a literal: a local mask
                continue
            if (x, i, s) not in self.made:
                total += self.price(x.aval, req[k], i, s)
            want = self.demand.get(x)
            if want is not None and want[i] != s and (x, i, want[i]) not in self.made:
                total += self.price(x.aval, tuple(trial), i, want[i])  # its other users will pay this
        for j, (v, s) in enumerate(zip(eqn.outvars, sig.outs)):
            trial = outs[j][:i] + [s] + outs[j][i + 1:]
            if not self.valid(v.aval, trial):
                return math.inf
            want = self.demand.get(v)
            if want is not None and want[i] != s:
                total += self.price(v.aval, tuple(trial), i, want[i])
            elif want is None and isinstance(s, Partial) and creates_partial:
                # A partial value is reduced sooner or later: charge the cheapest reduction now,
                # so a P output is not mistaken for a free one.
                total += self.price(v.aval, tuple(trial), i, Split(0) if v.aval.shape else B)
        return total

    # ---------------------------------------------------------------- nested jaxprs

    def run_body(self, jaxpr, in_sbp, source):
        for v, s in zip(jaxpr.invars, in_sbp):
            self.set(v, s, source)
        for v in jaxpr.constvars:
            self.set(v, (B,) * len(self.names), source)
        self.run(jaxpr)
        return [self.of(v) for v in jaxpr.outvars]

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
            adopt = [p if p != c and self.adoptable(p) else c for p, c in zip(produced, carry)]
            if adopt == carry:
                break
            carry = adopt
        run_bodies(carry)
        return carry

    @staticmethod
    def adoptable(sbp) -> bool:
        return all(not (isinstance(s, Partial) and s.op != "sum") for s in sbp)


_SHAPE_KEEPING = set(rules.LINEAR) | set(rules.NONLINEAR)


# ------------------------------------------------------------------------------ handlers

def _constrain(prop: Propagation, eqn):
    x, (out,) = eqn.invars[0], eqn.outvars
    sbp = prop.pinned(eqn)
    if not is_literal(x):
        prev = prop.constrained.get(x)
        if prev is not None and prev[0] != sbp:
            raise ShardingError(
                f"conflicting constraints on {describe(x.aval)}: {format_sbp(prev[0])} at {prev[1]} and "
                f"{format_sbp(sbp)} at {source_line(eqn)}")
        prop.constrained[x] = (sbp, source_line(eqn))
    prop.uses[id(eqn)] = (sbp,)
    prop.set(out, sbp, source_line(eqn))


def _scan(prop: Propagation, eqn):
    nc, nk = scan_arity(eqn.params)
    body = open_jaxpr(eqn.params["jaxpr"])
    cur = [prop.of(a) for a in eqn.invars]
    consts, init, xs = cur[:nc], cur[nc:nc + nk], cur[nc + nk:]
    xs_outer = [tuple(B if s == Split(0) else s for s in x) for x in xs]
    xs_inner = [tuple(Split(s.dim - 1) if isinstance(s, Split) else s for s in x) for x in xs_outer]
    src = source_line(eqn)
    # What the scan's stacked outputs are wanted as, per iteration: a per-layer gradient that
    # must end up split is reduce-scattered inside the loop, not stacked whole and scattered after.
    ys_wanted = [_unstacked(prop.demand.get(v)) for v in eqn.outvars[nk:]]
    prop.spread_demands(body, [None] * nk + ys_wanted)

    def run(carry):
        return prop.run_body(body, consts + list(carry) + xs_inner, src)[:nk]

    carry = prop.loop(run, init)
    prop.results[id(body)] = tuple(carry) + tuple(ys_wanted)
    prop.uses[id(eqn)] = tuple(consts + carry + xs_outer)
    ys = [want or prop.of(v) for v, want in zip(body.outvars[nk:], ys_wanted)]
    for v, s in zip(eqn.outvars[:nk], carry):
        prop.set(v, s, src)
    for v, s in zip(eqn.outvars[nk:], ys):
        prop.set(v, tuple(Split(t.dim + 1) if isinstance(t, Split) else t for t in s), src)


def _unstacked(sbp):
    """The NdSbp of one slice of a value stacked on a new leading dim, or None."""
    if sbp is None or Split(0) in sbp:
        return None
    return tuple(Split(s.dim - 1) if isinstance(s, Split) else s for s in sbp)


def _while(prop: Propagation, eqn):
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond, body = open_jaxpr(eqn.params["cond_jaxpr"]), open_jaxpr(eqn.params["body_jaxpr"])
    cur = [prop.of(a) for a in eqn.invars]
    cconsts, bconsts, init = cur[:cn], cur[cn:cn + bn], cur[cn + bn:]
    src = source_line(eqn)

    def run(carry):
        prop.run_body(cond, cconsts + list(carry), src)
        return prop.run_body(body, bconsts + list(carry), src)

    carry = prop.loop(run, init)
    prop.results[id(cond)] = ((B,) * len(prop.names),)
    prop.results[id(body)] = tuple(carry)
    prop.uses[id(eqn)] = tuple(cconsts + bconsts + carry)
    for v, s in zip(eqn.outvars, carry):
        prop.set(v, s, src)


def _cond(prop: Propagation, eqn):
    branches = [open_jaxpr(b) for b in eqn.params["branches"]]
    cur = [prop.of(a) for a in eqn.invars]
    src = source_line(eqn)
    outs = None
    for br in branches:
        produced = prop.run_body(br, cur[1:], src)
        outs = outs or produced
        prop.results[id(br)] = tuple(outs)
    prop.uses[id(eqn)] = ((B,) * len(prop.names),) + tuple(cur[1:])
    for v, s in zip(eqn.outvars, outs):
        prop.set(v, s, src)


def _call(prop: Propagation, eqn):
    """remat / checkpoint: the body runs on the operands as they are."""
    body = open_jaxpr(eqn.params["jaxpr"])
    cur = [prop.of(a) for a in eqn.invars]
    outs = prop.run_body(body, cur, source_line(eqn))
    prop.uses[id(eqn)] = tuple(cur)
    for v, s in zip(eqn.outvars, outs):
        prop.set(v, s, source_line(eqn))


_HANDLERS = {
    constrain_p.name: _constrain,
    lax.scan_p.name: _scan,
    lax.while_p.name: _while,
    lax.cond_p.name: _cond,
    **{name: _call for name in REMAT},
}


def reduced(sbp):
    """An output left to propagation is never partial: P axes become B."""
    return tuple(B if isinstance(s, Partial) else s for s in sbp)


def propagate(program: Program) -> Program:
    prop = Propagation(program)
    jaxpr = program.jaxpr.jaxpr
    prop.spread_demands(jaxpr, program.out_sbp)
    for v in jaxpr.constvars:
        prop.set(v, (B,) * len(prop.names))
    for v, s in zip(jaxpr.invars, program.in_sbp):
        prop.set(v, s, "in_specs")
    prop.run(jaxpr)
    prop.results[id(jaxpr)] = tuple(s if s is not None else reduced(prop.of(v))
                                    for v, s in zip(jaxpr.outvars, program.out_sbp))
    return program.replace(sbp=prop.sbp, uses=prop.uses, results=prop.results, fallbacks=prop.fallbacks)
