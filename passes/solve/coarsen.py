"""coarsen: an optimizer's update, the part of a training step with the most columns and the
least choice, run where its outputs are pinned (``pinned_tail``), in programs large enough
that solve time matters (``COARSEN``)."""

from __future__ import annotations

import numpy as np
from jax import lax

from shardflow.elementwise_primitives import SHAPE_KEEPING
from shardflow.program import is_literal
from shardflow.specs import P

COARSEN = 100_000  # transportation edges from which a program's pinned tail is coarsened (``pinned_tail``)


def coarsened_tail(edges: int, jaxpr, in_sbp, out_sbp) -> dict:
    """``pinned_tail`` of a program whose integer program has ``edges`` transportation edges:
    none below ``COARSEN``."""
    return pinned_tail(jaxpr, in_sbp, out_sbp) if edges >= COARSEN else {}


def pinned_tail(jaxpr, in_sbp, out_sbp) -> dict:
    """Elementwise equations whose result goes only to outputs of one out_spec, alike or
    through other such equations -> that out_spec: an optimizer's update of a parameter, whose
    new value and moments are pinned at the parameter's spec. The solver runs them there or on
    partial sums of it (added before the one reduction), and converts what comes in from the
    rest of the program — a gradient — where it enters: coarsening, as Alpa's followers and
    XLA's auto-sharding do, for the part of a training step with the most columns and the
    least choice. Not a cast to a narrower type (its result converts cheaper than its
    operand), and not an equation that combines two values entering from the rest of the
    program, neither anchored — an argument at that spec, or a result of such an equation with
    an anchored operand —: two gradients added where they are and converted once would be
    cheaper. Two values made in the tail from the one value entering it are one (a gradient
    and its clipped copy, selected between: the one gradient converted once either way).

    Not exact, and said so: where the spec leaves a mesh axis whole (tp's weights, over
    `data`), an update split further and gathered after (ZeRO-1) computes less; and a gradient
    converted where it enters may be dearer than converted in steps between the tail's
    equations (an LSTM's step under fsdp moved 5 % more bytes coarsened while conversions took
    the direct plan only; with ``conversion.route``'s routes, the same bytes). So a program
    is coarsened only where its integer program would have ``COARSEN`` transportation edges or
    more, where solve time matters: the presets' train steps solve 1.3-1.7x faster, to the same
    model optimum where checked (benchmarks/results/solve_time.md); smaller programs are
    solved exactly (the brute-force test, tests/test_solve.py)."""
    pins, uses = {}, {}
    for v, s in zip(jaxpr.outvars, out_sbp):
        if not is_literal(v):
            pins.setdefault(v, set()).add(s)
    for eqn in jaxpr.eqns:
        for x in eqn.invars:
            if not is_literal(x):
                uses.setdefault(x, []).append(eqn)
    given = dict(zip(jaxpr.invars, in_sbp))
    excluded = set()
    while True:
        tail = {}
        for eqn in reversed(jaxpr.eqns):
            if eqn.primitive not in SHAPE_KEEPING or len(eqn.outvars) != 1 or eqn in excluded:
                continue
            (o,) = eqn.outvars
            if (
                eqn.primitive is lax.convert_element_type_p
                and np.dtype(o.aval.dtype).itemsize < np.dtype(eqn.invars[0].aval.dtype).itemsize
            ):
                continue
            wanted = set(pins.get(o, ()))
            for user in uses.get(o, ()):
                if user not in tail or user.outvars[0].aval.shape != o.aval.shape:
                    wanted.add(None)
                wanted.add(tail.get(user))
            if len(wanted) == 1 and None not in wanted:
                tail[eqn] = wanted.pop()
        anchored, sources, combining = set(), {}, set()  # sources: tail result -> what entered it
        for eqn in jaxpr.eqns:
            if eqn in tail:
                shape, pin = eqn.outvars[0].aval.shape, tail[eqn]
                operands = {x for x in eqn.invars if not is_literal(x) and x.aval.shape == shape}
                anchors = {x for x in operands if x in anchored or given.get(x) == pin}
                entered = set().union(*(sources.get(x, {x}) for x in operands - anchors))
                if len(entered) > 1:
                    combining.add(eqn)
                if anchors:
                    anchored.add(eqn.outvars[0])
                sources[eqn.outvars[0]] = entered
        if not combining:
            return tail
        excluded |= combining


def within(layout, pin) -> bool:
    """Whether ``layout`` is ``pin`` or a partial sum over some of its axes (where a pinned
    tail's equation may run)."""
    return all(a == p or a == P for a, p in zip(layout, pin))
