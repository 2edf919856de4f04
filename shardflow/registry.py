"""The one rule table: per primitive, its SBP signatures, its local lowering, its control flow.

A ``Rule`` holds everything shardflow knows about one primitive, the way JAX keys its own jvp
and batching rules by primitive:

* ``signatures(eqn) -> [Sig]``: the 1-D signatures the equation accepts on ONE mesh axis,
  OneFlow style. Propagation applies them axis by axis, so an nd signature is one 1-D
  signature per axis. Running whole (all operands B -> all outputs B) needs no entry.
* ``lower(local, eqn, ins) -> outs``: the equation on local blocks inside shard_map, for
  primitives whose params hold global shapes or that depend on a signature's meaning (a
  vocab-split lookup, a query-split attention). The chosen signature is ``eqn.params["sf"]``.
  Default: bind unchanged.
* ``propagate(prop, eqn) -> eqn``: control flow that lays itself out (while, cond, a user's
  shard_map, sf.pipeline, attention of an explicit context) for greedy, choosing its own
  operands' and bodies' NdSbps instead of picking a signature. What such a rule may ask of
  ``prop`` (``passes.propagate.Propagation``): ``of``, ``run_body``, ``loop``, ``decide``,
  ``generic`` / ``choose`` (a signature as greedy picks it), ``pinned``, ``constrained``,
  ``holding``, ``whole``, ``mesh``, ``names``. The solver takes greedy's layout of such an
  equation.
* ``comm(eqn, ins, sigs, mesh) -> steps``: the collectives a rule's own lowering runs under
  operand NdSbps ``ins`` and per-axis signatures ``sigs`` (a pad's halo exchange), as
  ``conversion.Step``s: propagation prices them and explain lists them like any conversion's.
  ``comm_reason`` says why, after the primitive's name, in explain.
* ``region(eqn) -> Loop | Call``: what the nested body of a loop-like or call-like primitive
  is to its equation (which operands are constants, carries, stacked inputs; how many trips).
  With it, greedy (``passes.propagate``), the solver, explain, the unroll choice and lowering
  handle the primitive without knowing it: a scan and a remat are registered by this alone
  (and remat by its own ``lower``). A rule with its own ``propagate`` lays the region out
  itself for greedy.
* ``solve(builder, eqn, scale) -> entry``: a region the solver lays out by the rule's own
  integer-program columns (``sf.pipeline``'s five bodies), through the builder's documented
  interface (``passes.solve``).
* ``same_value``: the result is its operand in another dtype or buffer (a cast, a copy): a
  weight cast is still the weight for explain's "gathered whole" and greedy's arguments.
* ``trips(eqn, body, mesh) -> float``: how many times the nested body of param ``body`` runs
  per execution on a device (a scan's length; a pipeline's forward once per micro-batch and
  chunk, its head once per micro-batch, its backward whole or split as the schedule runs it),
  for explain's counts and the solver's prices.
* ``flops(eqn, in_shapes, out_shapes) -> float``: the equation's floating-point work on
  operands and results of those (local) shapes, where it is more than one per element (a
  matmul, a convolution); the solver prices local work with it.
* ``pin(eqn) -> spec``: a user's pin on its operand (``sf.constrain``,
  ``with_sharding_constraint``), which propagation spreads backward as a demand.
* ``admits(eqn, decision, mesh) -> bool``: whether the rule lowers ``decision``, a combination
  of one signature per axis that the 1-D signatures cannot rule out by themselves (a grouped
  convolution's output-feature split must be whole groups). Greedy chooses again without the
  named signatures a refused decision used; the solver enumerates only admitted ones. Asked
  with ``decision`` None: whether it admits any. A rule with its own ``propagate`` is laid out
  by it, not solved, unless it admits some decision (attention of context "auto"; an explicit
  context decides by q's layout as it comes, which only greedy sees).

A primitive without a rule runs whole after its operands are gathered, and is reported.

Each equation's decision — the ``Decision`` below — is a param of the equation itself
(``eqn.params["sf"]``), set by ``passes.propagate`` and read by every later pass: it survives
any rewrite that keeps the equation's params (``eqn.replace``), prints with JAX's jaxpr
printer, and is stripped before a primitive is bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from shardflow.specs import format_sbp

DECISION = "sf"  # the equation param that holds its Decision


class Sig(NamedTuple):
    """A 1-D signature: the SBP each operand must have on one mesh axis, and what each output
    then has. ``name`` marks the signatures whose local lowering differs (e.g. "vocab")."""

    ins: tuple
    outs: tuple
    name: str = ""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What propagation chose for one equation."""

    ins: tuple  # the NdSbp each operand must have
    outs: tuple  # the NdSbp of each result
    sigs: tuple = ()  # per mesh axis, the 1-D Sig chosen ((): control flow or whole)
    bodies: tuple = ()  # control flow: (param name, NdSbp each output of that body must have)
    fallback: bool = False  # no rule: operands gathered, run whole
    unrolled: bool | None = None  # a loop: lowered unrolled, or rolled (``passes.unroll``)
    apart: bool = False  # an unrolled loop that communicates: each trip's slices held apart (``passes.unroll``)

    def body_outs(self, name: str):
        return dict(self.bodies).get(name)

    def named(self, name: str) -> tuple:
        """Indices of the mesh axes whose chosen signature is the one named ``name``."""
        return tuple(i for i, s in enumerate(self.sigs) if s is not None and s.name == name)

    def __repr__(self):
        ins = ",".join(format_sbp(s) for s in self.ins)
        outs = ",".join(format_sbp(s) for s in self.outs)
        return f"{ins}->{outs}" + (" whole" if self.fallback else "")


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop-like equation's nested body ``body`` (a param name), run ``trips`` times. Its
    operands are ``consts`` constants (the same every trip), ``carries`` carries (threaded
    through the trips: the body's first results) and, the rest, stacked inputs of which each
    trip takes one slice along dim 0 (the last first when ``reverse``); its results are the
    carries and then stacked outputs, one slice per trip. ``unroll``: trips per step of a
    rolled loop's lowering."""

    consts: int
    carries: int
    trips: int
    body: str = "jaxpr"
    reverse: bool = False
    unroll: int = 1


@dataclasses.dataclass(frozen=True)
class Call:
    """A call-like equation: its nested body ``body`` runs once on the operands as they are,
    and its results are the equation's (a remat region)."""

    body: str = "jaxpr"


@dataclasses.dataclass
class Rule:
    signatures: Callable | None = None
    lower: Callable | None = None
    propagate: Callable | None = None
    pin: Callable | None = None
    comm: Callable | None = None
    comm_reason: str = ""
    trips: Callable | None = None
    flops: Callable | None = None
    admits: Callable | None = None
    region: Callable | None = None
    solve: Callable | None = None
    same_value: bool = False

    def trips_of(self, eqn, body: str, mesh) -> float:
        """How many times ``eqn``'s body ``body`` runs per execution of ``eqn`` on a device."""
        if self.trips is not None:
            return self.trips(eqn, body, mesh)
        region = self.region(eqn) if self.region is not None else None
        return region.trips if isinstance(region, Loop) and region.body == body else 1


RULES: dict = {}


def defrule(
    *prims,
    signatures=None,
    lower=None,
    propagate=None,
    pin=None,
    comm=None,
    comm_reason=None,
    trips=None,
    flops=None,
    admits=None,
    region=None,
    solve=None,
    same_value=None,
):
    """Register (or extend) the rule of each primitive in ``prims`` (None entries — primitives
    this JAX version lacks — are skipped). Returns a decorator that sets the signatures."""
    prims = [p for p in prims if p is not None]
    for p in prims:
        rule = RULES.setdefault(p, Rule())
        for field, value in (
            ("signatures", signatures),
            ("lower", lower),
            ("propagate", propagate),
            ("pin", pin),
            ("comm", comm),
            ("comm_reason", comm_reason),
            ("trips", trips),
            ("flops", flops),
            ("admits", admits),
            ("region", region),
            ("solve", solve),
            ("same_value", same_value),
        ):
            if value is not None:
                setattr(rule, field, value)

    def decorate(fn):
        for p in prims:
            RULES[p].signatures = fn
        return fn

    return decorate


def rule_of(primitive) -> Rule | None:
    return RULES.get(primitive)


def region_of(eqn) -> Loop | Call | None:
    """The region ``eqn``'s rule describes (``Rule.region``), or None."""
    rule = RULES.get(eqn.primitive)
    return rule.region(eqn) if rule is not None and rule.region is not None else None


def trips_of(eqn, body: str, mesh) -> float:
    """``Rule.trips_of`` of ``eqn``'s rule; 1 without a rule."""
    rule = RULES.get(eqn.primitive)
    return rule.trips_of(eqn, body, mesh) if rule is not None else 1


def decision_of(eqn) -> Decision | None:
    return eqn.params.get(DECISION)


def bind_params(eqn) -> dict:
    """The equation's params as its primitive takes them (without the decision)."""
    if DECISION not in eqn.params:
        return eqn.params
    return {k: v for k, v in eqn.params.items() if k != DECISION}


def signatures(eqn):
    """The 1-D signatures of ``eqn``, or None when it has no rule (it then runs whole)."""
    rule = RULES.get(eqn.primitive)
    if rule is None or rule.signatures is None:
        return [] if not eqn.invars else None  # made from nothing (iota, empty): whole, B
    return rule.signatures(eqn)
