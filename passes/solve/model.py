"""model: the integer program ``passes.solve`` builds (``build``) and HiGHS solves (``highs``),
and ``Unsolvable``, what a program the model cannot plan raises.

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

import math

import numpy as np

from shardflow.passes.solve import highs


class Unsolvable(Exception):
    """The program has something the integer program does not model (said in the message)."""


class Infeasible(Unsolvable):
    """No plan meets the constraints (a memory budget): laying the loops out by greedy will not help."""


class Model:
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
        """``highs.optimum`` of the program, its costs at the loops' overlap shares ``exposed``
        (``costs``): x, fun, status (scipy.optimize.milp's fields) and ``bound``. ``warm``: the
        last relaxation solved for this program (``highs.relaxation``), kept there for the next."""
        if self.matrix is None or self.matrix.shape != (len(self.lb), len(self.cost)):
            self.matrix = highs.sparse_rows(self.vals, self.rows, self.cols, (len(self.lb), len(self.cost)))
        # in microseconds: seconds-sized costs sit below HiGHS's tolerances
        cost, integral = self.costs(exposed) * 1e6, np.asarray(self.integral) == 1
        lb, ub = np.asarray(self.lb, float), np.asarray(self.ub, float)
        return highs.optimum(self.matrix, cost, integral, lb, ub, self.lazy, time_limit, warm)
