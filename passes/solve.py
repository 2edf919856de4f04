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
are one more choice each. A memory budget (``memory_budget``, else a GPU's memory) bounds
explain's ``memory_bytes`` per device: the inputs and what the loops not in a loop hold (their
stacked outputs: a layer loop's residuals and gradients; their operands: a layer's weights as
the loop takes them, cast or gathered whole); partial, and said so: other intermediates and
temporaries are not counted, nor the loops laid out by greedy (a plan over a given budget is
refused after the solve).

The model (Alpa's intra-operator ILP, with conversions shared as boxing shares them):

- ``x[e, s]`` (binary): equation ``e`` runs strategy ``s`` — one 1-D signature per mesh axis
  (or running whole there) — among the combinations under which every operand and result
  divides; sum_s x[e, s] = 1. A pin (``sf.constrain``) has one strategy.
- ``z[v, a]``: value ``v`` comes out at NdSbp ``a`` (its producer's strategies that give ``a``);
  a program input is fixed at its in_spec.
- ``e[use, a, r]``: per use of ``v``, a transportation edge from where ``v`` is (sum_r e =
  z[v, a]) to what the use's strategy requires (sum_a e = the use's x columns requiring r):
  exact at integral x, and tight for one edge in the LP (Alpa's edge variables, over NdSbps
  rather than strategy pairs).
- ``q[v, a, r]`` >= every use's e[use, a, r]: ``v`` is converted from ``a`` to ``r`` once,
  however many users want ``r`` (boxing converts once), at ``conversion.seconds`` (the plan
  boxing will run). A layout only one use wants is priced on that use's edges (q = e).

Minimised: sum q * seconds(a -> r) + sum x * (the strategy's local work — bytes and flops on the
local blocks, ``conversion.local_work`` — and its own collectives, e.g. a pad's halo)
+ the outputs' conversions to out_specs (or of partial outputs to B). Only ``x`` is integral;
at an integral ``x`` the edges are the products z * (use's choice) and ``q`` their OR, so the
optimum is exact.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import itertools
import math
import os
import platform
import sys
import time
from types import SimpleNamespace
from typing import NamedTuple

import jax
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from scipy import sparse

from shardflow import conversion, registry
from shardflow.explain import hideable, make_plan
from shardflow.passes.boxing import boxing
from shardflow.passes.propagate import _QUIET_FALLBACKS, Propagation, _adoptable, propagate, reduced
from shardflow.pipelining import Bodies, operand_groups, outer_sbp, pipeline_axis, pipeline_p
from shardflow.program import REMAT_PRIMITIVES, Program, all_eqns, is_literal, open_jaxpr, scan_arity, source_line
from shardflow.registry import DECISION, Decision, Sig
from shardflow.rules.control import rebody, stacked, unstacked
from shardflow.rules.elementwise import SHAPE_KEEPING
from shardflow.specs import B, P, Partial, ShardingError, Split, format_sbp

ITERATION_LIMIT = 500_000  # dual simplex iterations an LP relaxation may take (work: the same on any machine)
TIME_LIMIT = 60.0  # seconds branch and bound may take, per attempt
GAP = 1e-7  # a plan within this fraction of the lower bound is optimal
COARSEN = 100_000  # transportation edges from which a program's pinned tail is coarsened (``pinned_tail``)


class Unsolvable(Exception):
    """The program has something the integer program does not model (said in the message)."""


class Infeasible(Unsolvable):
    """No plan meets the constraints (a memory budget): laying the loops out by greedy will not help."""


def strategies(prop: Propagation, eqn, given: dict | None = None) -> list:
    """(Decision, own seconds) of every strategy of ``eqn``, duplicates (same NdSbps) dropped.
    An equation with flops (a matmul) keeps only the strategies that divide them most, as
    Alpa does: by the model a small program would rather run its matmuls whole than reduce
    their results, but nobody splits a batch over devices to have each compute all of it.
    Control flow (a rule that chooses for itself) has one strategy, its Decision in ``given``
    (greedy's), else the program is Unsolvable."""
    rule = registry.rule_of(eqn.primitive)
    if rule is not None and rule.pin is not None:
        sbp = prop.pinned(eqn)
        return [(Decision((sbp,), (sbp,)), 0.0)]
    if lays_itself_out(eqn):
        if given is not None and eqn in given:
            return [(registry.decision_of(given[eqn]), 0.0)]
        raise Unsolvable(f"{eqn.primitive.name} at {source_line(eqn)} chooses its own sharding")
    sigs = registry.signatures(eqn)
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    whole = Sig((B,) * n_in, (B,) * n_out, "whole")
    if sigs is None:
        if eqn.primitive.name not in _QUIET_FALLBACKS:
            prop.fallbacks.append((eqn.primitive.name, source_line(eqn)))
        whole = Decision((prop.whole,) * n_in, (prop.whole,) * n_out, fallback=True)
        return [(whole, conversion.local_seconds(eqn, whole.ins, whole.outs, prop.mesh, prop.program.links))]
    out, seen = [], set()
    for chosen in itertools.product(
        *[[whole] if i in prop.held else list(sigs) + [whole] for i in range(len(prop.names))]
    ):
        ins = tuple(tuple(sig.ins[k] for sig in chosen) for k in range(n_in))
        outs = tuple(tuple(sig.outs[j] for sig in chosen) for j in range(n_out))
        if (ins, outs) in seen:
            continue
        if not all(prop.valid(x.aval, s) for x, s in zip(eqn.invars, ins)) or not all(
            prop.valid(v.aval, s) for v, s in zip(eqn.outvars, outs)
        ):
            continue
        if any(is_literal(x) and any(isinstance(t, Split) for t in s) for x, s in zip(eqn.invars, ins)):
            continue
        decision = Decision(ins, outs, tuple(chosen))
        if rule is not None and rule.admits is not None and not rule.admits(eqn, decision, prop.mesh):
            continue
        seen.add((ins, outs))
        flops, nbytes = conversion.local_work(eqn, ins, outs, prop.mesh)
        own = prop.program.links.compute_seconds(flops, nbytes)
        if rule is not None and rule.comm is not None:
            own += conversion.steps_seconds(rule.comm(eqn, ins, chosen, prop.mesh), prop.program.links)
        own += sum(prop.seconds(x.aval, prop.whole, s) for x, s in zip(eqn.invars, ins) if is_literal(x))
        out.append((decision, own, flops))
    if not out:
        raise Unsolvable(f"no strategy of {eqn.primitive.name} at {source_line(eqn)} divides its operands")
    least = min(flops for _, _, flops in out)
    return [(decision, own) for decision, own, flops in out if flops <= least]


def lays_itself_out(eqn) -> bool:
    """Whether ``eqn``'s rule chooses its layout itself, by its own ``propagate``, so that the
    solver takes greedy's choice (control flow, a pipeline, attention with an explicit context):
    a rule with ``admits`` is solved wherever it admits a decision at all."""
    rule = registry.rule_of(eqn.primitive)
    if rule is None or rule.propagate is None or rule.pin is not None:
        return False
    return rule.admits is None or not rule.admits(eqn, None, None)  # (None: any decision)


class _Model:
    """Columns and rows of the integer program, built incrementally."""

    def __init__(self):
        self.cost, self.integral = [], []
        self.rows, self.cols, self.vals, self.lb, self.ub = [], [], [], [], []
        self.overlapped = []  # (column, seconds, scan eqn): a cost times the share that loop leaves exposed
        self.matrix = None  # the rows as a sparse matrix, once built (``solve``)
        self.lazy = []  # rows the relaxation adds only where its optimum without them breaks them

    def var(self, cost=0.0, integral=False) -> int:
        self.cost.append(cost)
        self.integral.append(1 if integral else 0)
        return len(self.cost) - 1

    def vars(self, costs: np.ndarray, loop=None) -> np.ndarray:
        """Columns, one per entry of ``costs`` (in C order), shaped like it; with ``loop``
        (a scan eqn) their nonzero costs are hideable behind it (``costs``)."""
        first = len(self.cost)
        cols = np.arange(first, first + costs.size).reshape(costs.shape)
        if loop is None:
            self.cost.extend(costs.ravel().tolist())
        else:
            self.cost.extend([0.0] * costs.size)
            hidden = costs.ravel() != 0
            self.overlapped += [
                (c, seconds, loop) for c, seconds in zip(cols.ravel()[hidden].tolist(), costs.ravel()[hidden].tolist())
            ]
        self.integral.extend([0] * costs.size)
        return cols

    def row(self, terms, lb, ub):
        r = len(self.lb)
        for col, val in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lb.append(lb)
        self.ub.append(ub)

    def at_least(self, big: list, small: list):
        """Rows big[i] >= small[i] (columns)."""
        first, n = len(self.lb), len(big)
        self.rows.extend(np.repeat(np.arange(first, first + n), 2).tolist())
        self.cols.extend(np.column_stack([big, small]).ravel().tolist() if n else [])
        self.vals.extend([1.0, -1.0] * n)
        self.lb.extend([0.0] * n)
        self.ub.extend([math.inf] * n)

    def balance(self, sums: np.ndarray, minus: list):
        """Rows sum(sums[i]) = sum(minus[i]), one per row of ``sums`` (columns); where
        ``minus[i]`` is None, = 1 (a fixed side)."""
        first = len(self.lb)
        n, k = sums.shape
        self.rows.extend(np.repeat(np.arange(first, first + n), k).tolist())
        self.cols.extend(sums.ravel().tolist())
        self.vals.extend([1.0] * (n * k))
        for i, cols in enumerate(minus):
            if cols is None:
                self.lb.append(1.0)
                self.ub.append(1.0)
                continue
            self.rows.extend([first + i] * len(cols))
            self.cols.extend(cols)
            self.vals.extend([-1.0] * len(cols))
            self.lb.append(0.0)
            self.ub.append(0.0)

    def costs(self, exposed: dict | None) -> np.ndarray:
        """The columns' costs, a loop's hideable conversions at the share ``exposed`` gives it
        (all of it where none is given)."""
        cost = np.asarray(self.cost, float)
        for col, seconds, loop in self.overlapped:
            cost[col] += seconds * (exposed or {}).get(loop, 1.0)
        return cost

    def solve(self, time_limit, warm: dict | None = None, exposed: dict | None = None):
        """The optimum — or, where a limit stops the proof, the best plan found — as a result
        (x, fun, status 0: scipy.optimize.milp's fields) with ``bound``, a lower bound on the
        optimum (``fun`` where proven); status 2 where no plan meets the constraints, 1 (x None)
        where a limit came before any plan. By the LP relaxation where its x come out integral (a
        lower bound that is feasible: the optimum), which they often are here. Else relax and
        fix first — the integer columns the relaxation settled fixed there, the few fractional
        ones branched on (muon's Newton-Schulz step under tp: 81 of 2,150, 0.15 s). Where that
        plan costs what the relaxation does, it is optimal (the 1b tensor-parallel step on
        {data: 1, model: 4}: 2,079 fractional, fixed 0.6 s, where the whole program's branch
        and bound took 13 s to prove the same, 36 s under a memory budget); else branch and
        bound on the whole program in the time left of ``time_limit`` seconds: running out keeps
        the better of the two plans.
        The relaxation goes to HiGHS's own interface (highspy): its dual simplex solved the
        1b tensor-parallel step's in 8 s where scipy's milp took 40 s. ``warm``: the last
        relaxation solved for this program (``_relaxation``), kept there for the next;
        ``exposed``: the loops' overlap shares (``costs``)."""
        if self.matrix is None or self.matrix.shape != (len(self.lb), len(self.cost)):
            self.matrix = sparse.csc_array((self.vals, (self.rows, self.cols)), shape=(len(self.lb), len(self.cost)))
        a = self.matrix
        # in microseconds: seconds-sized costs sit below HiGHS's tolerances
        cost, integral = self.costs(exposed) * 1e6, np.asarray(self.integral) == 1
        lb, ub = np.asarray(self.lb, float), np.asarray(self.ub, float)

        def branch(lo, hi):
            from scipy import optimize  # 0.2 s to import, and rarely needed: not at the top

            left = max(time_limit - (time.perf_counter() - start), 0.1)
            return optimize.milp(
                cost,
                integrality=integral.astype(int),
                bounds=optimize.Bounds(lo, hi),
                constraints=optimize.LinearConstraint(a, lb, ub),
                options={"time_limit": left, "presolve": True, "mip_rel_gap": GAP},
            )

        relaxed = None
        if self.lazy:  # a memory budget's dense row: 1b tp's relaxation 40 s with it, 6 s without
            eager = np.ones(len(lb), bool)
            eager[self.lazy] = False
            relaxed = _relaxation(cost, a[eager], lb[eager], ub[eager], warm)
            if relaxed.status == 0:
                lazy = a[~eager] @ relaxed.x
                if np.any(lazy > ub[~eager] + 1e-9) or np.any(lazy < lb[~eager] - 1e-9):
                    relaxed = None
        if relaxed is None:
            relaxed = _relaxation(cost, a, lb, ub, warm)
        if relaxed.status != 0:  # no plan meets the constraints, or out of iterations: nothing to branch from
            return relaxed
        start = time.perf_counter()  # branch and bound's clock
        if np.all(np.abs(relaxed.x[integral] - np.round(relaxed.x[integral])) < 1e-6):
            relaxed.bound = relaxed.fun
            return relaxed
        lo, hi = np.zeros(len(cost)), np.ones(len(cost))  # relax and fix
        lo[integral & (relaxed.x > 1 - 1e-6)], hi[integral & (relaxed.x < 1e-6)] = 1.0, 0.0
        fixed = branch(lo, hi)
        if fixed.x is not None and fixed.fun <= relaxed.fun + GAP * abs(fixed.fun):
            fixed.bound = relaxed.fun  # as low as the relaxation: optimal, no search needed
            return fixed
        whole = branch(np.zeros(len(cost)), np.ones(len(cost)))
        if whole.status == 0:
            whole.bound = whole.fun
            return whole
        found = [r for r in (whole, fixed) if r.x is not None]
        if not found:  # no integral plan meets the constraints (status 2), or out of time
            return whole
        best = min(found, key=lambda r: r.fun)
        best.bound, best.status = max(relaxed.fun, getattr(whole, "mip_dual_bound", None) or -math.inf), 0
        return best


_SHARED: SimpleNamespace | None = None  # what the solves in ``shared_solves`` share


@contextlib.contextmanager
def shared_solves():
    """Within it, solves share what carries over between programs alike but for some layouts,
    as ``sf.alternatives`` plans them. The conversions priced so far (``Propagation``'s memo,
    per mesh and link model) are pure, so sharing them changes no plan. Each LP relaxation also
    starts from the optimal basis of the last one solved with the same shape and bounds, where
    it would start from the slack basis. The optimum is the same; HiGHS gets there in a fraction
    of the iterations (from the 1b tp step's basis, the 1b fsdp step's relaxation took 3,504
    dual simplex iterations against 26,480, the 7b fsdp step's 8,309 against 28,931). Among tied
    plans it may end at another vertex, so a plan can depend on what was solved before it in
    the block: only a call whose every process solves the same sequence (one ``alternatives``
    call, on one mesh) uses it. Re-entrant."""
    global _SHARED
    outer = _SHARED
    _SHARED = outer or SimpleNamespace(bases={}, prices={})
    try:
        yield
    finally:
        _SHARED = outer


def _relaxation(cost, a, lb, ub, warm: dict | None = None):
    """The LP min cost·x, lb <= a x <= ub, 0 <= x <= 1 by HiGHS's dual simplex: a result
    (x, fun, status 0); status 2 where it is infeasible, 1 where it ran out of
    ``ITERATION_LIMIT`` (x None, the reason in ``message``). Work, not seconds: the same
    plan on a loaded machine as on an idle one (the bytes table's lm step under tp, 102k
    iterations, ran out of a 60 s clock on a slower 2-core machine and went to greedy).
    ``warm`` (a dict, or None): the HiGHS instance of the last relaxation solved and its
    constraints, stored there; where this one has the same constraints (a program solved again
    at other overlap shares: only costs differ) the simplex starts from that optimal basis
    (the 1b tensor-parallel step's second relaxation: 0.3 s). Without HiGHS's random
    perturbation of the costs: ours span eleven orders of magnitude (a local step's epsilon to
    a layer loop's all-gathers), and perturbed, the 1b tensor-parallel step's relaxation took
    36,947 dual simplex iterations, 5.2 s, where unperturbed it takes 31,848, 2.3 s, to the
    same optimum (and its second relaxation 35k iterations, though warm); and without presolve,
    whose reductions (a fifth of the rows) cost more than they save here, 1.5 s. Else, within
    ``shared_solves``, from the last optimal basis of an LP of this shape and bounds."""
    import highspy

    shape = None if _SHARED is None else _lp_shape(a, lb, ub)
    if (
        warm
        and warm["a"].shape == a.shape
        and all(
            np.array_equal(x, y)
            for x, y in (
                (warm["a"].indptr, a.indptr),
                (warm["a"].indices, a.indices),
                (warm["a"].data, a.data),
                (warm["lb"], lb),
                (warm["ub"], ub),
            )
        )
    ):
        h = warm["highs"]
        h.changeColsCost(len(cost), np.arange(len(cost), dtype=np.int32), cost)
    else:
        with _quiet_stdout():  # HiGHS prints a banner when an instance is made
            h = highspy.Highs()
        h.silent()
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(cost), len(lb)
        lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(len(cost)), np.ones(len(cost))
        lp.row_lower_, lp.row_upper_ = lb, ub
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
        h.passModel(lp)
        if shape and shape in _SHARED.bases:  # within shared_solves
            h.setBasis(_SHARED.bases[shape])
    h.setOptionValue("simplex_iteration_limit", ITERATION_LIMIT)  # counted per run, from 0
    h.setOptionValue("dual_simplex_cost_perturbation_multiplier", 0.0)
    h.setOptionValue("presolve", "off")
    with _heap_kept():
        h.run()
    if warm is not None:
        warm.update(highs=h, a=a, lb=lb, ub=ub)
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return SimpleNamespace(x=None, status=2, message="the LP relaxation is infeasible")
    if status != highspy.HighsModelStatus.kOptimal:
        return SimpleNamespace(
            x=None,
            status=1,
            message=f"the LP relaxation stopped: {h.modelStatusToString(status)} "
            f"after {h.getInfo().simplex_iteration_count:,} iterations",
        )
    if shape:
        _SHARED.bases[shape] = h.getBasis()
    return SimpleNamespace(
        x=np.asarray(h.getSolution().col_value), fun=h.getInfo().objective_function_value, status=0, message=""
    )


def _lp_shape(a, lb, ub) -> tuple:
    bounds = np.ascontiguousarray(lb).tobytes() + np.ascontiguousarray(ub).tobytes()
    return a.shape, a.nnz, hashlib.sha1(bounds).digest()


@contextlib.contextmanager
def _heap_kept(pad: int = 16 << 20):
    """glibc's malloc keeping ``pad`` bytes at the top of its heap (M_TOP_PAD) where it would
    keep 128 KiB: a process's first relaxation otherwise pays ~0.25 s of page faults, memory
    returned to the system and taken back (the 1b FSDP step's LP, the same 32,362 dual simplex
    iterations: 1.50 s cold, 1.25 s solved again or with the pad). Elsewhere, nothing."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if platform.libc_ver()[0] == "glibc" else None
    M_TOP_PAD = -2
    if mallopt is not None:
        mallopt(M_TOP_PAD, pad)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_TOP_PAD, 128 << 10)


@contextlib.contextmanager
def _quiet_stdout():
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def layouts(prop: Propagation, aval, partial: bool = False) -> list:
    """Every NdSbp of B or S(d) on each mesh axis under which ``aval`` divides (B alone on an
    axis the bodies of a pipeline hold): the choices for an sf.AUTO input; with ``partial``, P
    too (a loop's stacked output)."""
    per_axis = [B] + [P] * partial + [Split(d) for d in range(len(aval.shape))]
    axes = [[B] if i in prop.held else per_axis for i in range(len(prop.names))]
    return [sbp for sbp in itertools.product(*axes) if prop.valid(aval, sbp)]


def _fixed_input_bytes(prop: Propagation) -> int:
    """Bytes per device of the inputs whose layout is given (not sf.AUTO)."""
    return sum(
        conversion.local_bytes(v.aval, s, prop.mesh)
        for v, s in zip(prop.program.jaxpr.jaxpr.invars, prop.program.in_sbp)
        if s is not None
    )


class _Region(NamedTuple):
    """A scan or remat solved with its body: per body input and per stacked output, the layouts
    it may take and their columns (one chosen); ``body`` the body's entries."""

    eqn: object
    body: list
    ins: list  # per body invar: (layouts, columns), or None (a remat's: the operand's own)
    ys: list  # per stacked output of a scan: (layouts, columns)


class _Pipeline(NamedTuple):
    """An sf.pipeline solved with its bodies: per body its entries, per body input and output
    the (layouts, columns) of the value it is; per operand and result of the equation the same,
    its layouts as outside the bodies."""

    eqn: object
    bodies: dict  # body name -> its entries
    body_ins: dict  # body name -> per invar (layouts, columns)
    body_outs: dict  # body name -> per outvar (layouts, columns): what is wanted of it
    ins: list  # per operand (layouts outside, columns)
    outs: list  # per result (layouts outside, columns)


def _solvable_region(eqn) -> bool:
    return eqn.primitive is lax.scan_p or eqn.primitive in REMAT_PRIMITIVES


class _Builder:
    """The integer program of a jaxpr, scans and remats included: a scan's body is one copy
    of its equations whose costs count ``length`` times, its consts, carries and sliced inputs
    one chosen layout each (converted outside the loop; a carry's the same at the start and
    end of every iteration), its stacked outputs one layout each — partial too: a layer's
    gradient reduced inside the loop, hidden behind the next layer's compute, or all layers'
    at once after it, one collective where the loop ran one per layer. A remat's body sees its
    operands as they are. Any other control flow is laid out as greedy laid it out."""

    def __init__(self, prop: Propagation, given: dict | None, tail: dict | None = None, known: dict | None = None):
        self.prop, self.given, self.m = prop, given or {}, _Model()
        self.known = {} if known is None else known  # eqn -> its strategies (shared by one build's walks)
        self.tail = tail or {}  # elementwise eqn -> the out_spec its result goes to alone (``pinned_tail``)
        self.produced = {v: {s: None} for v, s in prop.sbp.items()}  # var -> {NdSbp: x columns}; None: fixed
        self.uses = {}  # var -> [{NdSbp required: x columns}], one per use; None: always
        self.scale = {}  # var -> how many times its jaxpr runs per step
        self.hideable = {}  # var, or id of a use -> the scan whose compute may overlap its conversions
        self.alias = {}  # a remat body's input (or passed-through output) -> the value it is
        self.held = []  # (column, bytes per device) of the stacked outputs of loops not in a loop
        self.taken = {}  # (var, layout) -> x columns of loops not in a loop taking it there (not a carry)
        self.stacked_outputs = set()  # those loops' stacked outputs
        self.loop_depth = 0

    def resolve(self, v):
        return self.alias.get(v, v)

    def choice(self, costs) -> list:
        """Columns of one choice among ``len(costs)`` options, each at its cost."""
        cols = [self.m.var(cost, integral=True) for cost in costs]
        self.m.row([(c, 1.0) for c in cols], 1.0, 1.0)
        return cols

    def jaxpr(self, jaxpr, scale: float) -> list:
        for v in jaxpr.constvars:
            self.produced[v], self.scale[v] = {self.prop.whole: None}, scale
        for v in jaxpr.invars:
            self.scale[v] = scale
        return [self.entry(eqn, scale) for eqn in jaxpr.eqns]

    def entry(self, eqn, scale):
        if eqn in self.given:
            return self.plain(eqn, scale)
        if _solvable_region(eqn):
            return self.region(eqn, scale)
        if eqn.primitive is pipeline_p:
            return self.pipeline(eqn, scale)
        return self.plain(eqn, scale)

    def plain(self, eqn, scale):
        if eqn not in self.known:
            self.known[eqn] = strategies(self.prop, eqn, self.given)
        options = self.known[eqn]
        if eqn in self.tail:
            pin = self.tail[eqn]
            options = [o for o in options if _within(o[0].outs[0], pin)] or options
        cols = self.choice([own * scale for _, own in options])
        for k, x in enumerate(eqn.invars):
            if not is_literal(x):
                use = {}
                for (decision, _), c in zip(options, cols):
                    use.setdefault(decision.ins[k], []).append(c)
                self.uses.setdefault(self.resolve(x), []).append(use)
        for j, v in enumerate(eqn.outvars):
            self.scale[v] = scale
            for (decision, _), c in zip(options, cols):
                self.produced.setdefault(v, {}).setdefault(decision.outs[j], []).append(c)
        return eqn, options, cols

    def use(self, v, options, cols):
        """``v`` wanted at one of ``options``, as chosen by ``cols`` (a literal is where it is wanted)."""
        if not is_literal(v):
            self.uses.setdefault(self.resolve(v), []).append(_by_layout(options, cols))

    def wants(self, v) -> set:
        return {r for use in self.uses.get(v, ()) for r in use}

    def at(self, x) -> set:
        return {self.prop.whole} if is_literal(x) else set(self.produced.get(self.resolve(x), ()))

    def layout_choice(self, aval, candidates):
        options = sorted(
            {a for a in candidates if a is not None and self.prop.valid(aval, a) and _adoptable(a)}, key=str
        )
        return options, self.choice([0.0] * len(options))

    def region(self, eqn, scale):
        body = open_jaxpr(eqn.params["jaxpr"])
        if eqn.primitive in REMAT_PRIMITIVES:  # the body sees its operands as they are
            # (aliased: an operand may be a scan body's input, whose layouts come after its body)
            for x, v in zip(eqn.invars, body.invars):
                if is_literal(x):
                    self.produced[v] = {self.prop.whole: None}
                else:
                    self.alias[v] = self.resolve(x)
            entries = self.jaxpr(body, scale)
            for v, o in zip(body.outvars, eqn.outvars):
                self.scale[o] = scale
                if is_literal(v):
                    self.produced[o] = {self.prop.whole: None}
                else:
                    self.alias[o] = self.resolve(v)
            return _Region(eqn, entries, [None] * len(body.invars), [])
        nc, nk = scan_arity(eqn.params)
        inner = scale * eqn.params["length"]
        self.loop_depth += 1
        entries = self.jaxpr(body, inner)
        self.loop_depth -= 1
        ins = []
        for k, (x, v) in enumerate(zip(eqn.invars, body.invars)):
            if k < nc:  # a const: converted once, before the loop
                options, cols = self.layout_choice(v.aval, self.wants(v) | self.at(x))
                outer = options
            elif k < nc + nk:  # a carry: the same layout in and out
                out = body.outvars[k - nc]
                options, cols = self.layout_choice(v.aval, self.wants(v) | self.at(x) | self.at(out))
                outer = options
                self.use(out, options, cols)
                self.produced[eqn.outvars[k - nc]] = _by_layout(options, cols)
                self.scale[eqn.outvars[k - nc]] = scale
            else:  # a slice of a stacked input
                options, cols = self.layout_choice(v.aval, self.wants(v) | {unstacked(a) for a in self.at(x)})
                outer = [stacked(a) for a in options]
                self.hideable[v] = eqn  # a layer's weight, gathered ahead
            if not is_literal(x):
                self.uses.setdefault(self.resolve(x), []).append(_by_layout(outer, cols))
                if not self.loop_depth and not nc <= k < nc + nk:
                    for a, c in zip(outer, cols):
                        self.taken.setdefault((self.resolve(x), a), []).append(c)
            self.produced[v] = _by_layout(options, cols)
            ins.append((options, cols))
        ys = []
        for v, o in zip(body.outvars[nk:], eqn.outvars[nk:]):
            options = [self.prop.whole] if is_literal(v) else layouts(self.prop, v.aval, partial=True)
            options = [a for a in options if self.prop.valid(o.aval, stacked(a))]
            cols = self.choice([0.0] * len(options))
            if not self.loop_depth:  # held across the step (explain.held_bytes)
                self.held += [
                    (c, float(conversion.local_bytes(o.aval, stacked(a), self.prop.mesh)))
                    for a, c in zip(options, cols)
                ]
                self.stacked_outputs.add(o)
            if not is_literal(v):
                use = _by_layout(options, cols)
                self.uses.setdefault(self.resolve(v), []).append(use)
                self.hideable[id(use)] = eqn  # a layer's gradient, reduced behind the next
            self.produced[o], self.scale[o] = _by_layout([stacked(a) for a in options], cols), scale
            ys.append((options, cols))
        return _Region(eqn, entries, ins, ys)

    def pipeline(self, eqn, scale):
        """sf.pipeline's five bodies solved with the program (``pipelining._propagate`` is
        greedy's layout of it): one layout each for what crosses between them — the chunk's
        weights, the activation (and its gradient, laid out alike), each residual forward
        stores, each value B stashes for W, the weights' gradients (partial too), the head's
        parameters, arguments, loss and gradients —; on the pipeline axis every body runs whole
        (a device runs its own stages) but the head where its parameters may come split over
        it, its gradients then lying as its parameters do. Each body's work counts as often as
        it runs (the rule's ``trips``). Partial, and said so: memory held across the pipeline is not
        bounded (a budget counts the loops outside it)."""
        params, prop = eqn.params, self.prop
        ax = pipeline_axis(eqn, prop.mesh)
        bodies = {name: open_jaxpr(params[name]) for name in Bodies._fields}
        stage, head, xs, args = operand_groups(params, list(eqn.invars))
        off_axis = lambda a: ax is None or a[ax] == B  # noqa: E731
        unsummed_on_axis = lambda a: ax is None or not isinstance(a[ax], Partial)  # noqa: E731

        def choose(v, partial=False, keep=off_axis):
            options = [a for a in layouts(prop, v.aval, partial) if keep(a)]
            return options, self.choice([0.0] * len(options))

        forward, head_body, backward = bodies["forward"], bodies["head"], bodies["backward"]
        n, nh = len(stage), len(head)
        chunk = [choose(v) for v in forward.invars[:n]]
        x = choose(forward.invars[n])
        stored = [choose(v) for v in forward.outvars[1:]]
        stash = [choose(v) for v in bodies["backward_x"].outvars[1:]]
        d_chunk = [choose(v, partial=True) for v in backward.outvars[:-1]]
        # The head runs on every device of the pipeline axis: split over it as its parameters
        # may come (a vocab split over the stages shares its work out), else whole.
        split_head = ax is not None and any(isinstance(a[ax], Split) for v in head for a in self.at(v))
        head_params = [choose(v, keep=lambda a: split_head or off_axis(a)) for v in head_body.invars[:nh]]
        head_args = [choose(v) for v in head_body.invars[nh + 1 :]]
        loss = choose(head_body.outvars[0], partial=True)
        d_head = [choose(v, partial=True, keep=unsummed_on_axis) for v in head_body.outvars[1:-1]]
        if ax is not None:  # a head gradient on the pipeline axis as its parameter lies
            for (hs, hc), (ds, dc) in zip(head_params, d_head):
                for entry in {a[ax] for a in hs} | {a[ax] for a in ds}:
                    self.m.row(
                        [(c, 1.0) for a, c in zip(hs, hc) if a[ax] == entry]
                        + [(c, -1.0) for a, c in zip(ds, dc) if a[ax] == entry],
                        0.0,
                        0.0,
                    )
        body_ins = dict(
            forward=chunk + [x],
            head=head_params + [x] + head_args,
            backward=chunk + stored + [x],
            backward_x=chunk + stored + [x],
            backward_w=chunk + stored + stash,
        )
        body_outs = dict(
            forward=[x] + stored,
            head=[loss] + d_head + [x],
            backward=d_chunk + [x],
            backward_x=[x] + stash,
            backward_w=d_chunk,
        )
        rule = registry.rule_of(pipeline_p)
        entries = {}
        self.loop_depth += 1
        for name, body in bodies.items():
            assert len(body.invars) == len(body_ins[name]) and len(body.outvars) == len(body_outs[name]), name
            for v, (options, cols) in zip(body.invars, body_ins[name]):
                self.produced[v] = _by_layout(options, cols)
            held = ax is not None and not (name == "head" and split_head)
            with prop.holding(ax) if held else contextlib.nullcontext():
                entries[name] = self.jaxpr(body, scale * rule.trips(eqn, name, prop.mesh))
            for v, choice in zip(body.outvars, body_outs[name]):
                self.use(v, *choice)
        self.loop_depth -= 1
        outside = lambda choice, lead, on_axis=B: (
            [outer_sbp(a, ax, lead, on_axis) for a in choice[0]],  # noqa: E731
            choice[1],
        )
        ins = (
            [outside(c, 2, Split(0)) for c in chunk]
            + head_params
            + [outside(x, 1)]
            + [outside(c, 1) for c in head_args]
        )
        for v, choice in zip(eqn.invars, ins):
            self.use(v, *choice)
        outs = [loss] + [outside(c, 2, Split(0)) for c in d_chunk] + d_head + [outside(x, 1)]
        for v, (options, cols) in zip(eqn.outvars, outs):
            self.produced[v], self.scale[v] = _by_layout(options, cols), scale
        for a, c in zip(*ins[n + nh]):  # its own collectives: a micro-batch's activation
            operands = [None] * len(eqn.invars)
            operands[n + nh] = a
            self.m.cost[c] += scale * conversion.steps_seconds(
                rule.comm(eqn, operands, None, prop.mesh), prop.program.links
            )
        return _Pipeline(eqn, entries, body_ins, body_outs, ins, outs)


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
    the direct plan only; with ``conversion.plan``'s routes, the same bytes). So a program
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


def _within(layout, pin) -> bool:
    """Whether ``layout`` is ``pin`` or a partial sum over some of its axes (where a pinned
    tail's equation may run)."""
    return all(a == p or a == P for a, p in zip(layout, pin))


def _by_layout(options, cols) -> dict:
    """{layout: [its column]}: where a value is, or what a use requires, as one choice."""
    return {a: [c] for a, c in zip(options, cols)}


def _walk(prop: Propagation, jaxpr, given, tail, known) -> tuple:
    """(the builder with ``jaxpr``'s strategies and uses, its entries, the sf.AUTO inputs'
    choices): ``build`` before the conversions are priced."""
    b, auto = _Builder(prop, given, tail, known), []
    for v, s in zip(jaxpr.invars, prop.program.in_sbp):
        b.scale[v] = 1
        if s is None:  # sf.AUTO: one of its layouts, free of cost itself
            options = layouts(prop, v.aval)
            cols = b.choice([0.0] * len(options))
            b.produced[v] = _by_layout(options, cols)
            auto.append((v, options, cols))
    return b, b.jaxpr(jaxpr, 1), auto


def build(prop: Propagation, jaxpr, out_sbp, given: dict | None = None):
    """(model, per equation of ``jaxpr`` its entry — (eqn, its strategies, their x columns), or
    a ``_Region`` — and per sf.AUTO input (var, its layouts, their columns)), or raise
    Unsolvable. ``given``: control flow equations -> the equation as greedy laid it out. A
    loop's hideable conversions are priced at the share of them it leaves exposed when the
    model is solved (``_Model.costs``), so one model serves solves at other shares."""
    known = {}
    b, entries, auto = _walk(prop, jaxpr, given, None, known)
    if sum(len(at) * len(use) for v, at in b.produced.items() for use in b.uses.get(v, ())) >= COARSEN:
        tail = pinned_tail(jaxpr, prop.program.in_sbp, out_sbp)
        if tail:
            b, entries, auto = _walk(prop, jaxpr, given, tail, known)
    m = b.m
    budget = _budget(prop.program)
    if budget is not None:  # explain's memory_bytes: the inputs and what the loops hold
        m.row(
            [
                (c, float(conversion.local_bytes(v.aval, a, prop.mesh)) / 1e6)
                for v, options, cols in auto
                for a, c in zip(options, cols)
            ]
            + [(c, nbytes / 1e6) for c, nbytes in b.held + _taken(b, jaxpr)],
            -math.inf,
            float(budget - _fixed_input_bytes(prop)) / 1e6,
        )
        m.lazy.append(len(m.lb) - 1)
    unspecified = set()
    for v, want in zip(jaxpr.outvars, out_sbp):
        if is_literal(v):
            continue
        v = b.resolve(v)
        if want is None:
            unspecified.add(v)
        else:
            b.uses.setdefault(v, []).append({want: None})
    for v, at in b.produced.items():
        if v in unspecified:  # no out_spec: a partial output is reduced (inputs never are partial)
            for a, cols in at.items():
                for c in cols or ():
                    m.cost[c] += prop.seconds(v.aval, a, reduced(a))
        _conversions(m, prop, v, at, b.uses.get(v, ()), b.scale.get(v, 1), b.hideable)
    return m, entries, auto


def _taken(b: _Builder, jaxpr) -> list:
    """(column, bytes per device) of each value the loops not in a loop take (not as a carry)
    at a layout, once however many take it there (explain.held_bytes): one more column, at
    least each taking loop's choice of that layout. An argument, or another loop's stacked
    output, taken where it is, is counted as that already."""
    counted = set(jaxpr.invars) | b.stacked_outputs
    out = []
    for (v, a), takers in b.taken.items():
        at = b.produced.get(v, {})
        if a in at and at[a] is None:  # an argument at its spec
            continue
        held = b.m.var()
        made = [(c, 1.0) for c in at.get(a, ())] if v in counted else []
        for c in takers:
            b.m.row([(held, 1.0), (c, -1.0)] + made, 0.0, math.inf)
        out.append((held, float(conversion.local_bytes(v.aval, a, b.prop.mesh))))
    return out


def _conversions(m: _Model, prop, v, z, uses, scale=1, hideable=None):
    """Columns and rows pricing ``v``'s conversions: per use, a transportation edge e[a, r]
    (sum_r e = z[a], the columns producing ``v`` at a — None: fixed there, the constant 1 —,
    sum_a e = the use's choice of r: tight for one edge); per conversion
    a -> r to a layout several uses may want, q >= every use's e[a, r], paid once (boxing
    converts once for all users; 6k of the 7b step's 92k rows are of layouts one use wants). A
    conversion a loop may overlap with its compute (``hideable``: by var, or by id of a use)
    is priced at the share of it the loop leaves exposed, given when the model is solved."""
    uses = [use for use in uses if not all(a == r for a in z for r in use)]
    if not uses:
        return
    here = list(z)
    price = prop.pricer(v.aval)
    seconds = {(a, r): 0.0 if a == r else price(a, r) * scale for r in {r for use in uses for r in use} for a in here}
    shared = {}
    wanters = collections.Counter(r for use in uses for r in use)
    for use in uses:
        loop = None if hideable is None else hideable.get(v, hideable.get(id(use)))
        wanted = list(use)
        # a layout no other use wants: its edges carry the price themselves (q = e)
        prices = np.array([[seconds[a, r] if wanters[r] == 1 else 0.0 for r in wanted] for a in here])
        edges = m.vars(prices, loop)
        m.balance(edges, [z[a] for a in here])
        m.balance(edges.T, [use[r] for r in wanted])
        converted = [
            (i, j)
            for (i, a), (j, r) in itertools.product(enumerate(here), enumerate(wanted))
            if a != r and wanters[r] > 1
        ]
        new = list(dict.fromkeys((here[i], wanted[j]) for i, j in converted if (here[i], wanted[j]) not in shared))
        shared.update(zip(new, m.vars(np.array([seconds[pair] for pair in new]), loop).tolist()))
        m.at_least([shared[here[i], wanted[j]] for i, j in converted], [int(edges[i, j]) for i, j in converted])


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
    modelled seconds, a lower bound on the optimum's) of the plan ``_Model.solve`` found;
    raises Unsolvable. ``exposed``: the loops' overlap shares; ``warm``: see ``_relaxation``;
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
    result = _process_0s(
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


_RAISED = 255  # _process_0s's status where process 0's solve raised


def _process_0s(solve, columns: int):
    """``solve()``'s result — status, x (as chosen: 0 or 1), fun, bound, message — as process 0
    found it, on every process of a multi-process run; the others do not run HiGHS. Every
    process builds the same model (the build is deterministic), but branch and bound stops at
    a clock, which runs differently on each host: taken from one process, the plan is the same
    everywhere whatever the clocks did. Where process 0's solve raises, it raises there and
    every other process raises a ShardingError, rather than waiting for a plan that will not
    come."""
    if jax.process_count() == 1:
        return solve()
    head, bits = np.zeros(24 + 256, np.uint8), np.zeros((columns + 7) // 8, np.uint8)
    raised = None
    if jax.process_index() == 0:
        try:
            result = solve()
        except Exception as e:  # told to the others below, then raised here
            raised, result = e, SimpleNamespace(status=_RAISED, x=None, message=f"{type(e).__name__}: {e}")
        found = result.x is not None
        head[:2] = result.status, found
        head[8:24] = np.array([result.fun if found else math.nan, getattr(result, "bound", math.nan)]).view(np.uint8)
        message = result.message.encode()[:256]
        head[24 : 24 + len(message)] = np.frombuffer(message, np.uint8)
        if found:
            bits = np.packbits(np.asarray(result.x) > 0.5)
    head, bits = (np.asarray(v).astype(np.uint8) for v in multihost_utils.broadcast_one_to_all((head, bits)))
    fun, bound = head[8:24].copy().view(np.float64)
    message = head[24:].tobytes().rstrip(b"\0").decode(errors="replace")
    if raised is not None:
        raise raised
    if head[0] == _RAISED:
        raise ShardingError(f"the solve on process 0, whose result every process plans with, raised {message}")
    return SimpleNamespace(
        status=int(head[0]),
        fun=fun,
        bound=bound,
        message=message,
        x=np.unpackbits(bits, count=columns).astype(float) if head[1] else None,
    )


def _assemble(prop: Propagation, entries, pick, given) -> list:
    """The equations of ``entries`` with their chosen Decisions; their results' NdSbps set."""
    eqns = []
    for entry in entries:
        if isinstance(entry, _Region):
            eqn = _assemble_region(prop, entry, pick, given)
        elif isinstance(entry, _Pipeline):
            eqn = _assemble_pipeline(prop, entry, pick, given)
        else:
            eqn, options, cols = entry
            decision = pick(options, cols)[0]
            eqn = given[eqn] if eqn in given else eqn.replace(params={**eqn.params, DECISION: decision})
        for v, s in zip(eqn.outvars, registry.decision_of(eqn).outs):
            prop.set(v, s, source_line(eqn))
        eqns.append(eqn)
    return eqns


def _assemble_region(prop: Propagation, region: _Region, pick, given):
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


def _assemble_pipeline(prop: Propagation, region: _Pipeline, pick, given):
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
        if loops and _solvable_region(eqn):
            _laid_out(open_jaxpr(eqn.params["jaxpr"]), open_jaxpr(mine.params["jaxpr"]), loops, out)
        elif loops and eqn.primitive is pipeline_p:
            for name in Bodies._fields:
                _laid_out(open_jaxpr(eqn.params[name]), open_jaxpr(mine.params[name]), loops, out)
        elif lays_itself_out(eqn):
            out[eqn] = mine
    return out


def _exposed(boxed: Program, jaxpr, laid_jaxpr, out: dict) -> dict:
    """Scan equations of ``jaxpr`` -> the share of their hideable conversions (a layer's weights
    gathered ahead, its gradient reduced behind the next layer: ``explain.hideable``) that
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
        if _solvable_region(eqn):
            _exposed(boxed, open_jaxpr(eqn.params["jaxpr"]), open_jaxpr(laid.params["jaxpr"]), out)
    return out


class _Solution(NamedTuple):
    program: Program  # the solved program (propagate's ensures; boxing runs after)
    boxed: Program  # it boxed, for pricing
    seconds: float  # the integer program's optimum (modelled), or the best plan found
    bound: float  # a lower bound on the optimum (== seconds where proven)
    note: str  # what else the planner line says (sf.AUTO choices, loops laid out by greedy)
    plan: object  # explain's Plan of ``program``


def _solved(
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
    the last LP relaxation solved (``_relaxation``): shared by the solves of one program. A loop's carries make the LP
    relaxation fractional at times and branch and bound slow: where the solve runs out of its
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
    return _Solution(solved, boxed, seconds, bound, chose + laid, make_plan(boxed))


def _loop_shares(boxed: Program, jaxpr) -> dict:
    return _exposed(boxed, jaxpr, boxed.jaxpr.jaxpr, {})


def solve(program: Program, time_limit: float | None = None) -> Program:
    return _agreed(_solve(program, time_limit))


def _agreed(program: Program) -> Program:
    """``program``, where every process of a multi-process run planned the same one. Each
    process plans the program itself, with HiGHS's results taken from process 0
    (``_process_0s``), so their plans agree unless something else in planning is not
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
    limit = TIME_LIMIT if time_limit is None else time_limit
    greedy = None if program.auto_inputs else propagate(program.replace(memory_budget=None))
    boxed = None if greedy is None else boxing(greedy)
    shares = None if boxed is None else _loop_shares(boxed, program.jaxpr.jaxpr)
    prices = {} if _SHARED is None else _SHARED.prices.setdefault((program.mesh, repr(program.links)), {})
    warm, built = {}, {}
    start, solves = time.perf_counter(), 1
    try:
        solution = _solved(program, greedy, shares, limit, prices, warm, built)
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
        again = _loop_shares(solution.boxed, program.jaxpr.jaxpr)
        if any(again[k] > shares[k] + 1e-3 for k in shares):
            solves = 2
            try:
                second = _solved(
                    program, greedy, {k: max(shares[k], again[k]) for k in shares}, limit, prices, warm, built
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
    its = make_plan(boxed)
    ours, theirs = mine.modelled_seconds, its.modelled_seconds
    budget = _budget(program)
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
        f"specs take {_fixed_input_bytes(Propagation(program)):,}"
    )


def _budget(program: Program) -> int | None:
    """Bytes per device the plan may hold (explain's ``memory_bytes``): ``memory_budget``, else
    a GPU's memory, else no bound."""
    if program.memory_budget is not None:
        return program.memory_budget
    device = program.mesh.devices.flat[0]
    if device.platform != "gpu":
        return None
    return (device.memory_stats() or {}).get("bytes_limit")
