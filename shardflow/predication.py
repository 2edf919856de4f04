"""`predicated`: rows of weight zero skipped by the devices that hold only such rows.

An SPMD program runs the same code on every device; a heterogeneous cluster wants a slower data
replica to do less of it (fewer micro-batches). ``predicated(fn, weights, *args)`` is
``fn(*args)`` with each output's row i scaled by ``weights[i]``; where the rows are split over
a mesh axis, a device whose rows all weigh zero does not run ``fn`` at all (a conditional on
its own block: predication) and gives zeros, which is what running it would have given. So
padding micro-batches cost a device nothing, and the result equals the unpadded computation.

``fn`` must compute each output row from the same rows of the inputs (a model's per-sequence
loss, not a batch norm). Where its planned body moves data over the axes that split the rows
(FSDP's weight gathers; a plan that reduces gradients inside it), a device that skipped would
leave the others waiting in the collective: every device then runs it (exact, without the
saving) and a PredicationWarning names the line. The weights are not differentiated; the backward recomputes ``fn``'s
forward on the devices that run it (as full rematerialisation does) and skips it on the same
devices as the forward.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import mlir

from shardflow.costs import collectives
from shardflow.program import open_jaxpr, source_line
from shardflow.registry import Call, defrule
from shardflow.specs import Partial, ShardingError, Split, split_axes


class PredicationWarning(UserWarning):
    """A predicated body every device must run (it moves data over the axes splitting its rows)."""


predicated_p = Primitive("sf_predicated")
predicated_p.multiple_results = True
predicated_p.def_impl(lambda *ops, jaxpr: jaxpr_as_fun(jaxpr)(*ops))
predicated_p.def_abstract_eval(lambda *avals, jaxpr: jaxpr.out_avals)
mlir.register_lowering(predicated_p, mlir.lower_fun(lambda *ops, jaxpr: jaxpr_as_fun(jaxpr)(*ops), True))


def _bind(body, weights, *operands) -> list:
    """``body(weights, *operands)`` (flat lists in and out) as one sf_predicated equation."""
    closed = jax.make_jaxpr(body)(weights, *operands)
    return predicated_p.bind(weights, *operands, jaxpr=closed)


def _rows(w, like):
    return w.reshape(w.shape + (1,) * (like.ndim - 1)).astype(like.dtype)


def predicated(fn, weights, *args):
    """``fn(*args)`` with every output's row i scaled by ``weights[i]`` (outputs: float arrays
    whose dim 0 is the rows); a device whose rows all weigh zero skips ``fn`` (see the module)."""
    leaves, tree = jax.tree.flatten(args)
    outs = jax.eval_shape(fn, *args)
    out_tree = jax.tree.structure(outs)
    rows = weights.shape[0]
    for out in jax.tree.leaves(outs):
        if not out.shape or out.shape[0] != rows or not jnp.issubdtype(out.dtype, jnp.floating):
            raise ValueError(
                f"predicated: each output of fn must be a float array of the {rows} rows the weights weigh; "
                f"got {out.dtype}{list(out.shape)}"
            )

    def scaled(w, *leaves):
        out = jax.tree.leaves(fn(*jax.tree.unflatten(tree, leaves)))
        return [o * _rows(w, o) for o in out]

    @jax.custom_vjp
    def run(w, *leaves):
        return _bind(scaled, w, *leaves)

    def run_fwd(w, *leaves):
        return run(w, *leaves), (w, leaves)

    def run_bwd(residuals, cotangents):
        w, leaves = residuals
        n = len(leaves)

        def pullback(w, *leaves_and_cotangents):
            primals, cts = leaves_and_cotangents[:n], leaves_and_cotangents[n:]
            return list(jax.vjp(lambda *p: scaled(w, *p), *primals)[1](list(cts)))

        return (jnp.zeros_like(w), *_bind(pullback, w, *leaves, *cotangents))

    run.defvjp(run_fwd, run_bwd)
    return jax.tree.unflatten(out_tree, run(lax.stop_gradient(weights), *leaves))


# ------------------------------------------------------------------------------ the rule
#
# The body is planned as any call's (a region: its operands' layouts flow into it); lowering
# wraps each device's block of it in a conditional on that device's weights.


def _lower(local, eqn, ins):
    w_sbp = local.sbp(eqn.invars[0])
    if any(isinstance(s, Partial) for s in w_sbp):
        raise ShardingError(
            f"{source_line(eqn)}: predicated: the weights are partial sums {w_sbp}; they must be values"
        )
    if any(isinstance(s, Split) and s.dim != 0 for s in w_sbp):
        raise ShardingError(f"{source_line(eqn)}: predicated: the weights are split along other dims than the rows")
    rows = set(split_axes(w_sbp, 0, local.names))
    crossing = rows & {a for c in collectives(local.p, open_jaxpr(eqn.params["jaxpr"])) for a in c.axes}
    run = local.body_fn(eqn.params["jaxpr"])
    if crossing:  # every device runs it: exact, without the saving
        warnings.warn(
            f"{source_line(eqn)}: predicated: its body moves data over mesh axes {sorted(crossing)}, which split "
            "its rows, so no device skips its padding rows (one that did would leave the others waiting in that "
            "collective); keep what the body reads whole over those axes (data parallelism, not FSDP)",
            PredicationWarning,
            stacklevel=2,
        )
        return list(run(*ins))
    zeros = [jnp.zeros(local.shape(v), v.aval.dtype) for v in eqn.outvars]
    return lax.cond(jnp.any(ins[0] != 0), lambda: list(run(*ins)), lambda: zeros)


defrule(predicated_p, region=lambda eqn: Call(), lower=_lower)
