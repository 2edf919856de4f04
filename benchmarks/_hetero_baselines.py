"""The baselines of benchmarks/hetero_planners.py: AMP's, Metis's and FlashFlex's plan spaces
and searches, re-implemented compactly (what is simplified is said at each function and in
benchmarks/results/hetero_planners.md), each keeping the fastest plan that fits memory under
shardflow's simulator (``Keeper``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from shardflow.hetero.cluster import Cluster
from shardflow.hetero.simulate import Framework, Pipeline, Plan, Stage, StageCosts, Transformer

PRECISION = "fp16"  # every kind here has fp16 tensor cores; V100, T4 and Turing have no bf16


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
