"""The pass list: each pass is ``Program -> Program`` with the facts it requires and ensures.

A fact is a named invariant with a checker. A pass refuses to run on a Program that lacks a
fact it requires (always checked: it is a set lookup); under ``SHARDFLOW_CHECK=1`` (on in the
tests and CI) every fact a pass ensures is verified on its output by walking the program, the
way torch.fx passes state ``requires`` / ``ensures``. An optional pass (pipeline, context
parallelism) joins by inserting one ``Pass`` into the list:

    passes = sf.passes.insert_after(sf.passes.DEFAULT, "propagate", my_pass)
    step = sf.parallelize(f, mesh=mesh, in_specs=..., passes=passes)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections.abc import Callable, Sequence

from jax.extend import source_info_util
from jax.extend.core import DropVar

from shardflow.program import Program, all_eqns, all_jaxprs, is_literal, nested, subjaxprs
from shardflow.registry import Decision, Loop, decision_of, region_of
from shardflow.specs import B, format_sbp

# Frames of the passes are never "the user's line".
source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)) + os.sep)


class InvariantError(AssertionError):
    """A pass broke a fact it promised (a bug in shardflow or in a user's pass, never in the
    user's program)."""


@dataclasses.dataclass(frozen=True)
class Fact:
    name: str
    check: Callable[[Program], None]  # raises InvariantError when the fact does not hold


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Program], Program]
    requires: tuple = ()  # Facts
    ensures: tuple = ()  # Facts
    invalidates: tuple = ()  # Facts that no longer hold after it (e.g. "boxed")

    def __call__(self, program: Program, check: bool | None = None) -> Program:
        missing = [f.name for f in self.requires if f.name not in program.facts]
        if missing:
            raise InvariantError(
                f"pass {self.name!r} requires {missing}; the passes before it ensured {sorted(program.facts)}"
            )
        out = self.run(program)
        if checking() if check is None else check:
            for fact in self.ensures:
                fact.check(out)
        dropped = {f.name for f in self.invalidates}
        return out.replace(facts=(out.facts - dropped) | {f.name for f in self.ensures})


def checking() -> bool:
    return os.environ.get("SHARDFLOW_CHECK", "") not in ("", "0")


def run(program: Program, passes: Sequence[Pass]) -> Program:
    with _collector_paused():
        for p in passes:
            program = p(program)
    return program


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while the passes run: the solver's integer program
    and boxing's rebuilt jaxprs are millions of small objects and few cycles, and the
    collections they set off took 0.4-1.1 s of the presets' 3-4 s solves."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def insert_after(passes: Sequence[Pass], name: str, new: Pass) -> tuple:
    """``passes`` with ``new`` right after the pass called ``name``."""
    names = [p.name for p in passes]
    if name not in names:
        raise ValueError(f"no pass named {name!r} in {names}")
    i = names.index(name) + 1
    return tuple(passes[:i]) + (new,) + tuple(passes[i:])


# ------------------------------------------------------------------------------ facts


def _fail(what: str):
    raise InvariantError(what)


def _check_inlined(program: Program):
    from shardflow.passes.inline import CALLS

    defined = set()
    for jaxpr in all_jaxprs(program.jaxpr.jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive in CALLS:
                _fail(f"inlined: a {eqn.primitive.name} call is left")
        for v in list(jaxpr.constvars) + list(jaxpr.invars) + [v for e in jaxpr.eqns for v in e.outvars]:
            if not isinstance(v, DropVar):
                if v in defined:
                    _fail(f"inlined: {v} is defined in two places")
                defined.add(v)


def _check_sharded(program: Program):
    n = len(program.axis_names)
    for eqn in all_eqns(program.jaxpr.jaxpr):
        d = decision_of(eqn)
        if not isinstance(d, Decision):
            _fail(f"sharded: {eqn.primitive.name} has no Decision")
        if len(d.ins) != len(eqn.invars) or len(d.outs) != len(eqn.outvars):
            _fail(f"sharded: {eqn.primitive.name}'s Decision {d} does not match its arity")
        if any(len(s) != n for s in d.ins + d.outs):
            _fail(f"sharded: {eqn.primitive.name}'s Decision {d} is not one entry per mesh axis")
        for v, s in zip(eqn.outvars, d.outs):
            if not isinstance(v, DropVar) and program.sbp.get(v) != s:
                _fail(f"sharded: {v} of {eqn.primitive.name} has NdSbp {program.sbp.get(v)}, its Decision says {s}")
    if any(s is None for s in program.out_sbp):
        _fail("sharded: an output has no NdSbp")
    if any(s is None for s in program.in_sbp):
        _fail("sharded: an sf.AUTO input has no NdSbp")


def _check_boxed(program: Program):
    whole = (B,) * len(program.axis_names)

    def have(x):
        return whole if is_literal(x) else program.sbp.get(x)

    for jaxpr in all_jaxprs(program.jaxpr.jaxpr):
        for eqn in jaxpr.eqns:
            d = decision_of(eqn)
            for k, (x, want) in enumerate(zip(eqn.invars, d.ins)):
                if have(x) != want:
                    _fail(
                        f"boxed: operand {k} of {eqn.primitive.name} has {have(x)}, its Decision needs "
                        f"{format_sbp(want)}"
                    )
            for (name, wanted), body in zip(_bodies(eqn, d), nested(eqn)):
                for x, want in zip(body.outvars, wanted or ()):
                    if want is not None and have(x) != want:
                        _fail(
                            f"boxed: an output of {eqn.primitive.name}'s {name} has {have(x)}, wanted "
                            f"{format_sbp(want)}"
                        )
    for x, want in zip(program.jaxpr.jaxpr.outvars, program.out_sbp):
        if have(x) != want:
            _fail(f"boxed: a program output has {have(x)}, wanted {format_sbp(want)}")


def _bodies(eqn, d):
    """(param name, wanted outputs) for each nested jaxpr of ``eqn``, in ``nested`` order."""
    out, names = [], {name for name, _ in d.bodies}
    for name, value in subjaxprs(eqn.params):
        if name not in names:
            continue
        for _ in value if isinstance(value, tuple) else (value,):
            out.append((name, d.body_outs(name)))
    return out


def _check_unrolled(program: Program):
    for eqn in all_eqns(program.jaxpr.jaxpr):
        if isinstance(region_of(eqn), Loop) and decision_of(eqn).unrolled is None:
            _fail(f"unrolled: a {eqn.primitive.name} loop has no rolled/unrolled decision")


def _check_lowered(program: Program):
    if program.lowered is None:
        _fail("lowered: the program has no lowered function")


INLINED = Fact("inlined", _check_inlined)
SHARDED = Fact("sharded", _check_sharded)
BOXED = Fact("boxed", _check_boxed)
UNROLLED = Fact("unrolled", _check_unrolled)
LOWERED = Fact("lowered", _check_lowered)


def _passes():
    from shardflow.passes.boxing import boxing
    from shardflow.passes.cse import cse
    from shardflow.passes.inline import inline
    from shardflow.passes.lower import lower
    from shardflow.passes.propagate import propagate
    from shardflow.passes.unroll import unroll

    def solve(program):  # scipy loads only when a program is solved
        from shardflow.passes.solve import solve

        return solve(program)

    return (
        Pass("inline", inline, ensures=(INLINED,)),
        Pass("cse", cse, requires=(INLINED,), ensures=(INLINED,)),
        Pass("propagate", propagate, requires=(INLINED,), ensures=(SHARDED,)),
        Pass("solve", solve, requires=(INLINED,), ensures=(SHARDED,)),
        Pass("boxing", boxing, requires=(SHARDED,), ensures=(BOXED,)),
        Pass("unroll", unroll, requires=(BOXED,), ensures=(UNROLLED,)),
        Pass("lower", lower, requires=(BOXED, UNROLLED), ensures=(LOWERED,)),
    )


ALL = _passes()  # every pass shardflow has, by name: ``passes=["inline", "cse", "solve", ...]``
_INLINE, _CSE, _PROPAGATE, _SOLVE, _BOXING, _UNROLL, _LOWER = ALL
DEFAULT = (_INLINE, _CSE, _PROPAGATE, _BOXING, _UNROLL, _LOWER)
# The whole-program integer program instead of greedy propagation (passes/solve): loops and
# pipelines are solved with their bodies; what it cannot solve falls back to greedy, and explain
# says so.
SOLVER = (_INLINE, _CSE, _SOLVE, _BOXING, _UNROLL, _LOWER)
