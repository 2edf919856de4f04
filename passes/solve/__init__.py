"""solve: every equation's signature and every value's NdSbp chosen together, by an integer
program (scipy's HiGHS), to minimise the modelled seconds of the collectives and the local work.

Requires "inlined"; ensures "sharded", as ``passes.propagate`` does, so ``passes.boxing`` runs
after either. Scans, remats and sf.pipeline are solved with their bodies. Partial, and said so:
any other equation whose rule chooses for itself (while, cond, attention with an explicit
``context``) is laid out as greedy ``propagate`` lays it out — one fixed strategy, priced 0 —
and the rest solved around it; running out of its limits (simplex iterations, branch and
bound's seconds) hands the loops (pipelines among them) to greedy, then the whole program. The solved plan and
greedy's are then priced as boxed, and the cheaper kept (the model prices a value's conversions each from where it
is made; boxing chains them).
The Program records which ran (``program.planner``), and explain prints it. ``sf.AUTO`` inputs
are one more choice each. A memory budget (``memory_budget``, else the mesh's smallest GPU memory) bounds
explain's ``memory_bytes`` per device: the inputs and what the loops not in a loop hold (their
stacked outputs: a layer loop's residuals and gradients; their operands: a layer's weights as
the loop takes them, cast or gathered whole); partial, and said so: other intermediates and
temporaries are not counted, nor the loops laid out by greedy (a plan over a given budget is
refused after the solve).

The package: ``build`` makes the integer program (``model``) of a program, ``highs`` solves it,
``agreement`` takes process 0's solution on a multi-process run, ``coarsen`` coarsens an
optimizer's update in large programs, ``assemble`` makes the solution the program's equations
and layouts; here, the pass.
"""

from __future__ import annotations

import hashlib
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from shardflow.costs import combined_levels, modelled
from shardflow.passes.boxing import boxing
from shardflow.passes.propagate import Propagation, propagate
from shardflow.passes.solve import assemble, build, highs
from shardflow.passes.solve.highs import shared_solves
from shardflow.passes.solve.model import Infeasible, Unsolvable
from shardflow.program import Program, all_eqns
from shardflow.specs import ShardingError, format_sbp

__all__ = ["Infeasible", "Unsolvable", "shared_solves", "solve"]


def solve(program: Program, time_limit: float | None = None) -> Program:
    return _agreed(_solve(program, time_limit))


def _agreed(program: Program) -> Program:
    """``program``, where every process of a multi-process run planned the same one. Each
    process plans the program itself, with HiGHS's results taken from process 0
    (``agreement.process_0s``), so their plans agree unless something else in planning is not
    deterministic — which would lower programs whose collectives do not match. The plans'
    fingerprints (every value's NdSbp) are compared across the processes; a difference is a
    ShardingError."""
    if jax.process_count() == 1:
        return program
    layouts = (
        *program.in_sbp,
        *program.out_sbp,
        *(program.sbp.get(v) for eqn in all_eqns(program.jaxpr.jaxpr) for v in eqn.outvars),
    )
    text = "|".join("-" if s is None else format_sbp(s) for s in layouts)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1, digest.size)
    differ = [i for i, d in enumerate(every) if not np.array_equal(d, every[0])]
    if differ:
        raise ShardingError(
            f"the {len(every)} processes planned different programs (processes {differ} differ from process 0; "
            f"process {jax.process_index()}'s planner: {program.planner}), though the solver's results are "
            f"process 0's: planning was not deterministic here, which is a bug in shardflow. Plan with the greedy "
            f"planner (the default passes) meanwhile"
        )
    return program


def _solve(program: Program, time_limit: float | None) -> Program:
    # Scans and remats are solved with their bodies. Other control flow (while, cond, a
    # pipeline, attention with its own context) is laid out as greedy lays it out — its bodies
    # propagated from the operands greedy gave it — and the solver chooses every other
    # equation around it (boxing converts whatever it delivers to what the loop needs).
    limit = highs.TIME_LIMIT if time_limit is None else time_limit
    greedy = None if program.auto_inputs else propagate(program.replace(memory_budget=None))
    boxed = None if greedy is None else boxing(greedy)
    shares = None if boxed is None else assemble.loop_shares(boxed, program.jaxpr.jaxpr)
    combined = {}  # var -> {key: level} of greedy's combinable conversions of it
    for e, (key, level) in combined_levels(boxed.jaxpr.jaxpr).items() if boxed is not None else ():
        combined.setdefault(e.invars[0], {})[key] = level
    prices = highs.shared_prices((program.mesh, repr(program.links)))
    warm, built = {}, {}
    start, solves = time.perf_counter(), 1
    try:
        solution = assemble.solved(program, greedy, shares, limit, prices, warm, built, combined)
    except Unsolvable as e:
        if program.auto_inputs:
            raise ShardingError(
                f"in_specs sf.AUTO for {', '.join(program.auto_inputs)}: the solver did not run "
                f"({e}){_budget_note(program)}; give these arguments specs"
            ) from None
        if program.memory_budget is not None:
            raise ShardingError(
                f"memory_budget={program.memory_budget:,} bytes: the solver did not run ({e}){_budget_note(program)}"
            ) from None
        return greedy.replace(planner=f"greedy (the solver did not run: {e})")
    # The loops' hideable conversions were priced at the share greedy's plan leaves exposed; the
    # solved plan may lean on them more than its matmuls can hide. Priced at the share the
    # solved plan itself leaves exposed, the program is solved once more, and the cheaper of
    # the two as boxed kept (on a tie the second: its optimum is priced at its own shares).
    if shares:
        again = assemble.loop_shares(solution.boxed, program.jaxpr.jaxpr)
        if any(again[k] > shares[k] + 1e-3 for k in shares):
            solves = 2
            try:
                second = assemble.solved(
                    program, greedy, {k: max(shares[k], again[k]) for k in shares}, limit, prices, warm, built, combined
                )
                if second.plan.modelled_seconds <= solution.plan.modelled_seconds * (1 + 1e-9):
                    solution = second
            except Unsolvable:
                pass
    solved, mine = solution.program, solution.plan
    took = f"solved in {time.perf_counter() - start:.2f} s" + (
        " (twice: the second at the overlap shares of its first plan)" if solves == 2 else ""
    )
    # The model prices each of a value's conversions from where it is made; boxing may chain
    # them (gather once, then slice for free), which greedy's choices sometimes exploit. The
    # plans are compared as boxing will run them, and the cheaper kept.
    if greedy is None:  # sf.AUTO: greedy on the layouts the solver chose
        greedy = propagate(program.replace(in_sbp=solved.in_sbp, memory_budget=None))
        boxed = boxing(greedy)
    its = modelled(boxed)
    ours, theirs = mine.modelled_seconds, its.modelled_seconds
    budget = build.budget(program)
    if theirs < ours * (1 - 1e-9) and (budget is None or its.memory_bytes <= budget):  # a tie keeps the solved plan
        return greedy.replace(
            planner=f"greedy (its plan, {theirs * 1e6:.1f} us, is cheaper as boxed than the "
            f"solver's model optimum, {ours * 1e6:.1f} us)"
        )
    if program.memory_budget is not None and mine.memory_bytes > program.memory_budget:
        raise ShardingError(
            f"memory_budget={program.memory_budget:,} bytes per device: the plan takes "
            f"{mine.memory_bytes:,} ({mine.input_bytes:,} of inputs, {mine.loop_bytes:,} held by "
            f"loops; the loops laid out by greedy were not bounded){_budget_note(program)}"
        )
    if solution.bound >= solution.seconds * (1 - 1e-6):
        found = f"optimal: {solution.seconds * 1e6:.1f} us"
    else:
        found = f"{solution.seconds * 1e6:.1f} us, not proven optimal: its lower bound is {solution.bound * 1e6:.1f} us"
    return solved.replace(
        planner=f"solver ({found} of collectives and local work modelled, {ours * 1e6:.1f} us as "
        f"boxed; {took}{solution.note})"
    )


def _budget_note(program: Program) -> str:
    if program.memory_budget is None:
        return ""
    return (
        f"; memory_budget={program.memory_budget:,} bytes per device, of which the inputs with "
        f"specs take {build.fixed_input_bytes(Propagation(program)):,}"
    )
