"""Control flow and shardflow's own primitives, registered like any other primitive: pins
(sf.constrain, with_sharding_constraint), conversions (sf_box), scan, while, cond, remat and a
user's own shard_map. Each propagate rule annotates its bodies and returns the equation with its
Decision; each lower rule runs the equation on local blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, DropVar
from jax.extend.core import primitives as prims

from shardflow import _compat, conversion, costs
from shardflow.primitives import box_p, constrain_p
from shardflow.program import REMAT_PRIMITIVES, is_literal, open_jaxpr, scan_arity, source_line
from shardflow.registry import Decision, defrule
from shardflow.specs import B, ShardingError, Split, describe, format_sbp, to_sbp


def rebody(old, new_jaxpr):
    """``new_jaxpr`` in the form (closed or open) of the param it replaces."""
    return old.replace(jaxpr=new_jaxpr) if isinstance(old, ClosedJaxpr) else new_jaxpr


# ------------------------------------------------------------------------------ pins


def _pin_propagate(prop, eqn):
    x = eqn.invars[0]
    sbp = prop.pinned(eqn)
    if not is_literal(x):
        prev = prop.constrained.get(x)
        if prev is not None and prev[0] != sbp:
            raise ShardingError(
                f"conflicting constraints on {describe(x.aval)}: {format_sbp(prev[0])} at {prev[1]} and "
                f"{format_sbp(sbp)} at {source_line(eqn)}"
            )
        prop.constrained[x] = (sbp, source_line(eqn))
    return prop.decide(eqn, Decision((sbp,), (sbp,)))


def _sharding_constraint_spec(eqn):
    sharding = eqn.params["sharding"]
    spec = getattr(sharding, "spec", sharding)
    if eqn.params.get("unconstrained_dims"):
        raise ShardingError(
            f"with_sharding_constraint at {source_line(eqn)}: unconstrained dims "
            f"{sorted(eqn.params['unconstrained_dims'])} in {spec} are not supported; "
            "name the axes of every dim"
        )
    return spec


def _identity(local, eqn, ins):
    return ins[0]


defrule(constrain_p, propagate=_pin_propagate, pin=lambda eqn: eqn.params["spec"].spec, lower=_identity)
defrule(prims.sharding_constraint_p, propagate=_pin_propagate, pin=_sharding_constraint_spec, lower=_identity)


def _lower_box(local, eqn, ins):
    if 0 in ins[0].shape:  # an empty block: nothing to move (XLA refuses to all_gather a 0-size dim)
        return lax.reshape(ins[0], local.shape(eqn.outvars[0]))
    return conversion.run(eqn.params["steps"], ins[0], local.sizes)


defrule(box_p, lower=_lower_box)


# ------------------------------------------------------------------------------ scan


def unstacked(sbp):
    """The NdSbp of one slice of a value stacked on a new leading dim, or None."""
    if sbp is None or Split(0) in sbp:
        return None
    return tuple(Split(s.dim - 1) if isinstance(s, Split) else s for s in sbp)


def stacked(sbp):
    return tuple(Split(s.dim + 1) if isinstance(s, Split) else s for s in sbp)


def _propagate_scan(prop, eqn):
    nc, nk = scan_arity(eqn.params)
    closed = eqn.params["jaxpr"]
    body = open_jaxpr(closed)
    cur = [prop.of(a) for a in eqn.invars]
    consts, init, xs = cur[:nc], cur[nc : nc + nk], cur[nc + nk :]
    xs_outer = [tuple(B if s == Split(0) else s for s in x) for x in xs]
    xs_inner = [unstacked(x) for x in xs_outer]
    src = source_line(eqn)
    # What the scan's stacked outputs are wanted as, per iteration: a per-layer gradient that
    # must end up split is reduce-scattered inside the loop, not stacked whole and scattered after.
    ys_wanted = [unstacked(prop.demand.get(v)) for v in eqn.outvars[nk:]]
    prop.spread_demands(body, [None] * nk + ys_wanted)
    annotated = []

    def run(carry):
        new, outs = prop.run_body(body, consts + list(carry) + xs_inner, src)
        annotated.append(new)
        return outs[:nk]

    carry = prop.loop(run, init)
    ys = [want or prop.of(v) for v, want in zip(body.outvars[nk:], ys_wanted)]
    decision = Decision(
        tuple(consts + carry + xs_outer),
        tuple(carry) + tuple(stacked(s) for s in ys),
        bodies=(("jaxpr", tuple(carry) + tuple(ys_wanted)),),
    )
    return prop.decide(eqn, decision, src, jaxpr=rebody(closed, annotated[-1]))


UNROLLED_TRIPS = 128  # loops of at most this many trips (and ``_straight_line``) are lowered unrolled


class Slices(list):
    """A stacked output of a loop lowered unrolled: its blocks, one per trip, in index order.
    An unrolled loop takes them as its sliced input as they are; anything else reads them
    stacked (``Local.eval`` stacks them once, on first use)."""

    def stacked(self):
        return jnp.stack(self)


def _lower_scan(local, eqn, ins):
    """A layer loop — at most ``UNROLLED_TRIPS`` trips, not inside another loop, its body
    running no collective (``_straight_line``) — unrolled, its stacked
    outputs kept as one block per trip (``Slices``) that the next unrolled loop (the
    backward's) takes as they are. Rolled, a loop writes each trip's results into a stack and
    the next loop reads them back: XLA copies a slice in or out for every result a custom call
    (a matmul, an attention kernel) makes or takes, and a stack lives whole until the loop
    that reads it ends. On one H200 the 1b train step ran 658 such copies, 21 ms a step, and
    held 82.3 GB; unrolled, 54.1 GB and 12 % more tokens/s, compiled in the same time
    (benchmarks/results/scaling.md). Partial, and said so: not yet measured on
    several GPUs. Any other loop stays rolled: a ``fori_loop`` whose stacked outputs start as
    uninitialised buffers (``lax.empty``) and take one slice a trip; ``lax.scan`` starts them
    as zeros, which XLA materialises (48 GB of writes a step for the 1b step's residuals)."""
    p = eqn.params
    nc, nk = scan_arity(p)
    body = local.body_fn(p["jaxpr"])
    consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
    n = p["length"]
    if n == 0:  # no trips: the carries as they came, the stacked outputs empty
        return list(init) + [
            None if isinstance(v, DropVar) else jnp.zeros(local.shape(v), v.aval.dtype) for v in eqn.outvars[nk:]
        ]
    if n <= UNROLLED_TRIPS and local.loop is None and _straight_line(local.p, open_jaxpr(p["jaxpr"])):
        return _lower_unrolled(local, body, eqn, consts, init, xs)
    xs = [x.stacked() if isinstance(x, Slices) else x for x in xs]
    ys = [None if isinstance(v, DropVar) else lax.empty(local.shape(v), v.aval.dtype) for v in eqn.outvars[nk:]]
    assert all(y is None or y.shape[0] == n for y in ys), "a scan's stacked dim is never split (``stacked``)"

    def step(i, state):
        carry, ys = state
        k = n - 1 - i if p["reverse"] else i
        out = body(*consts, *carry, *(lax.dynamic_index_in_dim(x, k, keepdims=False) for x in xs))
        ys = [y if y is None else lax.dynamic_update_index_in_dim(y, o, k, 0) for y, o in zip(ys, out[nk:])]
        return list(out[:nk]), ys

    with local.looping():
        carry, ys = lax.fori_loop(0, n, step, (list(init), ys), unroll=p["unroll"])
    return list(carry) + list(ys)


def _straight_line(program, body) -> bool:
    """Whether a loop with this body may be lowered unrolled: it runs no collective. Unrolled,
    XLA merges a collective the backward repeats of its forward (a ring's K and V gathered
    again: half the bytes explain lists ran, tests/test_ring_attention.py) and holds its result
    from the forward to the backward. (A remat's recomputation would be merged so too — jax
    puts no optimization barrier on a remat inside a scan, ``prevent_cse=False`` there — but
    in an unrolled body ``_lower_remat`` bars every recomputation's operands.)"""
    return not costs.collectives(program, body)


def _lower_unrolled(local, body, eqn, consts, init, xs):
    p = eqn.params
    nk, n = len(init), p["length"]
    carry, ys = list(init), [{} for _ in eqn.outvars[nk:]]
    with local.looping("unrolled"):
        for i in range(n):
            k = n - 1 - i if p["reverse"] else i
            out = body(
                *consts,
                *carry,
                *(x[k] if isinstance(x, Slices) else lax.index_in_dim(x, k, keepdims=False) for x in xs),
            )
            carry = list(out[:nk])
            for y, o in zip(ys, out[nk:]):
                y[k] = o
    return carry + [Slices(y[k] for k in range(n)) for y in ys]


defrule(lax.scan_p, propagate=_propagate_scan, lower=_lower_scan, trips=lambda eqn, body, mesh: eqn.params["length"])


# ------------------------------------------------------------------------------ while


def _propagate_while(prop, eqn):
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond_closed, body_closed = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
    cond, body = open_jaxpr(cond_closed), open_jaxpr(body_closed)
    cur = [prop.of(a) for a in eqn.invars]
    cconsts, bconsts, init = cur[:cn], cur[cn : cn + bn], cur[cn + bn :]
    src = source_line(eqn)
    annotated = []

    def run(carry):
        new_cond, _ = prop.run_body(cond, cconsts + list(carry), src)
        new_body, outs = prop.run_body(body, bconsts + list(carry), src)
        annotated.append((new_cond, new_body))
        return outs

    carry = prop.loop(run, init)
    new_cond, new_body = annotated[-1]
    decision = Decision(
        tuple(cconsts + bconsts + carry),
        tuple(carry),
        bodies=(("cond_jaxpr", (prop.whole,)), ("body_jaxpr", tuple(carry))),
    )
    return prop.decide(
        eqn, decision, src, cond_jaxpr=rebody(cond_closed, new_cond), body_jaxpr=rebody(body_closed, new_body)
    )


def _lower_while(local, eqn, ins):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond, body = local.body_fn(p["cond_jaxpr"]), local.body_fn(p["body_jaxpr"])
    cconsts, bconsts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
    with local.looping():
        return lax.while_loop(lambda c: cond(*cconsts, *c)[0], lambda c: body(*bconsts, *c), list(init))


defrule(lax.while_p, propagate=_propagate_while, lower=_lower_while)


# ------------------------------------------------------------------------------ cond


def _propagate_cond(prop, eqn):
    cur = [prop.of(a) for a in eqn.invars]
    src = source_line(eqn)
    outs, branches = None, []
    for closed in eqn.params["branches"]:
        new, produced = prop.run_body(open_jaxpr(closed), cur[1:], src)
        outs = outs or produced
        branches.append(rebody(closed, new))
    decision = Decision((prop.whole,) + tuple(cur[1:]), tuple(outs), bodies=(("branches", tuple(outs)),))
    return prop.decide(eqn, decision, src, branches=tuple(branches))


def _lower_cond(local, eqn, ins):
    return lax.switch(ins[0], [local.body_fn(b) for b in eqn.params["branches"]], *ins[1:])


defrule(lax.cond_p, propagate=_propagate_cond, lower=_lower_cond)


# ------------------------------------------------------------------------------ remat


def _propagate_remat(prop, eqn):
    """remat / checkpoint: the body runs on the operands as they are."""
    cur = [prop.of(a) for a in eqn.invars]
    new, outs = prop.run_body(open_jaxpr(eqn.params["jaxpr"]), cur, source_line(eqn))
    return prop.decide(eqn, Decision(tuple(cur), tuple(outs), bodies=(("jaxpr", None),)), jaxpr=new)


def _lower_remat(local, eqn, ins):
    """A backward's recomputation (``differentiated``) takes the operands the user asked for
    (``prevent_cse``) through an optimization barrier, as jax's own lowering does: else XLA
    merges it with the forward it repeats and the remat saves nothing. (Re-binding the body as
    ``jax.checkpoint`` did not: a new remat is not ``differentiated``, and jax lowers it bare.)
    In a loop lowered unrolled every operand is barred: the loop no longer keeps its trips
    apart, so ``prevent_cse=False``, as a remat in a scan is written, no longer holds. (A
    layer loop's backward trip is one such remat, the cotangent handed down among its
    operands: barred with them, its recomputation waits for the layer above's backward.) A
    forward's remat is re-bound so, for whoever differentiates the lowered program."""
    p = eqn.params
    body = local.body_fn(open_jaxpr(p["jaxpr"]))
    if not p["differentiated"]:  # a forward: still a remat for whoever differentiates the program
        return jax.checkpoint(lambda *a: body(*a), prevent_cse=p["prevent_cse"], policy=p["policy"])(*ins)
    guarded = p["prevent_cse"] if isinstance(p["prevent_cse"], tuple) else (p["prevent_cse"],) * len(ins)
    if local.loop == "unrolled":
        guarded = (True,) * len(ins)
    if any(guarded):
        barred = iter(lax.optimization_barrier([x for x, g in zip(ins, guarded) if g]))
        ins = [next(barred) if g else x for x, g in zip(ins, guarded)]
    return body(*ins)


defrule(*REMAT_PRIMITIVES, propagate=_propagate_remat, lower=_lower_remat)


# ------------------------------------------------------------------------------ a user's shard_map


def _shard_map_sbp(prop, eqn, specs, avals, what):
    """The NdSbp of a user shard_map's in/out specs on shardflow's mesh; axes the shard_map does
    not make manual see whole values (B)."""
    mesh = eqn.params["mesh"]
    src = source_line(eqn)
    if dict(zip(mesh.axis_names, mesh.axis_sizes)) != dict(zip(prop.names, prop.mesh.axis_sizes)):
        raise ShardingError(
            f"jax.shard_map at {src} runs on mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))}, "
            f"the parallelized function on {dict(zip(prop.names, prop.mesh.axis_sizes))}; "
            "use the same mesh"
        )
    return [
        to_sbp(spec, prop.mesh, len(aval.shape), what=f"{what} {i} {describe(aval)} of jax.shard_map at {src}")
        for i, (spec, aval) in enumerate(zip(specs, avals))
    ]


def _propagate_shard_map(prop, eqn):
    """A user's own shard_map is a region of manual code: its operands are converted to its
    in_specs, its results have its out_specs, and its body (local blocks and the user's own
    collectives) runs as written."""
    ins = _shard_map_sbp(prop, eqn, eqn.params["in_specs"], [x.aval for x in eqn.invars], "operand")
    outs = _shard_map_sbp(prop, eqn, eqn.params["out_specs"], [v.aval for v in eqn.outvars], "result")
    return prop.decide(eqn, Decision(tuple(ins), tuple(outs)))


# shard_map's bodies are traced with varying-axis types (check_vma); shardflow's own shard_map
# runs unchecked, where the casts are the identity and psum_invariant is a plain psum.
_UNCHECKED = {"pvary": lambda ins, axes: ins, "psum_invariant": lambda ins, axes: [lax.psum(x, axes) for x in ins]}


def _lower_shard_map(local, eqn, ins):
    body = open_jaxpr(eqn.params["jaxpr"])
    consts = eqn.params["jaxpr"].consts if isinstance(eqn.params["jaxpr"], ClosedJaxpr) else ()
    env = dict(zip(body.constvars, consts))
    env.update(zip(body.invars, ins))
    read = lambda a: a.val if is_literal(a) else env[a]  # noqa: E731
    for e in body.eqns:
        args = [read(a) for a in e.invars]
        if e.primitive.name in _UNCHECKED:
            outs = _UNCHECKED[e.primitive.name](args, e.params["axes"])
        else:
            outs = e.primitive.bind(*args, **e.params)
            outs = outs if e.primitive.multiple_results else [outs]
        env.update(zip(e.outvars, outs))
    return [read(a) for a in body.outvars]


defrule(_compat.shard_map_primitive(), propagate=_propagate_shard_map, lower=_lower_shard_map)
