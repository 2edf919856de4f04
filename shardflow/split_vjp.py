"""Split a backward pass into the input gradient (B) and the weight gradient (W).

The zero-bubble schedules (Qi et al., 2023) run a layer's backward as two actions: B, the
gradient with respect to the layer's input, which the previous stage waits for, and W, the
gradient with respect to its weights, which nothing waits for and which fills the bubbles. Each
must cost only its own work: a W that recomputed the input-gradient chain down to each weight
would cost a whole backward, and in a lockstep pipeline every tick then lasts that long.

``split_vjp`` cuts a backward jaxpr so that no equation runs twice. B runs every equation an
input gradient depends on and also returns the *stash*: the values it made that W reads (for a
matmul ``y = x @ w``, the cotangent of ``y``). W runs the rest from the shared inputs (the
weights and the forward's residuals) and the stash. A scan — a stack of layers' backward — is
itself cut into two scans, W's reading B's per-iteration values as stacked ``xs``; a scan's
carry belongs to B when anything B needs depends on it. A ``cond`` (``lax.cond`` / ``switch``:
an uneven stage skips its padding layers with one, so a padded stage's backward is a scan over
layers of a cond holding a layer's backward) is cut into two conds of the same branch index, each
branch cut on its own: B's cond returns every branch's stash in one list of slots (a branch
fills the slots it does not use with zeros), W's reads it. Calls (``jit``) and rematerialised
regions (``checkpoint``: a remat layer's backward is one, recomputing the forward inside) are
inlined first, so that they are cut too; any other equation goes whole to B when B needs one of
its results (W then reads the others from the stash), else whole to W.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Var, new_jaxpr_eqn, no_effects, primitives

from shardflow._compat import scan_params
from shardflow.passes.inline import CALLS, flatten
from shardflow.program import REMAT_PRIMITIVES, scan_arity

scan_p = primitives.scan_p
cond_p = primitives.cond_p


class SplitVjp(NamedTuple):
    """b(*inputs) -> (*input gradients, *stash); w(*shared inputs, *stash) -> weight gradients."""

    b: ClosedJaxpr
    w: ClosedJaxpr
    n_stash: int


def split_vjp(backward: ClosedJaxpr, *, shared: int, weights: int) -> SplitVjp:
    """Cut ``backward(*inputs) -> (*weight gradients, *input gradients)``: its first
    ``weights`` results are W's, the rest B's; its first ``shared`` inputs are W's to read too
    (the others, e.g. the output cotangent, reach W only through the stash)."""
    # calls and remat regions inlined, nested bodies too, so that the cut separates them: the
    # recomputation a remat region holds stays where B needs it (no value is computed twice
    # within a backward; only its grouping is lost)
    flat, hoisted = flatten(backward.jaxpr, CALLS | set(REMAT_PRIMITIVES))
    jaxpr = flat.replace(constvars=[*flat.constvars, *(v for v, _ in hoisted)])
    consts = [*backward.consts, *(c for _, c in hoisted)]
    roles = ["w"] * weights + ["b"] * (len(jaxpr.outvars) - weights)
    available = set(jaxpr.constvars) | set(jaxpr.invars[:shared])
    b_eqns, w_eqns, stash = _partition(jaxpr.eqns, jaxpr.outvars, roles, available)
    b = _like(jaxpr, jaxpr.invars, jaxpr.outvars[weights:] + stash, b_eqns)
    w = _like(jaxpr, jaxpr.invars[:shared] + stash, jaxpr.outvars[:weights], w_eqns)
    return SplitVjp(ClosedJaxpr(b, consts), ClosedJaxpr(w, consts), len(stash))


def _like(jaxpr: Jaxpr, invars, outvars, eqns) -> Jaxpr:
    """A jaxpr with ``jaxpr``'s constants and provenance, of these inputs, results and equations."""
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else no_effects
    return Jaxpr(jaxpr.constvars, invars, outvars, eqns, effects, jaxpr.debug_info.with_unknown_names())


def _vars(atoms):
    return [a for a in atoms if isinstance(a, Var)]


def _partition(eqns, outvars, roles, available):
    """(B's equations, W's equations, the stash) for results tagged "b" / "w" / None (unused).
    ``available``: the variables W reads without the stash."""
    b_need = set(v for v, r in zip(_vars(outvars), roles) if r == "b")
    w_need = set(v for v, r in zip(outvars, roles) if r == "w" and isinstance(v, Var))
    b_eqns, w_eqns = [], []
    for e in reversed(eqns):
        in_b = [o in b_need for o in e.outvars]
        in_w = [o in w_need and not b for o, b in zip(e.outvars, in_b)]
        if not any(in_b) and not any(in_w):
            continue
        if any(in_b) and any(in_w) and e.primitive in (scan_p, cond_p):
            eb, ew = (_split_scan if e.primitive is scan_p else _split_cond)(e, in_b, in_w)
        else:
            eb, ew = (e, None) if any(in_b) else (None, e)
        if eb is not None:
            b_eqns.append(eb)
            b_need.update(_vars(eb.invars))
        if ew is not None:
            w_eqns.append(ew)
            w_need.update(_vars(ew.invars))
    b_eqns.reverse()
    w_eqns.reverse()
    made_by_w = {o for e in w_eqns for o in e.outvars}
    stash, seen = [], set()
    for v in [a for e in w_eqns for a in _vars(e.invars)] + [v for v, r in zip(outvars, roles) if r == "w"]:
        if isinstance(v, Var) and v not in made_by_w and v not in available and v not in seen:
            seen.add(v)
            stash.append(v)
    return b_eqns, w_eqns, stash


def _needed_carries(body: Jaxpr, n_consts, n_carry, b_out):
    """The body's results B needs: ``b_out`` closed under the carries those depend on."""
    b_out = list(b_out)
    carry_in = body.invars[n_consts : n_consts + n_carry]
    while True:
        need = set(v for v, b in zip(_vars(body.outvars), b_out) if b)
        for e in reversed(body.eqns):
            if any(o in need for o in e.outvars):
                need.update(_vars(e.invars))
        grown = [b or v in need for b, v in zip(b_out[:n_carry], carry_in)] + b_out[n_carry:]
        if grown == b_out:
            return b_out
        b_out = grown


def _split_scan(e, in_b, in_w):
    """A scan cut into B's scan (its results B needs, plus per-iteration stash as extra ys)
    and W's scan (the rest, reading the stash as extra xs); (B's, None) when W has nothing."""
    closed: ClosedJaxpr = e.params["jaxpr"]
    body = closed.jaxpr
    n_consts, n_carry = scan_arity(e.params)
    length = e.params["length"]
    b_out = _needed_carries(body, n_consts, n_carry, in_b)
    carry_b = b_out[:n_carry]
    roles = ["b" if b else "w" if (i < n_carry or in_w[i]) else None for i, b in enumerate(b_out)]
    if "w" not in roles:
        return e, None
    consts = body.invars[:n_consts]
    carries = body.invars[n_consts : n_consts + n_carry]
    xs = body.invars[n_consts + n_carry :]
    w_carries = [c for c, b in zip(carries, carry_b) if not b]
    available = set(body.constvars) | set(consts) | set(xs) | set(w_carries)
    b_eqns, w_eqns, stash = _partition(body.eqns, body.outvars, roles, available)

    def reads(eqns, outs):
        return set(_vars(a for q in eqns for a in q.invars)) | set(_vars(outs))

    def pick(inner, outer, used):  # the (inner, outer) operands one side reads
        kept = [(i, o) for i, o in zip(inner, outer) if i in used]
        return [i for i, _ in kept], [o for _, o in kept]

    outer_consts = e.invars[:n_consts]
    outer_carries = e.invars[n_consts : n_consts + n_carry]
    outer_xs = e.invars[n_consts + n_carry :]
    outs_carry, outs_ys = e.outvars[:n_carry], e.outvars[n_carry:]
    body_carry_out, body_ys = body.outvars[:n_carry], body.outvars[n_carry:]
    ys_roles = roles[n_carry:]

    # B's scan: its carries, the ys B needs, and the stash stacked over iterations.
    b_body_outs = (
        [v for v, b in zip(body_carry_out, carry_b) if b] + [v for v, r in zip(body_ys, ys_roles) if r == "b"] + stash
    )
    b_used = reads(b_eqns, b_body_outs)
    b_consts, b_outer_consts = pick(consts, outer_consts, b_used)
    b_xs, b_outer_xs = pick(xs, outer_xs, b_used)
    b_carries = [c for c, b in zip(carries, carry_b) if b]
    stacked = [Var(v.aval.update(shape=(length,) + v.aval.shape)) for v in stash]
    b_body = _like(body, b_consts + b_carries + b_xs, b_body_outs, b_eqns)
    eb = new_jaxpr_eqn(
        b_outer_consts + [o for o, b in zip(outer_carries, carry_b) if b] + b_outer_xs,
        [o for o, b in zip(outs_carry, carry_b) if b] + [o for o, r in zip(outs_ys, ys_roles) if r == "b"] + stacked,
        scan_p,
        scan_params(
            e.params,
            ClosedJaxpr(b_body, closed.consts),
            consts=len(b_consts),
            carries=len(b_carries),
            xs=len(b_xs),
            ys=len(b_body_outs) - len(b_carries),
        ),
        e.effects,
        e.source_info,
    )

    # W's scan: the other carries and the ys W needs, from the stash as extra xs.
    w_body_outs = [v for v, b in zip(body_carry_out, carry_b) if not b] + [
        v for v, r in zip(body_ys, ys_roles) if r == "w"
    ]
    w_used = reads(w_eqns, w_body_outs)
    w_consts, w_outer_consts = pick(consts, outer_consts, w_used)
    w_xs, w_outer_xs = pick(xs, outer_xs, w_used)
    w_body = _like(body, w_consts + w_carries + w_xs + stash, w_body_outs, w_eqns)
    ew = new_jaxpr_eqn(
        w_outer_consts + [o for o, b in zip(outer_carries, carry_b) if not b] + w_outer_xs + stacked,
        [o for o, b in zip(outs_carry, carry_b) if not b] + [o for o, r in zip(outs_ys, ys_roles) if r == "w"],
        scan_p,
        scan_params(
            e.params,
            ClosedJaxpr(w_body, closed.consts),
            consts=len(w_consts),
            carries=len(w_carries),
            xs=len(w_xs) + len(stash),
            ys=len(w_body_outs) - len(w_carries),
        ),
        e.effects,
        e.source_info,
    )
    return eb, ew


def _split_cond(e, in_b, in_w):
    """A cond cut into B's cond (its results B needs, plus the stash slots of all branches) and
    W's cond (the rest, from the operands it reads and the slots), both of the same branch
    index; (B's, None) when no branch has W work, or the cond has effects (they would run twice)."""
    index, *operands = e.invars
    roles = ["b" if b else "w" if w else None for b, w in zip(in_b, in_w)]
    branches = [c.jaxpr for c in e.params["branches"]]
    cuts = [_partition(br.eqns, br.outvars, roles, set(br.constvars) | set(br.invars)) for br in branches]
    if e.effects or not any(w_eqns for _, w_eqns, _ in cuts):
        return e, None
    b_outs = [[v for v, r in zip(br.outvars, roles) if r == "b"] for br in branches]
    w_outs = [[v for v, r in zip(br.outvars, roles) if r == "w"] for br in branches]
    b_pos = _operands_read(branches, [b for b, _, _ in cuts], b_outs)
    w_pos = _operands_read(branches, [w for _, w, _ in cuts], w_outs)
    slots, places = _stash_slots([stash for _, _, stash in cuts])

    b_branches, w_branches = [], []
    for br, closed, (b_eqns, w_eqns, stash), place, bo, wo in zip(
        branches, e.params["branches"], cuts, places, b_outs, w_outs
    ):
        own = dict(zip(place, stash))
        zeros, zero_eqns = _zeros([a for i, a in enumerate(slots) if i not in own])
        zeros = iter(zeros)
        b_slots = [own[i] if i in own else next(zeros) for i in range(len(slots))]
        w_slots = [own[i] if i in own else Var(a) for i, a in enumerate(slots)]  # others' slots: unread
        b = _like(br, [br.invars[j] for j in b_pos], bo + b_slots, b_eqns + zero_eqns)
        w = _like(br, [br.invars[j] for j in w_pos] + w_slots, wo, w_eqns)
        b_branches.append(ClosedJaxpr(b, closed.consts))
        w_branches.append(ClosedJaxpr(w, closed.consts))

    stash = [Var(a) for a in slots]
    eb = new_jaxpr_eqn(
        [index] + [operands[j] for j in b_pos],
        [o for o, r in zip(e.outvars, roles) if r == "b"] + stash,
        cond_p,
        dict(e.params, branches=tuple(b_branches)),
        e.effects,
        e.source_info,
    )
    ew = new_jaxpr_eqn(
        [index] + [operands[j] for j in w_pos] + stash,
        [o for o, r in zip(e.outvars, roles) if r == "w"],
        cond_p,
        dict(e.params, branches=tuple(w_branches)),
        e.effects,
        e.source_info,
    )
    return eb, ew


def _operands_read(branches, eqns, outs):
    """The positions of the cond operands that some branch's ``eqns`` or results ``outs`` read."""
    used = set().union(*(_vars([a for q in es for a in q.invars] + o) for es, o in zip(eqns, outs)))
    return [j for j in range(len(branches[0].invars)) if any(br.invars[j] in used for br in branches)]


def _stash_slots(stashes):
    """(the avals of the slots holding every branch's stash, each branch's slot of each of its
    stash values): a value takes a slot of its aval that its branch has not taken, so that
    branches share slots."""
    slots, places = [], []
    for stash in stashes:
        place = []
        for v in stash:
            i = next((i for i, a in enumerate(slots) if a == v.aval and i not in place), len(slots))
            if i == len(slots):
                slots.append(v.aval)
            place.append(i)
        places.append(place)
    return slots, places


def _zeros(avals):
    """(zeros of ``avals``, the equations making them: broadcasts of a literal 0)."""
    traced = jax.make_jaxpr(lambda: [jnp.zeros(a.shape, a.dtype) for a in avals])()
    return traced.jaxpr.outvars, traced.jaxpr.eqns
