"""assemble: the integer program solved (``choose``) and its choices made the program's
equations and layouts; one solve of a program (``solved``), its loops laid out by greedy where
solving them runs out of limits, and the overlap shares its plan leaves the loops."""

from __future__ import annotations

from typing import NamedTuple

from shardflow import registry
from shardflow.costs import Modelled, hideable, modelled
from shardflow.passes.boxing import boxing
from shardflow.passes.propagate import Propagation, reduced
from shardflow.passes.solve.agreement import process_0s
from shardflow.passes.solve.build import CallEntry, LoopEntry, build, lays_itself_out, solved_with_bodies
from shardflow.passes.solve.highs import TIME_LIMIT
from shardflow.passes.solve.model import Infeasible, Unsolvable
from shardflow.program import Program, open_jaxpr, rebody, source_line, subjaxprs
from shardflow.registry import DECISION, Call, Decision, Loop
from shardflow.specs import stacked


def choose(
    prop: Propagation,
    jaxpr,
    out_sbp,
    time_limit: float | None = None,
    given: dict | None = None,
    exposed: dict | None = None,
    warm: dict | None = None,
    built: dict | None = None,
    combined: dict | None = None,
):
    """(the equations of ``jaxpr`` with their Decisions — bodies of solved scans and remats
    annotated too, every value's NdSbp set on ``prop`` —, {sf.AUTO input: its NdSbp}, the
    modelled seconds, a lower bound on the optimum's) of the plan ``Model.solve`` found;
    raises Unsolvable. ``exposed``: the loops' overlap shares; ``warm``: see ``highs.relaxation``;
    ``built``: a dict keeping the model built for ``given``'s equations, for the next solve of
    the same program (only the shares differ); ``combined``: greedy's combinable collectives
    (``build.CombinedGroups``)."""
    key = frozenset(given or ())
    if built is not None and key in built:
        model, entries, auto, fallbacks = built[key]
        prop.fallbacks[:] = fallbacks
    else:
        model, entries, auto = build(prop, jaxpr, out_sbp, given, combined)
        if built is not None:
            built[key] = model, entries, auto, list(prop.fallbacks)
    result = process_0s(
        lambda: model.solve(TIME_LIMIT if time_limit is None else time_limit, warm, exposed), len(model.cost)
    )
    if result.status == 2:  # infeasible (the relaxation's or scipy's milp's)
        raise Infeasible(result.message.strip())
    if result.status != 0 or result.x is None:
        raise Unsolvable(result.message.strip())

    def pick(options, cols):
        return options[max(range(len(cols)), key=lambda i: result.x[cols[i]])]

    chosen_auto = {v: pick(options, cols) for v, options, cols in auto}
    for v, s in chosen_auto.items():
        prop.set(v, s, "sf.AUTO")
    return _assemble(prop, entries, pick, given or {}), chosen_auto, result.fun / 1e6, result.bound / 1e6


def _assemble(prop: Propagation, entries, pick, given) -> list:
    """The equations of ``entries`` with their chosen Decisions; their results' NdSbps set."""
    eqns = []
    for entry in entries:
        if isinstance(entry, LoopEntry):
            eqn = _assemble_loop(prop, entry, pick, given)
        elif isinstance(entry, CallEntry):
            eqn = _assemble_call(prop, entry, pick, given)
        elif hasattr(entry, "assemble"):  # a rule's own solve hook's entry (sf.pipeline's)
            eqn = entry.assemble(prop, pick, lambda body: _assemble(prop, body, pick, given))
        else:
            eqn, options, cols = entry
            decision = pick(options, cols)[0]
            eqn = given[eqn] if eqn in given else eqn.replace(params={**eqn.params, DECISION: decision})
        for v, s in zip(eqn.outvars, registry.decision_of(eqn).outs):
            prop.set(v, s, source_line(eqn))
        eqns.append(eqn)
    return eqns


def _body(prop: Propagation, eqn, name: str, ins):
    """Body ``name`` of ``eqn``, its consts B and its inputs at ``ins``."""
    body = open_jaxpr(eqn.params[name])
    for v in body.constvars:
        prop.set(v, prop.whole)
    for v, s in zip(body.invars, ins):
        prop.set(v, s)
    return body


def _assemble_call(prop: Propagation, entry: CallEntry, pick, given):
    eqn, name = entry.eqn, entry.call.body
    ins = tuple(prop.of(x) for x in eqn.invars)
    body = _body(prop, eqn, name, ins)
    body = body.replace(eqns=_assemble(prop, entry.body, pick, given))
    decision = Decision(ins, tuple(prop.of(v) for v in body.outvars), bodies=((name, None),))
    return eqn.replace(params={**eqn.params, name: rebody(eqn.params[name], body), DECISION: decision})


def _assemble_loop(prop: Propagation, entry: LoopEntry, pick, given):
    eqn, loop = entry.eqn, entry.loop
    nc, nk = loop.consts, loop.carries
    ins = [pick(*choice) for choice in entry.ins]
    body = _body(prop, eqn, loop.body, ins)
    body = body.replace(eqns=_assemble(prop, entry.body, pick, given))
    ys = [pick(*choice) for choice in entry.ys]
    carry = ins[nc : nc + nk]
    decision = Decision(
        tuple(ins[: nc + nk]) + tuple(stacked(s) for s in ins[nc + nk :]),
        tuple(carry) + tuple(stacked(s) for s in ys),
        bodies=((loop.body, tuple(carry) + tuple(ys)),),
    )
    return eqn.replace(params={**eqn.params, loop.body: rebody(eqn.params[loop.body], body), DECISION: decision})


def _laid_out(jaxpr, laid, loops: bool, out: dict) -> dict:
    """Control flow the solver leaves to greedy, anywhere in ``jaxpr`` outside the bodies of
    those it solves -> the equation as greedy laid it out (``laid``: greedy's annotation of
    ``jaxpr``): while, cond, attention of an explicit context; loops, calls and rules with their
    own ``solve`` hook (a pipeline) too unless ``loops``."""
    for eqn, mine in zip(jaxpr.eqns, laid.eqns):
        if loops and solved_with_bodies(eqn):
            for name, body in subjaxprs(eqn.params):
                _laid_out(open_jaxpr(body), open_jaxpr(mine.params[name]), loops, out)
        elif lays_itself_out(eqn) or solved_with_bodies(eqn):
            out[eqn] = mine
    return out


def _exposed(boxed: Program, jaxpr, laid_jaxpr, out: dict) -> dict:
    """Scan equations of ``jaxpr`` -> the share of their hideable conversions (a layer's weights
    gathered ahead, its gradient reduced behind the next layer: ``costs.hideable``) that
    their matmuls leave exposed in ``laid_jaxpr``, its annotation in ``boxed`` (greedy's boxed
    plan, or a solved one): the solver's price of such a conversion, as a share of its collectives' time (at
    least 1/20: a conversion is never free). Explain takes the min of the two; the integer program keeps
    its prices linear, with the share greedy's plan gives (a row bounding the hidden time by
    the compute made the LP relaxation fractional)."""
    from shardflow.primitives import box_p

    mine = [e for e in laid_jaxpr.eqns if e.primitive is not box_p]
    for eqn, laid in zip(jaxpr.eqns, mine):
        region = registry.region_of(eqn)
        if isinstance(region, Loop):
            comm, compute = hideable(boxed, laid)
            out[eqn] = max(1 / 20, 1 - compute / comm) if comm > 0 else 1 / 20
        if isinstance(region, (Loop, Call)):
            _exposed(boxed, open_jaxpr(eqn.params[region.body]), open_jaxpr(laid.params[region.body]), out)
    return out


class _Solution(NamedTuple):
    program: Program  # the solved program (propagate's ensures; boxing runs after)
    boxed: Program  # it boxed, for pricing
    seconds: float  # the integer program's optimum (modelled), or the best plan found
    bound: float  # a lower bound on the optimum (== seconds where proven)
    note: str  # what else the planner line says (sf.AUTO choices, loops laid out by greedy)
    plan: Modelled  # the modelled costs of ``boxed``, as explain's Plan reports them


def solved(
    program: Program,
    greedy: Program | None,
    exposed: dict | None,
    time_limit: float,
    prices: dict,
    warm: dict,
    built: dict,
    combined: dict | None = None,
) -> _Solution:
    """``choose``'s optimum, or raise Unsolvable. ``exposed``: the overlap shares the loops'
    hideable conversions are priced at; ``prices``: the conversions priced so far
    (``Propagation.seconds``'s memo), ``built``, the models built (``choose``), and ``warm``,
    the last LP relaxation solved (``highs.relaxation``): shared by the solves of one program. A
    loop's carries make the LP relaxation fractional at times and branch and bound slow: where the solve runs out of its
    limits, the loops are laid out as greedy laid them out and the rest solved, under the same
    limits again (where greedy ran: not with sf.AUTO inputs)."""
    attempts = (True,) if greedy is None else (True, False)
    for loops in attempts:
        given = None if greedy is None else _laid_out(program.jaxpr.jaxpr, greedy.jaxpr.jaxpr, loops, {})
        prop = Propagation(program, prices).seeded()  # conversions priced once for every solve
        try:
            eqns, auto, seconds, bound = choose(
                prop, program.jaxpr.jaxpr, program.out_sbp, time_limit, given, exposed, warm, built, combined
            )
            break
        except Unsolvable as e:
            if loops == attempts[-1] or isinstance(e, Infeasible):
                raise
    closed = program.jaxpr
    program = program.replace(in_sbp=tuple(auto.get(v, s) for v, s in zip(closed.jaxpr.invars, program.in_sbp)))
    fallbacks, sbp = list(prop.fallbacks), prop.sbp
    if given:  # the loops' bodies as greedy laid them out; every other value as solved
        sbp = {**greedy.sbp, **prop.sbp}
        fallbacks += [f for f in greedy.fallbacks if f not in fallbacks]
    jaxpr = closed.jaxpr.replace(eqns=eqns)
    out_sbp = tuple(s if s is not None else reduced(prop.of(v)) for v, s in zip(jaxpr.outvars, program.out_sbp))
    chose = f"; sf.AUTO chose {len(auto)} input layout{'s' * (len(auto) != 1)}" if auto else ""
    laid = f"; {len(given)} control-flow equation{'s' * (len(given) != 1)} laid out by greedy" if given else ""
    if not loops:
        laid += (
            ", the loops among them: solving them ran out of time, and the optimum leaves out their "
            "own work and collectives"
        )
    solved = program.replace(jaxpr=closed.replace(jaxpr=jaxpr), sbp=sbp, out_sbp=out_sbp, fallbacks=fallbacks)
    boxed = boxing(solved)
    return _Solution(solved, boxed, seconds, bound, chose + laid, modelled(boxed))


def loop_shares(boxed: Program, jaxpr) -> dict:
    return _exposed(boxed, jaxpr, boxed.jaxpr.jaxpr, {})
