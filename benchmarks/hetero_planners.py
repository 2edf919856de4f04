"""shardflow's heterogeneous planner (shardflow.hetero.search) against re-implementations of the
plan spaces and searches of AMP (NeurIPS'22), Metis (USENIX ATC'24) and FlashFlex / HexiScale,
all priced by the same simulator (shardflow.hetero.simulate) with the same Framework.

Each baseline enumerates the plans its own search would visit (its parallel degrees, device
placement, layer partition rule and micro-batch rule, re-implemented from the papers' repositories
in a compact form; what is simplified is said at each function and in
benchmarks/results/hetero_planners.md) and keeps the fastest that fits every device's memory by
the shared simulator. That is generous to the baselines: their own cost models would pick among
the same candidates less well, never better (under this simulator). Every baseline is also given
the recomputation switch that our search has.

    python benchmarks/hetero_planners.py [--framework round|small-gemm|both] [--metis-variance 1.0] \
        [--clusters NAME ...] [--models NAME ...] [--out benchmarks/results/hetero/2026-12-06_planners.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _checkout  # noqa: E402,F401  (the repository's shardflow, before any shardflow import)
import _results  # noqa: E402

from shardflow.hetero.cluster import Cluster, Node  # noqa: E402
from shardflow.hetero.devices import GB, TB, DeviceKind, device_kind  # noqa: E402
from shardflow.hetero.search import search  # noqa: E402
from shardflow.hetero.simulate import (  # noqa: E402
    Framework,
    Pipeline,
    Plan,
    Stage,
    StageCosts,
    Transformer,
    simulate,
)

DATA = Path(__file__).parent / "data" / "hetero" / "published.json"

# Not in shardflow's catalogue: FlashFlex's README mixes use it. Numbers from
# benchmarks/data/hetero/devices.json (memory and bandwidth from NVIDIA's specification page;
# tensor rate derived there from SM count x boost clock, fp16 with fp32 accumulate).
RTX_3080TI = DeviceKind(
    "RTX-3080Ti",
    12 * GB,
    912 * GB,
    dict(bf16=68.2 * TB, fp16=68.2 * TB, tf32=34.1 * TB, fp32=34.1 * TB),
    None,
    32 * GB,
    "GeForce RTX 3080 Ti specifications; tensor rate derived (benchmarks/data/hetero/devices.json)",
)
EXTRA = {"RTX-3080Ti": RTX_3080TI}

GPT2_MEDIUM = Transformer(24, 1024, 16, 64, 4096, 52256, 1024)  # AMP's model (its vocab)
OPT_350M = Transformer(24, 1024, 16, 64, 4096, 50272, 2048)  # as Sailor configures it
LLAMA2_7B = Transformer(32, 4096, 32, 128, 11008, 32000, 4096, gated=True)
MODELS = {"GPT-2-medium": (GPT2_MEDIUM, 32), "OPT-350M": (OPT_350M, 256), "Llama-2-7B": (LLAMA2_7B, 64)}

FRAMEWORKS = {
    # the round numbers of docs/how-to/heterogeneous.md
    "round": Framework(efficiency={"*": 0.5}),
    # the shape of the fits in benchmarks/results/hetero.md: small GEMMs lose efficiency (Sailor's
    # n_half 1517 tokens/device), collectives reach 78 % / 95 % of the links, 3.9 GB beside the
    # model; the per-kind peaks stay at 0.5 (the fits' per-kind e_max are for fp32 / one framework)
    "small-gemm": Framework(
        efficiency={"*": 0.5}, half_tokens=1517, network_efficiency=0.78, intra_efficiency=0.95, overhead=3.9e9
    ),
}
METIS_VARIANCE = 1.0  # its README's example run; its code's default is 0.5 (--metis-variance)
PRECISION = "fp16"  # every kind here has fp16 tensor cores; V100, T4 and Turing have no bf16


def _row(prefix: str) -> dict:
    return next(r for r in json.loads(DATA.read_text()) if r["id"].startswith(prefix))


def _published_cluster(prefix: str) -> Cluster:
    """The cluster of a published run as benchmarks/hetero_validate.py describes it (AMP's AWS
    links as AMP models them, Sailor's measured MIT links)."""
    import hetero_validate

    return hetero_validate._cluster(_row(prefix))


def _cluster(inventory: dict[str, int], per_node: int = 8, inter_GBps: float = 25.0) -> Cluster:
    """Cluster.from_inventory, plus kinds missing from the catalogue (EXTRA)."""
    nodes = []
    for name, count in inventory.items():
        kind = EXTRA.get(name) or device_kind(name)
        full, rest = divmod(count, per_node)
        node = Node(kind, per_node, kind.nvlink or kind.pcie, inter_GBps * GB)
        nodes += [node] * full + ([Node(kind, rest, node.intra, node.inter)] if rest else [])
    return Cluster(tuple(nodes))


CLUSTERS: dict[str, Callable[[], Cluster]] = {
    "AMP 12xV100-16GB + 4xT4": lambda: _published_cluster("amp-hetcluster-trial00"),
    "Sailor MIT 16x2080Ti + 8x3090 + 8xTitan": lambda: _published_cluster("sailor-mit-opt350-plan_config_N4_D1"),
    "FlashFlex 8x3080Ti + 8x3090 + 24x4090": lambda: _cluster({"RTX-3080Ti": 8, "RTX-3090": 8, "RTX-4090": 24}),
    "FlashFlex 8x3080Ti + 8x3090 + 8x4090 + 8xA100-80GB": lambda: _cluster(
        {"RTX-3080Ti": 8, "RTX-3090": 8, "RTX-4090": 8, "A100-80GB": 8}
    ),
    "8xH100 + 8xA100-40GB": lambda: _cluster({"H100": 8, "A100-40GB": 8}),
    "16xA100-80GB + 16xV100-32GB": lambda: _cluster({"A100-80GB": 16, "V100-32GB": 16}),
}


# ---------------------------------------------------------------------------------------------
# shared pieces


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def devices_in_order(cluster: Cluster, kind_order: Sequence[str] | None = None) -> list[tuple[str, int]]:
    """Every device as (kind, node index), nodes in the cluster's order or grouped by
    ``kind_order`` (a hostfile listing those kinds' nodes first)."""
    nodes = list(enumerate(cluster.nodes))
    if kind_order is not None:
        nodes.sort(key=lambda item: list(kind_order).index(item[1].kind.name))
    return [(node.kind.name, i) for i, node in nodes for _ in range(node.devices)]


def block_kind(devs: list[tuple[str, int]], start: int, size: int) -> str | None:
    """The kind of devices [start, start + size), or None where they span nodes (a tensor-parallel
    group must sit inside one node)."""
    block = devs[start : start + size]
    return block[0][0] if len({node for _, node in block}) == 1 else None


def layer_seconds(costs: StageCosts, kind: str, tp: int) -> float:
    """One transformer layer's forward and backward on one micro-batch (the simulator's own
    per-layer cost: what a profile of that kind at that tp would measure)."""
    st = Stage(kind, tp, 1)
    return costs.forward(st, False, False) + costs.backward(st, False, False)


def head_seconds(costs: StageCosts, kind: str, tp: int) -> float:
    st = Stage(kind, tp, 0)
    return costs.forward(st, False, True) + costs.backward(st, False, True)


def largest_remainder(total: int, weights: Sequence[float], floor: int = 1) -> list[int]:
    """``total`` split in proportion to ``weights``, each part at least ``floor``."""
    n = len(weights)
    rest = total - floor * n
    if rest < 0:
        return []
    exact = [rest * w / sum(weights) for w in weights]
    parts = [int(x) for x in exact]
    order = sorted(range(n), key=lambda i: exact[i] - parts[i], reverse=True)
    for i in order[: rest - sum(parts)]:
        parts[i] += 1
    return [p + floor for p in parts]


def minmax_split(stage_cost: Callable[[int, int], float], layers: int, stages: int) -> list[int]:
    """The contiguous split of ``layers`` over ``stages`` minimising the largest stage cost (ties:
    the smaller sum); ``stage_cost(s, n)`` is stage s holding n layers."""
    best = {0: (0.0, 0.0, ())}
    for s in range(stages):
        nxt: dict[int, tuple] = {}
        for j, (mx, sm, split) in best.items():
            lo = 1 if s < stages - 1 else layers - j
            for n in range(lo, layers - j - (stages - 1 - s) + 1):
                c = stage_cost(s, n)
                cand = (max(mx, c), sm + c, (*split, n))
                if j + n not in nxt or cand[:2] < nxt[j + n][:2]:
                    nxt[j + n] = cand
        best = nxt
    return list(best[layers][2])


class Keeper:
    """Prices every plan a planner proposes by the shared simulator's arithmetic and keeps the
    fastest that fits (and the fastest overall, for a planner none of whose plans fits).

    The per-stage costs are memoised (``StageCosts``, the simulator's own pieces, summed as
    :func:`simulate` sums them); the plans kept are priced again by :func:`simulate` itself."""

    def __init__(self, model: Transformer, cluster: Cluster, framework: Framework):
        self.model, self.cluster, self.fw = model, cluster, framework
        self.capacity = {n.kind.name: n.kind.memory for n in cluster.nodes}
        self.seen: dict[Plan, tuple[float, bool, list[float]]] = {}
        self.best: tuple[float, Plan] | None = None
        self.best_any: tuple[float, Plan] | None = None
        self._costs: dict = {}
        self._memo: dict = {}

    def costs(self, b: int, remat: bool) -> StageCosts:
        got = self._costs.get((b, remat))
        if got is None:
            got = self._costs[(b, remat)] = StageCosts(self.model, self.cluster, Plan((), b, PRECISION, remat), self.fw)
        return got

    def layer(self, b: int, remat: bool, kind: str, tp: int) -> float:
        return self._cached(("l", b, remat, kind, tp), lambda: layer_seconds(self.costs(b, remat), kind, tp))

    def head(self, b: int, remat: bool, kind: str, tp: int) -> float:
        return self._cached(("h", b, remat, kind, tp), lambda: head_seconds(self.costs(b, remat), kind, tp))

    def _cached(self, key, fn):
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = fn()
        return got

    def price(self, plan: Plan) -> tuple[float, bool, list[float]]:
        """(seconds, fits, per stage the largest memory of its replicas over its kind's capacity)."""
        got = self.seen.get(plan)
        if got is not None:
            return got
        c = self.costs(plan.micro_batch, plan.remat)
        key0 = (plan.micro_batch, plan.remat)
        p = len(plan.pipelines[0].stages)
        slowest, use = 0.0, [0.0] * p
        for pipe in plan.pipelines:
            works = []
            for i, st in enumerate(pipe.stages):
                first, last = i == 0, i == p - 1
                works.append(
                    self._cached(
                        ("w", key0, st, first, last, p > 1),
                        lambda st=st, first=first, last=last: (
                            c.forward(st, first, last) + c.backward(st, first, last) + 2 * c.hop(st) * (p > 1)
                        ),
                    )
                )
                in_flight = min(pipe.microbatches, p - i)
                mem = self._cached(
                    ("m", key0, st, i, p, in_flight),
                    lambda st=st, i=i, in_flight=in_flight: c.memory(st, i, Pipeline((st,) * p, in_flight)),
                )
                use[i] = max(use[i], mem / self.capacity[st.kind])
            slowest = max(slowest, sum(works) + (pipe.microbatches - 1) * max(works))
        sync = 0.0
        for s in range(p):
            replicas = tuple(pipe.stages[s] for pipe in plan.pipelines)
            first, last = s == 0, s == p - 1

            def one(replicas=replicas, first=first, last=last):
                update = max(c.update(r, first, last) for r in replicas)
                return c.gradient_sync(list(replicas), first, last) + update

            sync = max(sync, self._cached(("s", key0, replicas, first, last), one))
        seconds, fits = slowest + sync, max(use) <= 1
        got = self.seen[plan] = (seconds, fits, use)
        if fits and (self.best is None or seconds < self.best[0]):
            self.best = (seconds, plan)
        if self.best_any is None or seconds < self.best_any[0]:
            self.best_any = (seconds, plan)
        return got

    def offer(self, plan: Plan) -> tuple[float, bool]:
        return self.price(plan)[:2]

    def memory(self, plan: Plan) -> list[float]:
        return self.price(plan)[2]


def _plan(columns: list[list[tuple[str, int]]], split: Sequence[int], counts: Sequence[int], b: int, remat: bool):
    """A Plan from per stage, per pipeline (kind, tp) and a layer split shared by the pipelines."""
    d = len(columns[0])
    pipes = tuple(
        Pipeline(tuple(Stage(k, t, n) for (k, t), n in zip((col[i] for col in columns), split, strict=True)), m)
        for i, m in zip(range(d), counts, strict=True)
    )
    return Plan(pipes, b, PRECISION, remat)


# ---------------------------------------------------------------------------------------------
# AMP


def amp(keeper: Keeper, global_batch: int, *, kind_aware: bool = False, remat_options=(False, True)) -> int:
    """AMP's search without placement (its het_cluster.py / sa.py): every uniform (mp, dp, pp)
    with mp a divisor of the GPUs per node and dp a divisor of the rest dividing the batch,
    pp = devices / (mp · dp), every micro-batch size dividing the per-replica batch. Ranks are laid
    out Megatron/DeepSpeed's way, rank = (stage · dp + replica) · mp + tp-rank, over the devices in
    hostfile order, so which kind a stage runs on follows from the degrees. The layer partition is
    AMP's dynamic programme over per-layer costs (minimise (B - 1) · the slowest stage + the sum,
    the sends being the same at every cut); B = 1 takes the uniform split, as AMP does. AMP
    profiles each layer on each kind and prices a layer on a mixed cluster as the device-count
    weighted mean of the kinds (0.75 · V100 + 0.25 · T4 in its experiment): that is the default;
    ``kind_aware`` prices each stage on its own kinds (its slowest replica) instead.
    Returns the number of plans priced."""
    model, cluster = keeper.model, keeper.cluster
    devs = devices_in_order(cluster)
    n_dev, L = len(devs), model.n_layers
    share = {k: c / n_dev for k, c in cluster.inventory().items()}
    priced = 0
    for mp in [t for t in (1, 2, 4, 8) if all(n.devices % t == 0 for n in cluster.nodes)]:
        for dp in [w for w in divisors(n_dev // mp) if global_batch % w == 0]:
            pp = n_dev // (mp * dp)
            if pp > L:
                continue
            columns = [[(devs[(s * dp + r) * mp][0], mp) for r in range(dp)] for s in range(pp)]
            for b in divisors(global_batch // dp):
                B = global_batch // (dp * b)
                for remat in remat_options:
                    if kind_aware:
                        per = [max(keeper.layer(b, remat, k, mp) for k, _ in col) for col in columns]
                        head = max(keeper.head(b, remat, k, mp) for k, _ in columns[-1])
                    else:
                        blended = sum(w * keeper.layer(b, remat, k, mp) for k, w in share.items())
                        per = [blended] * pp
                        head = sum(w * keeper.head(b, remat, k, mp) for k, w in share.items())
                    if B == 1:
                        split = [L // pp + (s < L % pp) for s in range(pp)]
                    else:
                        split = minmax_split(lambda s, n: n * per[s] + (head if s == pp - 1 else 0.0), L, pp)
                    keeper.offer(_plan(columns, split, [B] * dp, b, remat))
                    priced += 1
    return priced


# ---------------------------------------------------------------------------------------------
# Metis


def _stage_group_orders(n_dev: int, stages: int, variance: float, max_permute_len: int) -> list[tuple[int, ...]]:
    """Metis's device groups: per stage a power-of-two number of devices, summing to every
    device, none smaller than ``variance`` · devices / stages; the orders of a multiset are
    permuted after merging equal smallest groups until at most ``max_permute_len`` remain."""
    low = max(n_dev // stages, stages // n_dev) * variance
    shapes = [s for s in pow2_upto(n_dev) if s >= low]
    out = []

    def multisets(left: int, count: int, smallest: int, acc: tuple[int, ...]):
        if count == 0:
            if left == 0:
                yield acc
            return
        for s in shapes:
            if s < smallest or s * count > left:
                continue
            if shapes[-1] * count < left:
                continue
            yield from multisets(left - s, count - 1, s, (*acc, s))

    for ms in multisets(n_dev, stages, 0, ()):
        groups = [(s,) for s in ms]
        while len(groups) > max_permute_len:
            smallest = min(sum(g) for g in groups)
            equal = [i for i, g in enumerate(groups) if sum(g) == smallest]
            if len(equal) < 2:
                break
            i, j = equal[0], equal[1]
            groups = [g for k, g in enumerate(groups) if k not in (i, j)] + [groups[i] + groups[j]]
            groups.sort(key=sum)
        for perm in set(itertools.permutations(groups)):
            out.append(tuple(s for g in perm for s in g))
    return sorted(set(out))


def metis(
    keeper: Keeper,
    global_batch: int,
    *,
    variance: float = 1.0,
    max_permute_len: int = 4,
    max_tp: int = 8,
    max_bs: int = 16,
    remat_options=(False, True),
) -> int:
    """Metis's inter-stage / intra-stage search (its search_space/plan.py, device_group.py and
    model/load_balancer.py): the node order (every permutation of the kinds; devices follow the
    hostfile in that order), a number of stages, each stage a power-of-two group of consecutive
    devices (Metis's variance and permutation-length pruning, at the values of its README's example
    run: SCALE_VARIANCE=1, MAX_PERMUTE_LEN=4), a number of micro-batches dividing
    the batch, per stage a (dp, tp) with dp · tp its group, and the layers split in proportion to
    each stage's compute (the sum of its replicas' speeds), re-split with a memory-short stage's
    share cut (capacity / demand · 0.9) up to three times.

    Simplified to fit shardflow's plans: every stage has the same dp (a stage's replicas are the
    pipelines), so dp runs over the powers of two dividing every group (Metis grows tp from 1 per
    stage where memory is short; this enumerates all such dp instead, a superset of what is
    representable). Micro-batch sizes are the profiled ones, powers of two up to ``max_bs`` (Metis
    takes the sizes it has profiles for). Metis splits a mixed stage's micro-batch over its replicas by their speed; a
    replica here is a whole pipeline, so two candidates are priced: uniform micro-batch counts,
    and counts in proportion to each pipeline's speed (its slowest stage). Returns plans priced."""
    model, cluster = keeper.model, keeper.cluster
    kinds = list(cluster.inventory())
    n_dev, L = cluster.size, model.n_layers
    node_width = {k: max(n.devices for n in cluster.nodes if n.kind.name == k) for k in kinds}
    priced = 0
    orders_by_stages = {
        S: _stage_group_orders(n_dev, S, variance, max_permute_len) for S in range(1, min(n_dev, L) + 1)
    }
    for kind_order in itertools.permutations(kinds):
        devs = devices_in_order(cluster, kind_order)
        for S, group_orders in orders_by_stages.items():
            for groups in group_orders:
                offsets = [sum(groups[:s]) for s in range(S)]
                for dp in [d for d in pow2_upto(min(groups)) if global_batch % d == 0]:
                    columns = []
                    for s in range(S):
                        tp = groups[s] // dp
                        col = [block_kind(devs, offsets[s] + r * tp, tp) for r in range(dp)]
                        if None in col or tp > max_tp or any(tp > node_width[k] for k in col):
                            break
                        columns.append([(k, tp) for k in col])
                    if len(columns) < S:
                        continue
                    for b in [b for b in pow2_upto(max_bs) if (global_batch // dp) % b == 0]:
                        batches = global_batch // (dp * b)
                        for remat in remat_options:
                            priced += _metis_candidate(keeper, columns, batches, b, remat)
    return priced


def _metis_candidate(keeper: Keeper, columns, batches: int, b: int, remat: bool) -> int:
    model = keeper.model
    speed = [sum(1 / keeper.layer(b, remat, k, t) for k, t in col) for col in columns]
    dp, S = len(columns[0]), len(columns)
    if S > model.n_layers:
        return 0
    priced = 0
    for _attempt in range(3):
        split = largest_remainder(model.n_layers, speed)
        plan = _plan(columns, split, [batches] * dp, b, remat)
        keeper.offer(plan)
        priced += 1
        if dp > 1:  # Metis's data balancer, per pipeline: micro-batches in proportion to its speed
            slowest = [max(split[s] * keeper.layer(b, remat, *columns[s][i]) for s in range(S)) for i in range(dp)]
            counts = largest_remainder(batches * dp, [1 / t for t in slowest])
            if counts and counts != [batches] * dp:
                keeper.offer(_plan(columns, split, counts, b, remat))
                priced += 1
        use = keeper.memory(plan)
        if max(use) <= 1:
            break
        speed = [v * (0.9 / u if u > 1 else 1.0) for v, u in zip(speed, use, strict=True)]
    return priced


# ---------------------------------------------------------------------------------------------
# FlashFlex


def flashflex(keeper: Keeper, global_batch: int, *, remat_options=(False, True), refine_rounds: int = 20) -> int:
    """FlashFlex / HexiScale's search (its experimental/partitioner.py, layer_partition.py,
    main.py): the devices are graph-partitioned into pipelines balancing compute (METIS, vertex
    weight = a device's tensor-core rate), each pipeline's devices partitioned into stages
    (tensor-parallel groups over fast links), the layers split in proportion to each stage's
    memory (a stage that then runs out of memory fails the plan), every pipeline running the same
    number of micro-batches; an outer loop moves the number of pipelines and re-partitions,
    keeping the fastest.

    Simplified: a stage is a tensor-parallel group of one kind inside one node, one width per kind
    (tried over every combination); the first phase is a compute-balanced assignment of those
    groups to pipelines of equal length (largest first to the least-loaded pipeline that has room)
    for every number of pipelines dividing the groups, rather than METIS with random moves of the
    pipeline count; inside a pipeline stages are ordered by kind (the path through fast links keeps
    a node's stages adjacent); all pipelines share one layer split (shardflow's plans), in
    proportion to each stage position's memory summed over the pipelines; the refinement is a hill
    climb swapping two groups of different kinds between pipelines while the simulated step gets
    faster. Returns plans priced."""
    model, cluster = keeper.model, keeper.cluster
    kinds = list(cluster.inventory())
    memory = {n.kind.name: n.kind.memory for n in cluster.nodes}
    rate = {n.kind.name: n.kind.flops(PRECISION) for n in cluster.nodes}
    rank = {k: (-memory[k], -rate[k]) for k in kinds}
    L = model.n_layers
    priced = 0
    widths = [
        [t for t in (1, 2, 4, 8) if any(n.devices >= t for n in cluster.nodes if n.kind.name == k)] for k in kinds
    ]
    for tps in itertools.product(*widths):
        tp_of = dict(zip(kinds, tps, strict=True))
        units = [n.kind.name for n in cluster.nodes for _ in range(n.devices // tp_of[n.kind.name])]
        units.sort(key=lambda k: -rate[k] * tp_of[k])
        for d in [d for d in divisors(len(units)) if len(units) // d <= L and d <= global_batch]:
            p = len(units) // d
            pipes: list[list[str]] = [[] for _ in range(d)]
            load = [0.0] * d
            for k in units:
                i = min((i for i in range(d) if len(pipes[i]) < p), key=lambda i: load[i])
                pipes[i].append(k)
                load[i] += rate[k] * tp_of[k]

            def build(pipes, b, remat):
                ordered = [sorted(pipe, key=lambda k: rank[k]) for pipe in pipes]
                columns = [[(ordered[i][s], tp_of[ordered[i][s]]) for i in range(d)] for s in range(p)]
                mem = [sum(memory[k] * t for k, t in col) for col in columns]
                split = largest_remainder(L, mem)
                return _plan(columns, split, [global_batch // (d * b)] * d, b, remat)

            best = None
            for b in divisors(global_batch // d):
                for remat in remat_options:
                    seconds, fits = keeper.offer(build(pipes, b, remat))
                    priced += 1
                    if fits and (best is None or seconds < best[0]):
                        best = (seconds, b, remat)
            if best is None:
                continue
            seconds, b, remat = best
            for _round in range(refine_rounds):
                improved = None
                for i, j in itertools.combinations(range(d), 2):
                    for ki, kj in itertools.product(set(pipes[i]), set(pipes[j])):
                        if ki == kj:
                            continue
                        trial = [list(pp) for pp in pipes]
                        trial[i].remove(ki)
                        trial[j].remove(kj)
                        trial[i].append(kj)
                        trial[j].append(ki)
                        got, fits = keeper.offer(build(trial, b, remat))
                        priced += 1
                        if fits and got < seconds * (1 - 1e-9) and (improved is None or got < improved[0]):
                            improved = (got, trial)
                if improved is None:
                    break
                seconds, pipes = improved
    return priced


# ---------------------------------------------------------------------------------------------


def describe(plan: Plan) -> str:
    shapes = [" ".join(f"{s.kind}x{s.tp}" for s in p.stages) for p in plan.pipelines]
    grouped = "; ".join(f"{len(list(g))} x [{shape}]" for shape, g in itertools.groupby(shapes))
    layers = "/".join(str(s.layers) for s in plan.pipelines[0].stages)
    counts = ",".join(str(p.microbatches) for p in plan.pipelines)
    return f"{grouped} | layers {layers} | micro-batches {counts} of {plan.micro_batch} | remat {plan.remat}"


PLANNERS = {
    "AMP": lambda k, gb: amp(k, gb),
    "AMP-kind-aware": lambda k, gb: amp(k, gb, kind_aware=True),
    "Metis": lambda k, gb: metis(k, gb, variance=METIS_VARIANCE),
    "FlashFlex": flashflex,
}


def compare(cluster_name: str, model_name: str, framework_name: str) -> dict:
    cluster = CLUSTERS[cluster_name]()
    model, global_batch = MODELS[model_name]
    fw = FRAMEWORKS[framework_name]
    tokens = global_batch * model.seq_len
    row = dict(cluster=cluster_name, inventory=cluster.inventory(), model=model_name, global_batch=global_batch)
    row.update(framework=framework_name, seq_len=model.seq_len, metis_variance=METIS_VARIANCE, planners={})
    start = time.perf_counter()
    try:
        result = search(model, cluster, global_batch, fw, precision=PRECISION, top=1, max_seconds=60)
        best = result.best
        ours = dict(tokens_per_second=best.tokens_per_second, seconds=best.seconds, fits=True)
        ours.update(plan=describe(best.plan), complete=result.complete)
    except ValueError as e:
        ours = dict(tokens_per_second=None, seconds=None, fits=False, plan=str(e), complete=True)
    ours["search_seconds"] = time.perf_counter() - start
    row["planners"]["ours"] = ours
    for name, planner in PLANNERS.items():
        keeper = Keeper(model, cluster, fw)
        start = time.perf_counter()
        priced = planner(keeper, global_batch)
        elapsed = time.perf_counter() - start
        chosen = keeper.best or keeper.best_any
        entry = dict(priced=priced, search_seconds=elapsed, fits=keeper.best is not None)
        if chosen is None:
            entry.update(tokens_per_second=None, seconds=None, plan="no candidate")
        else:
            pred = simulate(model, cluster, chosen[1], fw)  # the kept plan, priced by simulate itself
            assert abs(pred.seconds / chosen[0] - 1) < 1e-9, (pred.seconds, chosen[0])
            peak = max(
                m / keeper.capacity[s.kind]
                for p, ms in zip(chosen[1].pipelines, pred.memory)
                for s, m in zip(p.stages, ms)
            )
            assert (peak <= 1) == entry["fits"]
            entry.update(tokens_per_second=tokens / pred.seconds, seconds=pred.seconds, plan=describe(chosen[1]))
            entry.update(peak_memory_fraction=peak)
        row["planners"][name] = entry
    fitting = [v["tokens_per_second"] for k, v in row["planners"].items() if k != "ours" and v["fits"]]
    best_baseline = max(fitting, default=None)
    row["ratio_to_best_baseline"] = (
        None
        if best_baseline is None or ours["tokens_per_second"] is None
        else ours["tokens_per_second"] / best_baseline
    )
    return row


def table(rows: list[dict]) -> str:
    names = list(PLANNERS)
    head = ["framework", "cluster", "model (gbs)", "ours tok/s", *[f"{n} tok/s" for n in names], "ours / best baseline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(names) + 2)]

    def cell(v):
        if v["tokens_per_second"] is None:
            return "no plan"
        return f"{v['tokens_per_second']:,.0f}" + ("" if v["fits"] else " (OOM)")

    for r in rows:
        ratio = r["ratio_to_best_baseline"]
        cells = [r["framework"], r["cluster"], f"{r['model']} ({r['global_batch']})", cell(r["planners"]["ours"])]
        cells += [cell(r["planners"][n]) for n in names]
        cells.append("-" if ratio is None else f"{ratio:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=[*FRAMEWORKS, "both"], default="both")
    ap.add_argument("--clusters", nargs="*", default=list(CLUSTERS))
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--metis-variance", type=float, default=1.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    global METIS_VARIANCE
    METIS_VARIANCE = args.metis_variance
    frameworks = list(FRAMEWORKS) if args.framework == "both" else [args.framework]
    rows = []
    for fw in frameworks:
        for c in args.clusters:
            for m in args.models:
                row = compare(c, m, fw)
                rows.append(row)
                times = ", ".join(f"{k} {v['search_seconds']:.1f}s" for k, v in row["planners"].items())
                print(f"{fw:10s} {c:48s} {m:13s} ratio {row['ratio_to_best_baseline']}  ({times})", flush=True)
    print()
    print(table(rows))
    if args.out:
        _results.write_json(
            args.out,
            rows,
            frameworks={k: repr(v) for k, v in FRAMEWORKS.items() if k in frameworks},
            precision=PRECISION,
        )


if __name__ == "__main__":
    sys.exit(main())
