"""Stacked values kept in slots of a buffer, written and read in place by the scans that make
and use them.

A pipeline stage's forward is a scan over its layers whose stacked results (the residuals, one
row per layer) the backward's scan reads row by row. The pipeline keeps them between the two
in a slot of a buffer ``[slots, layers, ...]``. Written as results and copied into the slot,
then copied out of it for B and again for W, they cost three copies of every residual per
micro-batch (on a 1b model's stage, 369 MB each, ~200 ms of a 670 ms step). ``run`` evaluates
a jaxpr so that the scans themselves write and read the slot: a result made by a scan as its
stacked output is written row by row into ``buffer[slot, i]`` by that scan (the buffer one of
its carries, updated in place), and an input a scan takes as stacked ``xs`` is read row by row
from ``buffer[slot, i]``. A value the rewrite cannot reach (made or used by anything else) is
copied into or out of its slot as before. The same way, a stacked result can be *added* to
its row (``adds``): the backward's scan adds each layer's weight gradient to the float32 sum
over micro-batches as it makes it, where the sum was otherwise a zero-filled buffer of the
chunk's gradients, written row by row and then added whole.

A stacked input may also come as its rows (:class:`Rows`, e.g. a stage's layers split once
before the pipeline's loop over steps): a scan over it then runs unrolled, each layer reading
its own array. XLA:GPU copies a matmul operand sliced from a stacked array inside a loop into a
buffer of its own, each layer's weights once per micro-batch (on a 3b stage, 224 copies of
50 MB a step); arrays made once outside the loop are read where they are.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun, primitives

from shardflow.program import scan_arity

scan_p = primitives.scan_p

Slot = tuple  # (buffer [slots, ...], slot index: an int32 scalar), or (Rows, None): the rows themselves


class Rows(tuple):
    """A stacked value ``[n, ...]`` given as its ``n`` rows. As the buffer of a slot (with slot
    None) its rows are the slot's: a scan's rows are added to or written into them."""

    def stacked(self):
        return jnp.stack(self)


def put(buf, i, value):
    """``buf`` with ``value`` at slot ``i``; at its last slot where ``i`` is -1 (a write to
    nowhere, into a spare slot, keeps the update unconditional)."""
    i = jnp.where(i >= 0, i, buf.shape[0] - 1)
    return lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def at(buf, i):
    return lax.dynamic_index_in_dim(buf, jnp.maximum(i, 0), keepdims=False)


def run(
    jaxpr: ClosedJaxpr,
    args,
    reads: Mapping[int, Slot] = {},
    writes: Mapping[int, Slot] = {},
    adds: Mapping[int, Slot] = {},
) -> list:
    """``jaxpr``'s results on ``args``, where input ``i`` in ``reads`` is row ``slot`` of a
    buffer (``args[i]`` unused) and result ``o`` in ``writes`` goes into row ``slot`` of a
    buffer, whose new value is returned in its place; result ``o`` in ``adds`` is added to
    that row instead (a gradient summed over micro-batches: the scan that makes it adds each
    of its rows to the buffer's, in the buffer's dtype, and nothing is made whole first)."""
    j = jaxpr.jaxpr
    env = dict(zip(j.constvars, jaxpr.consts))
    slotted = {}
    for i, (v, x) in enumerate(zip(j.invars, args)):
        if i in reads:
            slotted[v] = reads[i]
        else:
            env[v] = x
    uses = {}
    for eqn in j.eqns:
        for x in eqn.invars:
            if not isinstance(x, Literal):
                uses[x] = uses.get(x, 0) + 1
    for v in j.outvars:
        if not isinstance(v, Literal):
            uses[v] = uses.get(v, 0) + 1
    # a result written in place: made by a scan as stacked ys, used nowhere else
    into = {**{o: (*s, False) for o, s in writes.items()}, **{o: (*s, True) for o, s in adds.items()}}
    targets = {
        j.outvars[o]: s for o, s in into.items() if not isinstance(j.outvars[o], Literal) and uses[j.outvars[o]] == 1
    }
    written = {}

    def read(x):
        if isinstance(x, Literal):
            return x.val
        if x not in env:  # a slotted input something other than a scan's xs uses
            env[x] = at(*slotted[x])
        return env[x]

    def whole_value(x):  # rows something other than a scan's xs uses
        value = read(x)
        return value.stacked() if isinstance(value, Rows) else value

    for eqn in j.eqns:
        if eqn.primitive is scan_p and (_touches(eqn, slotted, targets) or _has_rows(eqn, env)):
            outs = _scan(eqn, read, whole_value, slotted, targets, written)
        else:
            outs = eqn.primitive.bind(*map(whole_value, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))

    def whole(o, v):  # a result no scan wrote into its slot
        buf, slot, add = into[o]
        if isinstance(buf, Rows):
            return Rows(y.astype(r.dtype) + (r if add else 0) for r, y in zip(buf, whole_value(v)))
        return put(buf, slot, at(buf, slot) + read(v).astype(buf.dtype) if add else read(v))

    return [
        written[v] if v in written else whole(o, v) if o in into else whole_value(v) for o, v in enumerate(j.outvars)
    ]


def _touches(eqn, slotted, targets) -> bool:
    n_consts, n_carry = scan_arity(eqn.params)
    return any(not isinstance(x, Literal) and x in slotted for x in eqn.invars[n_consts + n_carry :]) or any(
        v in targets for v in eqn.outvars[n_carry:]
    )


def _has_rows(eqn, env) -> bool:
    n_consts, n_carry = scan_arity(eqn.params)
    return any(isinstance(env.get(x), Rows) for x in eqn.invars[n_consts + n_carry :] if not isinstance(x, Literal))


def _scan(eqn, read, whole_value, slotted, targets, written) -> list:
    """The scan ``eqn`` with its slotted xs read from, and its target ys written into, their
    buffers at row (slot, iteration); unrolled where an xs comes as :class:`Rows`."""
    p = eqn.params
    (n_consts, n_carry), length, reverse = scan_arity(p), p["length"], p["reverse"]
    body = jaxpr_as_fun(p["jaxpr"])
    consts = [whole_value(x) for x in eqn.invars[:n_consts]]
    carry = [whole_value(x) for x in eqn.invars[n_consts : n_consts + n_carry]]
    xs = eqn.invars[n_consts + n_carry :]
    xs_slots = {k: slotted[x] for k, x in enumerate(xs) if not isinstance(x, Literal) and x in slotted}
    ys = eqn.outvars[n_carry:]
    ys_slots = {k: targets[v] for k, v in enumerate(ys) if v in targets}

    def step(state, xs_rest):
        carry, i, bufs = state
        rest = iter(xs_rest)
        xs_i = [_row(*xs_slots[k], i) if k in xs_slots else next(rest) for k in range(len(xs))]
        outs = body(*consts, *carry, *xs_i)
        ys_i = outs[n_carry:]
        bufs = {k: _put_row(b, ys_slots[k][1], i, ys_i[k], add=ys_slots[k][2]) for k, b in bufs.items()}
        return (outs[:n_carry], i + (-1 if reverse else 1), bufs), [y for k, y in enumerate(ys_i) if k not in bufs]

    state = (carry, length - 1 if reverse else 0, {k: buf for k, (buf, _, _) in ys_slots.items()})
    xs_rest = [read(x) for k, x in enumerate(xs) if k not in xs_slots]
    if any(isinstance(x, Rows) for x in xs_rest + list(state[2].values())):
        rows = [None] * length
        for i in reversed(range(length)) if reverse else range(length):
            state, rows[i] = step(state, [x[i] for x in xs_rest])
        (carry, _, bufs), ys_rest = state, [jnp.stack(y) for y in zip(*rows)]
    else:
        state = (state[0], jnp.int32(state[1]), state[2])
        (carry, _, bufs), ys_rest = lax.scan(step, state, xs_rest, length=length, reverse=reverse)
    for k, buf in bufs.items():
        written[ys[k]] = buf
    rest = iter(ys_rest)
    return carry + [None if k in ys_slots else next(rest) for k in range(len(ys))]


def _row(buf, slot, i):
    if isinstance(buf, Rows):
        return buf[i]
    slot = jnp.maximum(slot, 0)
    start = (slot, i) + (0,) * (buf.ndim - 2)
    return lax.dynamic_slice(buf, start, (1, 1) + buf.shape[2:])[0, 0]


def _put_row(buf, slot, i, y, add=False):
    if isinstance(buf, Rows):
        return Rows(y.astype(r.dtype) + (r if add else 0) if j == i else r for j, r in enumerate(buf))
    slot = jnp.where(slot >= 0, slot, buf.shape[0] - 1)
    start = (slot, i) + (0,) * (buf.ndim - 2)
    y = y.astype(buf.dtype) + (_row(buf, slot, i) if add else 0)
    return lax.dynamic_update_slice(buf, y[None, None], start)
