"""assemble: the integer program solved (``choose``) and its choices made the program's
equations and layouts; one solve of a program (``solved``), its loops laid out by greedy where
solving them runs out of limits, and the overlap shares its plan leaves the loops."""

from __future__ import annotations

from typing import NamedTuple

from jax import lax

from shardflow import registry
from shardflow.costs import Modelled, hideable, modelled
from shardflow.passes.boxing import boxing
from shardflow.passes.propagate import Propagation, reduced
from shardflow.passes.solve.agreement import process_0s
from shardflow.passes.solve.build import Pipeline, Region, build, lays_itself_out, solvable_region
from shardflow.passes.solve.highs import TIME_LIMIT
from shardflow.passes.solve.model import Infeasible, Unsolvable
from shardflow.pipelining import Bodies, pipeline_p
from shardflow.program import REMAT_PRIMITIVES, Program, open_jaxpr, scan_arity, source_line
from shardflow.registry import DECISION, Decision
from shardflow.rules.control import rebody, stacked


def choose(
    prop: Propagation,
    jaxpr,
    out_sbp,
    time_limit: float | None = None,
    given: dict | None = None,
    exposed: dict | None = None,
    warm: dict | None = None,
    built: dict | None = None,
):
    """(the equations of ``jaxpr`` with their Decisions — bodies of solved scans and remats
    annotated too, every value's NdSbp set on ``prop`` —, {sf.AUTO input: its NdSbp}, the
    modelled seconds, a lower bound on the optimum's) of the plan ``Model.solve`` found;
    raises Unsolvable. ``exposed``: the loops' overlap shares; ``warm``: see ``highs.relaxation``;
    ``built``: a dict keeping the model built for ``given``'s equations, for the next solve of
    the same program (only the shares differ)."""
    key = frozenset(given or ())
    if built is not None and key in built:
        model, entries, auto, fallbacks = built[key]
        prop.fallbacks[:] = fallbacks
    else:
        model, entries, auto = build(prop, jaxpr, out_sbp, given)
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
        if isinstance(entry, Region):
            eqn = _assemble_region(prop, entry, pick, given)
        elif isinstance(entry, Pipeline):
            eqn = _assemble_pipeline(prop, entry, pick, given)
        else:
            eqn, options, cols = entry
            decision = pick(options, cols)[0]
            eqn = given[eqn] if eqn in given else eqn.replace(params={**eqn.params, DECISION: decision})
        for v, s in zip(eqn.outvars, registry.decision_of(eqn).outs):
            prop.set(v, s, source_line(eqn))
        eqns.append(eqn)
    return eqns


def _assemble_region(prop: Propagation, region: Region, pick, given):
    eqn = region.eqn
    body = open_jaxpr(eqn.params["jaxpr"])
    for v in body.constvars:
        prop.set(v, prop.whole)
    if eqn.primitive in REMAT_PRIMITIVES:
        ins = tuple(prop.of(x) for x in eqn.invars)
        for v, s in zip(body.invars, ins):
            prop.set(v, s)
        body = body.replace(eqns=_assemble(prop, region.body, pick, given))
        decision = Decision(ins, tuple(prop.of(v) for v in body.outvars), bodies=(("jaxpr", None),))
    else:
        nc, nk = scan_arity(eqn.params)
        ins = [pick(*choice) for choice in region.ins]
        for v, s in zip(body.invars, ins):
            prop.set(v, s)
        body = body.replace(eqns=_assemble(prop, region.body, pick, given))
        ys = [pick(*choice) for choice in region.ys]
        carry = ins[nc : nc + nk]
        decision = Decision(
            tuple(ins[: nc + nk]) + tuple(stacked(s) for s in ins[nc + nk :]),
            tuple(carry) + tuple(stacked(s) for s in ys),
            bodies=(("jaxpr", tuple(carry) + tuple(ys)),),
        )
    return eqn.replace(params={**eqn.params, "jaxpr": rebody(eqn.params["jaxpr"], body), DECISION: decision})


def _assemble_pipeline(prop: Propagation, region: Pipeline, pick, given):
    eqn, params = region.eqn, region.eqn.params
    new = {}
    for name, entries in region.bodies.items():
        body = open_jaxpr(params[name])
        for v in body.constvars:
            prop.set(v, prop.whole)
        for v, choice in zip(body.invars, region.body_ins[name]):
            prop.set(v, pick(*choice))
        new[name] = rebody(params[name], body.replace(eqns=_assemble(prop, entries, pick, given)))
    wanted = tuple((name, tuple(pick(*c) for c in region.body_outs[name])) for name in Bodies._fields)
    decision = Decision(tuple(pick(*c) for c in region.ins), tuple(pick(*c) for c in region.outs), bodies=wanted)
    return eqn.replace(params={**params, **new, DECISION: decision})


def _laid_out(jaxpr, laid, loops: bool, out: dict) -> dict:
    """Control flow the solver leaves to greedy, anywhere in ``jaxpr`` outside the bodies of
    those it solves -> the equation as greedy laid it out (``laid``: greedy's annotation of
    ``jaxpr``): while, cond, a pipeline, attention of an explicit context; scans and remats
    too unless ``loops``."""
    for eqn, mine in zip(jaxpr.eqns, laid.eqns):
        if loops and solvable_region(eqn):
            _laid_out(open_jaxpr(eqn.params["jaxpr"]), open_jaxpr(mine.params["jaxpr"]), loops, out)
        elif loops and eqn.primitive is pipeline_p:
            for name in Bodies._fields:
                _laid_out(open_jaxpr(eqn.params[name]), open_jaxpr(mine.params[name]), loops, out)
        elif lays_itself_out(eqn):
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
        if eqn.primitive is lax.scan_p:
            comm, compute = hideable(boxed, laid)
            out[eqn] = max(1 / 20, 1 - compute / comm) if comm > 0 else 1 / 20
        if solvable_region(eqn):
            _exposed(boxed, open_jaxpr(eqn.params["jaxpr"]), open_jaxpr(laid.params["jaxpr"]), out)
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
                prop, program.jaxpr.jaxpr, program.out_sbp, time_limit, given, exposed, warm, built
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
