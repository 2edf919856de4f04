"""highs: the HiGHS driver of ``passes.solve``, and the one module of it that imports scipy and
highspy (each where first used: importing the solver loads neither). ``optimum`` solves an
integer program (``model.Model``'s arrays) by its LP relaxation, relax and fix, then branch and
bound (scipy.optimize.milp); ``relaxation`` runs HiGHS's dual simplex through its own
interface, warm where it can; ``shared_solves`` shares what carries over between the solves of
programs alike, as ``sf.alternatives`` plans them."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import platform
import sys
import time
from types import SimpleNamespace

import numpy as np

ITERATION_LIMIT = 500_000  # dual simplex iterations an LP relaxation may take (work: the same on any machine)
TIME_LIMIT = 60.0  # seconds branch and bound may take, per attempt
GAP = 1e-7  # a plan within this fraction of the lower bound is optimal


def sparse_rows(vals, rows, cols, shape):
    """The integer program's rows as a sparse matrix: entries ``vals`` at (``rows``, ``cols``),
    stored by columns, as HiGHS takes them."""
    from scipy import sparse

    return sparse.csc_array((vals, (rows, cols)), shape=shape)


def optimum(a, cost, integral, lb, ub, lazy_rows: list, time_limit, warm: dict | None = None):
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
    1b tensor-parallel step's in 8 s where scipy's milp took 40 s. ``a``, ``lb``, ``ub``: the
    rows (``sparse_rows``) and their bounds; ``cost`` per column, in the units HiGHS solves in;
    ``integral``: which columns are; ``lazy_rows``: rows the relaxation adds only where its
    optimum without them breaks them; ``warm``: the last relaxation solved for this program
    (``relaxation``), kept there for the next."""

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
    if lazy_rows:  # a memory budget's dense row: 1b tp's relaxation 40 s with it, 6 s without
        eager = np.ones(len(lb), bool)
        eager[lazy_rows] = False
        relaxed = relaxation(cost, a[eager], lb[eager], ub[eager], warm)
        if relaxed.status == 0:
            lazy = a[~eager] @ relaxed.x
            if np.any(lazy > ub[~eager] + 1e-9) or np.any(lazy < lb[~eager] - 1e-9):
                relaxed = None
    if relaxed is None:
        relaxed = relaxation(cost, a, lb, ub, warm)
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


def shared_prices(key) -> dict:
    """Within ``shared_solves``, the conversions priced so far on ``key`` (a mesh and link
    model), shared by its solves; outside it, a dict of their own."""
    return {} if _SHARED is None else _SHARED.prices.setdefault(key, {})


def relaxation(cost, a, lb, ub, warm: dict | None = None):
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
