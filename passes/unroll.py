"""unroll: which layer loops lowering unrolls, decided here and recorded on each loop's Decision.

Requires "boxed" (a body's collectives are its boxes and its rules' own). Ensures "unrolled":
every loop-like equation (``registry.Loop``) has ``Decision.unrolled`` decided; lowering
(``passes.lower``) reads it and decides nothing.

A loop is unrolled when it runs at most ``UNROLLED_TRIPS`` trips, is not inside another loop's
body, and its body runs no collective (below). Rolled, a loop writes each trip's results into a stack and
the next loop reads them back: XLA copies a slice in or out for every result a custom call (a
matmul, an attention kernel) makes or takes, and a stack lives whole until the loop that reads
it ends. On one H200 the 1b train step ran 658 such copies, 21 ms a step, and held 82.3 GB;
unrolled, 54.1 GB and 12 % more tokens/s, compiled in the same time
(benchmarks/results/scaling.md). Partial, and said so: not yet measured on several GPUs.

A body with collectives stays rolled unless ``UNROLL_COLLECTIVES``: unrolled as it is, XLA merges
a collective the backward repeats of its forward (a ring's K and V gathered again: half the bytes
explain lists ran, tests/test_ring_attention.py; a layer's weight gathered again under FSDP) and
holds its result from the forward to the backward. With ``UNROLL_COLLECTIVES`` such a loop is
unrolled ``apart`` (``Decision.apart``): lowering takes each trip's slices through an
optimization barrier with the carries of the trip before it, so the backward's collectives are
its own (they wait on its cotangent), while a trip's gathers may still start one trip ahead,
beside the compute of the trip before — the overlap XLA's scheduler gives unrolled code. Off
until measured on several GPUs (``benchmarks/scaling.py``'s ``shardflow-unrolled`` engine): XLA:CPU drops
optimization barriers, so on CPU only the lowered program shows them (tests/test_core.py). (A
remat's recomputation would be merged so too — jax puts no optimization barrier on a remat
inside a scan, ``prevent_cse=False`` there — but in an unrolled body every recomputation's
operands are barred: ``rules.control``'s remat lowering.)
"""

from __future__ import annotations

import dataclasses

from shardflow import costs, registry
from shardflow.program import Program, map_subjaxprs, open_jaxpr
from shardflow.registry import DECISION, Loop

UNROLLED_TRIPS = 128
UNROLL_COLLECTIVES = False


def unroll(program: Program) -> Program:
    def walk(jaxpr, in_loop: bool):
        eqns = []
        for eqn in jaxpr.eqns:
            region = registry.region_of(eqn)
            if isinstance(region, Loop):
                body = open_jaxpr(eqn.params[region.body])
                communicates = bool(costs.collectives(program, body))
                unrolled = (
                    not in_loop and 0 < region.trips <= UNROLLED_TRIPS and (UNROLL_COLLECTIVES or not communicates)
                )
                decision = dataclasses.replace(
                    registry.decision_of(eqn), unrolled=unrolled, apart=unrolled and communicates
                )
                eqn = eqn.replace(params={**eqn.params, DECISION: decision})
            names = {name for name, _ in registry.decision_of(eqn).bodies}
            inner = in_loop or isinstance(region, Loop)  # a loop inside a loop's body stays rolled
            eqn = map_subjaxprs(eqn, lambda name, body: walk(body, inner), names)
            eqns.append(eqn)
        if all(new is old for new, old in zip(eqns, jaxpr.eqns)):
            return jaxpr
        return jaxpr.replace(eqns=eqns)

    closed = program.jaxpr
    return program.replace(jaxpr=closed.replace(jaxpr=walk(closed.jaxpr, False)))
