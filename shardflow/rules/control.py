"""Control flow and shardflow's own primitives, registered like any other primitive: pins
(sf.constrain, with_sharding_constraint), conversions (sf_box), scan, while, cond, remat and a
user's own shard_map. Each propagate rule annotates its bodies and returns the equation with its
Decision; each lower rule runs the equation on local blocks."""

from __future__ import annotations

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr
from jax.extend.core import primitives as prims

from shardflow import _compat, conversion
from shardflow.primitives import box_p, constrain_p
from shardflow.program import REMAT_PRIMITIVES, is_literal, open_jaxpr, rebody, scan_arity, source_line
from shardflow.registry import Call, Decision, Loop, defrule
from shardflow.specs import ShardingError, describe, format_sbp, to_sbp

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


def _scan_region(eqn) -> Loop:
    consts, carries = scan_arity(eqn.params)
    p = eqn.params
    return Loop(consts, carries, p["length"], reverse=p["reverse"], unroll=p["unroll"])


defrule(lax.scan_p, region=_scan_region)


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


defrule(*REMAT_PRIMITIVES, region=lambda eqn: Call(), lower=_lower_remat)


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
_UNCHECKED = {
    _compat.pvary_p: lambda ins, axes: ins,
    _compat.psum_invariant_p: lambda ins, axes: [lax.psum(x, axes) for x in ins],
}
_UNCHECKED.pop(None, None)  # a JAX without one of them


def _lower_shard_map(local, eqn, ins):
    body = open_jaxpr(eqn.params["jaxpr"])
    consts = eqn.params["jaxpr"].consts if isinstance(eqn.params["jaxpr"], ClosedJaxpr) else ()
    env = dict(zip(body.constvars, consts))
    env.update(zip(body.invars, ins))
    read = lambda a: a.val if is_literal(a) else env[a]  # noqa: E731
    for e in body.eqns:
        args = [read(a) for a in e.invars]
        if e.primitive in _UNCHECKED:
            outs = _UNCHECKED[e.primitive](args, e.params["axes"])
        else:
            outs = e.primitive.bind(*args, **e.params)
            outs = outs if e.primitive.multiple_results else [outs]
        env.update(zip(e.outvars, outs))
    return [read(a) for a in body.outvars]


defrule(_compat.shard_map_primitive(), propagate=_propagate_shard_map, lower=_lower_shard_map)
