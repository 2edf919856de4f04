"""A planner for heterogeneous clusters: search the plans :func:`~shardflow.hetero.simulate.simulate`
prices and return the fastest that fit in every device's memory.

The plan space is the literature's batch distribution over pipelines (Oobleck, AMP, Whale) with
stages of mixed kinds inside a pipeline (HetPipe, FlashFlex):

- a depth ``p`` and per device kind a tensor-parallel width ``tp`` (a power of two within one of
  its nodes; one width per kind in a plan) or "unused"; the kind then offers ``slots`` stages:
  its tp-groups that fit inside its nodes;
- ``d`` pipelines of ``p`` stages, each stage one kind. Where the choices are few (small clusters)
  every multiset of pipelines' kind sequences within the slots is tried; otherwise per kind a
  number of stages used (all its slots, the largest multiple of ``p``, or ``p`` times a power of
  two) laid out two ways: as many single-kind pipelines as go plus the remainders chained into
  mixed ones, or every kind's stages dealt evenly over the pipelines (mixed pipelines alike);
  inside a mixed pipeline any kind first and any kind last (the ends hold the embedding and the
  head), the rest with more memory first (an earlier stage keeps more micro-batches in flight);
- one layer split shared by all pipelines, by dynamic programming over layers (AMP, HetPipe):
  minimise the largest per-micro-batch time of any stage in any pipeline given its kind and tp
  (and its memory), then a hill climb moving one layer at a time on the predicted step time;
- micro-batch counts per pipeline summing to ``global_batch / micro_batch``, each at least one,
  handed out one at a time to the pipeline that would finish soonest (which is optimal for the
  slowest pipeline's time, the simulator's step), within what its memory allows;
- micro-batch sizes dividing the global batch, recomputation on or off.

Candidates are visited best-first by a lower bound on their step time (each pipeline's layers
split in proportion to its stages' speeds, plus the all-reduce and optimizer step of the layers
split likewise) and the visit stops once the bound passes the ``top``-th best found or
``max_seconds`` runs out (``Result.complete`` says which). Costs come from the simulator's own
per-stage arithmetic, and every plan returned is priced again by :func:`simulate`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Iterable, Sequence

from shardflow.hetero.cluster import Cluster
from shardflow.hetero.simulate import Framework, Pipeline, Plan, Prediction, Stage, StageCosts, Transformer, simulate

INF = float("inf")
# every multiset of kind sequences is tried while a (depth, tp per kind) has at most this many
EXHAUSTIVE_LAYOUTS = 400
# once the pool is full, a layer split the dynamic programme finds this much slower than the pool's
# slowest is not hill-climbed
REFINE_SLACK = 0.1


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A plan, its prediction, its tokens per second and the largest predicted memory of any
    device per kind (bytes)."""

    plan: Plan
    prediction: Prediction
    tokens_per_second: float
    peak_memory: dict[str, float]

    @property
    def seconds(self) -> float:
        return self.prediction.seconds


@dataclasses.dataclass(frozen=True)
class Result:
    """The best plans found, fastest first; ``complete`` is False where ``max_seconds`` ran out
    before the search bound closed. ``costed``: layer splits priced; ``simulate_calls``: plans
    handed to :func:`simulate`."""

    candidates: tuple[Candidate, ...]
    complete: bool
    costed: int
    simulate_calls: int
    elapsed: float
    capacity: dict[str, float]  # per kind, bytes of memory

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def format(self) -> str:
        rows = [("#", "pipelines (stage kind x tp)", "layers", "micro-batches", "mb", "remat", "s/step", "tokens/s")]
        kinds = list(self.capacity)
        rows[0] += tuple(f"peak {k} GB" for k in kinds)
        for n, c in enumerate(self.candidates, 1):
            plan = c.plan
            shapes = [" ".join(f"{s.kind}x{s.tp}" for s in p.stages) for p in plan.pipelines]
            grouped = [f"{len(list(g))} x [{shape}]" for shape, g in itertools.groupby(shapes)]
            layers = "/".join(str(s.layers) for s in plan.pipelines[0].stages)
            micro = ",".join(str(p.microbatches) for p in plan.pipelines)
            row = (str(n), "; ".join(grouped), layers, micro, str(plan.micro_batch), "on" if plan.remat else "off")
            row += (f"{c.seconds:.4g}", f"{c.tokens_per_second:,.0f}")
            row += tuple(
                f"{c.peak_memory[k] / 1e9:.1f}/{self.capacity[k] / 1e9:.0f}" if k in c.peak_memory else "-"
                for k in kinds
            )
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        state = "complete" if self.complete else "stopped at max_seconds"
        lines.append(f"({self.costed} splits costed, {self.simulate_calls} simulated, {self.elapsed:.1f} s, {state})")
        return "\n".join(lines)

    __str__ = format


class _Prices:
    """The simulator's per-stage costs under one (micro_batch, remat), memoised."""

    def __init__(self, model: Transformer, cluster: Cluster, framework: Framework, b: int, precision: str, remat: bool):
        self.costs = StageCosts(model, cluster, Plan((), b, precision, remat), framework)
        self.capacity = {n.kind.name: n.kind.memory for n in cluster.nodes}
        self._work: dict = {}
        self._mem: dict = {}
        self._sync: dict = {}
        self._rows: dict = {}
        self._pipelines: dict = {}
        self._rates: dict = {}
        self._sync_per_layer: dict = {}

    def work(self, kind: str, tp: int, layers: int, s: int, p: int) -> float:
        """A stage's forward, backward and sends for one micro-batch, as simulate sums them."""
        key = (kind, tp, layers, s == 0, s == p - 1, p > 1)
        got = self._work.get(key)
        if got is None:
            st, first, last = Stage(kind, tp, layers), s == 0, s == p - 1
            c = self.costs
            got = c.forward(st, first, last) + c.backward(st, first, last) + 2 * c.hop(st) * (p > 1)
            self._work[key] = got
        return got

    def fits(self, kind: str, tp: int, layers: int, s: int, p: int, microbatches: int) -> bool:
        in_flight = min(microbatches, p - s)
        key = (kind, tp, layers, s == 0, s == p - 1, p, in_flight)
        got = self._mem.get(key)
        if got is None:
            st = Stage(kind, tp, layers)
            got = self.costs.memory(st, s, Pipeline((st,) * p, in_flight)) <= self.capacity[kind]
            self._mem[key] = got
        return got

    def rates(self, pipe: tuple[tuple[str, int], ...]) -> tuple[float, float]:
        """A pipeline's time per layer at its fastest stage, and with the layers split in
        proportion to its stages' speeds (what one more layer adds to a middle stage)."""
        got = self._rates.get(pipe)
        if got is None:
            per_layer = [self.work(k, t, 2, 1, 3) - self.work(k, t, 1, 1, 3) for k, t in pipe]
            got = self._rates[pipe] = min(per_layer), 1 / sum(1 / c for c in per_layer)
        return got

    def pipeline(self, pipe: tuple[tuple[str, int], ...], split: Sequence[int]):
        """A pipeline's first micro-batch through, its slowest stage's time a micro-batch and the
        most micro-batches it holds (INF: as many as it has stages, so any), or None where not one
        fits."""
        key = (pipe, tuple(split))
        if key in self._pipelines:
            return self._pipelines[key]
        p = len(split)
        works = [self.work(k, t, split[s], s, p) for s, (k, t) in enumerate(pipe)]
        most = 0
        for m in range(1, p + 1):
            if not all(self.fits(k, t, split[s], s, p, m) for s, (k, t) in enumerate(pipe)):
                break
            most = m
        got = self._pipelines[key] = (sum(works), max(works), INF if most == p else most) if most else None
        return got

    def stage_times(self, column: tuple[tuple[str, int], ...], s: int, p: int, in_flight: int, most: int):
        """Stage ``s``'s largest work over its replicas ``column`` holding 1, 2, ... layers, up to
        ``most`` or the first that does not fit with ``in_flight`` micro-batches."""
        key = (column, s == 0, s == p - 1, p, min(in_flight, p - s), most)
        got = self._rows.get(key)
        if got is None:
            row = []
            for n in range(1, most + 1):
                if not all(self.fits(k, t, n, s, p, in_flight) for k, t in column):
                    break  # more layers only take more memory
                row.append(max(self.work(k, t, n, s, p) for k, t in column))
            got = self._rows[key] = tuple(row)
        return got

    def sync_per_layer(self, replicas: tuple[tuple[str, int], ...]) -> float:
        """What one more layer adds to a middle stage's all-reduce and optimizer step."""
        got = self._sync_per_layer.get(replicas)
        if got is None:
            one, two = (self.sync(tuple(Stage(k, t, n) for k, t in replicas), 1, 3) for n in (1, 2))
            got = self._sync_per_layer[replicas] = two - one
        return got

    def sync(self, replicas: tuple[Stage, ...], s: int, p: int) -> float:
        key = (replicas, s == 0, s == p - 1)
        got = self._sync.get(key)
        if got is None:
            first, last = s == 0, s == p - 1
            update = max(self.costs.update(r, first, last) for r in replicas)
            got = self.costs.gradient_sync(list(replicas), first, last) + update
            self._sync[key] = got
        return got


Layout = tuple[tuple[tuple[str, int], ...], ...]  # per pipeline, per stage: (kind, tp)


def _distribute(prices: _Prices, layout: Layout, split: Sequence[int], total: int):
    """The step's predicted seconds and the micro-batch counts for ``split``, or None where it
    does not fit: each pipeline one micro-batch, the rest one at a time to the pipeline that
    would finish soonest and still fits; under an SPMD pipeline, as evenly as they go."""
    p, d = len(split), len(layout)
    if total < d:
        return None
    first, step, cap = [], [], []
    for pipe in layout:
        got = prices.pipeline(pipe, split)
        if got is None:
            return None
        f, b, c = got
        first.append(f)
        step.append(b)
        cap.append(c)
    if prices.costs.fw.spmd_pipeline and p > 1:
        # One SPMD program: every pipeline runs the busiest one's count (its own past its count
        # computed as padding), so the counts go as evenly as they can, the extra ones to the
        # fastest pipelines.
        busiest = -(-total // d)
        if min(cap) < busiest:
            return None
        extra = set(sorted(range(d), key=lambda i: step[i])[: total - (busiest - 1) * d])
        counts = [busiest - (i not in extra) for i in range(d)]
        slowest = max(first[i] + (busiest - 1) * step[i] for i in range(d))
    else:
        counts = [1] * d
        left = total - d
        if sum(min(c, total) for c in cap) < total:
            return None
        heap = [(first[i] + step[i], i) for i in range(d) if cap[i] > 1]
        heapq.heapify(heap)
        while left:
            _, i = heapq.heappop(heap)
            counts[i] += 1
            left -= 1
            if counts[i] < cap[i]:
                heapq.heappush(heap, (first[i] + counts[i] * step[i], i))
        slowest = max(first[i] + (counts[i] - 1) * step[i] for i in range(d))
    sync = max(
        prices.sync(tuple(Stage(k, t, split[s]) for k, t in (pipe[s] for pipe in layout)), s, p) for s in range(p)
    )
    return slowest + sync, tuple(counts)


def _dp_split(prices: _Prices, layout: Layout, layers: int, in_flight: int):
    """The layer split minimising the largest per-micro-batch stage time over all pipelines (ties:
    the smaller sum), every stage fitting with ``in_flight`` micro-batches; None if none fits."""
    p = len(layout[0])
    table = []  # table[s][n - 1]: stage s's largest time holding n layers, up to the first that does not fit
    for s in range(p):
        row = prices.stage_times(tuple(sorted({pipe[s] for pipe in layout})), s, p, in_flight, layers - p + 1)
        if not row:
            return None
        table.append(row)
    # over the stages so far: for j layers held, the (largest, sum) of their times and the last's layers
    best_max, best_sum = [0.0] + [INF] * layers, [0.0] + [INF] * layers
    chosen = []
    held = range(1)  # the layer counts the stages so far can hold
    for s in range(p):
        row = table[s]
        new_max, new_sum, pick = [INF] * (layers + 1), [INF] * (layers + 1), [0] * (layers + 1)
        room = layers - (p - 1 - s)  # layers the stages so far may hold
        for j in held:
            mx, sm = best_max[j], best_sum[j]
            if mx == INF:
                continue
            for n in range(1 if s < p - 1 else layers - j, min(room - j, len(row)) + 1):
                c = row[n - 1]
                top, total = (mx if mx > c else c), sm + c
                if top < new_max[j + n] or (top == new_max[j + n] and total < new_sum[j + n]):
                    new_max[j + n], new_sum[j + n], pick[j + n] = top, total, n
        best_max, best_sum = new_max, new_sum
        chosen.append(pick)
        held = range(s + 1, room + 1)
    if best_max[layers] == INF:
        return None
    split, j = [], layers
    for pick in reversed(chosen):
        split.append(pick[j])
        j -= pick[j]
    return tuple(reversed(split))


def _refine(prices: _Prices, layout: Layout, split: tuple[int, ...], total: int, counter: list[int]):
    """Hill-climb the split by moving one layer between two stages while the step gets faster."""
    got = _distribute(prices, layout, split, total)
    counter[0] += 1
    if got is None:
        return None
    seconds, counts = got
    p = len(split)
    while True:
        improved = None
        for a, b in itertools.permutations(range(p), 2):
            if split[a] <= 1:
                continue
            trial = list(split)
            trial[a] -= 1
            trial[b] += 1
            trial = tuple(trial)
            other = _distribute(prices, layout, trial, total)
            counter[0] += 1
            if other is not None and other[0] < seconds * (1 - 1e-12) and (improved is None or other[0] < improved[0]):
                improved = (other[0], other[1], trial)
        if improved is None:
            return seconds, counts, split
        seconds, counts, split = improved


def _sequences(kinds: Sequence[tuple[str, int]], p: int) -> list[tuple[tuple[str, int], ...]]:
    return list(itertools.product(kinds, repeat=p))


def _all_layouts(kinds: Sequence[tuple[str, int]], slots: dict[str, int], p: int) -> Iterable[Layout]:
    """Every multiset of kind sequences that uses every kind in ``kinds`` within its slots."""
    seqs = _sequences(kinds, p)
    most = sum(slots[k] for k, _ in kinds) // p
    for d in range(1, most + 1):
        for layout in itertools.combinations_with_replacement(seqs, d):
            used = {}
            for pipe in layout:
                for k, _ in pipe:
                    used[k] = used.get(k, 0) + 1
            if len(used) == len(kinds) and all(used[k] <= slots[k] for k in used):
                yield layout


def _count_all_layouts(kinds: Sequence[tuple[str, int]], slots: dict[str, int], p: int) -> int:
    seqs = len(kinds) ** p
    most = sum(slots[k] for k, _ in kinds) // p
    return sum(math.comb(seqs + d - 1, d) for d in range(1, most + 1))


def _stage_orders(kinds: Sequence[tuple[str, int]], memory_rank) -> list[tuple[tuple[str, int], ...]]:
    """The orders a mixed pipeline's stages take by kind: every choice of the kinds at its two ends,
    the rest by memory, more first (an earlier stage keeps more micro-batches in flight). The ends
    differ most: the first holds the embedding and the most micro-batches, the last the head and
    its logits, so which kinds suit them depends on the model."""
    by_memory = sorted(kinds, key=memory_rank)
    orders = {tuple(by_memory): None}
    for first, last in itertools.permutations(by_memory, 2):
        orders[(first, *(kt for kt in by_memory if kt not in (first, last)), last)] = None
    return list(orders)


def _canonical_layouts(
    kinds: Sequence[tuple[str, int]], slots: dict[str, int], p: int, memory_rank
) -> Iterable[Layout]:
    """Per kind a number of stages used (all its slots, the largest multiple of p, p times a
    power of two), laid out as single-kind pipelines plus the remainders chained, or dealt evenly;
    the stages of mixed pipelines in each of :func:`_stage_orders`."""
    options = []
    for k, _ in kinds:
        s = slots[k]
        opts = {s, p * (s // p)} | {p * 2**i for i in range(s.bit_length()) if p * 2**i <= s}
        options.append(sorted(o for o in opts if o > 0))
    orders = _stage_orders(kinds, memory_rank)
    seen = set()
    for used in itertools.product(*options):
        total = sum(used)
        if total % p:
            continue
        count = dict(zip([k for k, _ in kinds], used, strict=True))
        d = total // p
        for ranked in orders:
            position = {kt: i for i, kt in enumerate(ranked)}
            flat = [kt for kt in ranked for _ in range(count[kt[0]])]
            # single-kind pipelines, then the remainders chained in this order
            pure = [tuple([kt] * p) for kt in ranked for _ in range(count[kt[0]] // p)]
            rest = [kt for kt in ranked for _ in range(count[kt[0]] % p)]
            mixed = [tuple(rest[i : i + p]) for i in range(0, len(rest), p)]
            dealt = [tuple(sorted(flat[i::d], key=position.__getitem__)) for i in range(d)]
            for layout in (pure + mixed, dealt):
                key = tuple(sorted(layout))
                if key not in seen:
                    seen.add(key)
                    yield key


def _bound(prices: _Prices, layout: Layout, layers: int, total: int) -> float:
    """A lower bound on the slowest pipeline, from each stage's time per layer (sends, embedding
    and head left out). A pipeline's slowest stage takes at least all layers split in proportion to
    its stages' speeds a micro-batch, so pipeline i doing m_i micro-batches takes at least m_i
    times that, and its first micro-batch at least all layers at its fastest stage."""
    rates = [prices.rates(pipe) for pipe in layout]
    return layers * max(max(fastest for fastest, _ in rates), total / sum(1 / balanced for _, balanced in rates))


def _sync_bound(prices: _Prices, layout: Layout, layers: int) -> float:
    """A lower bound on the step's gradient all-reduce and optimizer step (its slowest stage's): a
    stage's takes at least its layers times what one more layer adds to it (embedding and head left
    out), and the largest at least what the split that evens those out gives. The micro-batch and
    remat do not change it."""
    per_layer = [prices.sync_per_layer(tuple(pipe[s] for pipe in layout)) for s in range(len(layout[0]))]
    return layers / sum(1 / c for c in per_layer)


def _layouts(model: Transformer, cluster: Cluster) -> list:
    """Every (depth, tp per kind)'s pipeline layouts: each a tuple of pipelines, each a tuple of
    (kind, tp) stages, in the inventory's kind order, without repeats."""
    inventory = cluster.inventory()
    kinds = list(inventory)
    memory = {n.kind.name: n.kind.memory for n in cluster.nodes}
    rank = {k: (-memory[k], i) for i, k in enumerate(kinds)}
    memory_rank = lambda kt: rank[kt[0]]  # noqa: E731
    inv_rank = {k: i for i, k in enumerate(kinds)}
    widest = {k: max(n.devices for n in cluster.nodes if n.kind.name == k) for k in kinds}
    L = model.n_layers
    depths = sorted(
        {p for p in range(1, min(L, 8) + 1)} | {p for p in range(1, L + 1) if L % p == 0 or p & (p - 1) == 0}
    )
    depths = [p for p in depths if p <= sum(inventory.values())]

    def slots_of(k: str, t: int) -> int:
        return sum(n.devices // t for n in cluster.nodes if n.kind.name == k)

    layouts: list[Layout] = []
    for p in depths:
        widths = [[0] + [t for t in (1, 2, 4, 8) if t <= widest[k]] for k in kinds]
        for tps in itertools.product(*widths):
            used = [(k, t) for k, t in zip(kinds, tps, strict=True) if t]
            if not used:
                continue
            slots = {k: slots_of(k, t) for k, t in used}
            if sum(slots.values()) < p:
                continue
            if _count_all_layouts(used, slots, p) <= EXHAUSTIVE_LAYOUTS:
                some = _all_layouts(used, slots, p)
            else:
                some = _canonical_layouts(used, slots, p, memory_rank)
            for lay in some:  # pipelines in the inventory's kind order (simulate prices a sync by the first's tp)
                layouts.append(tuple(sorted(lay, key=lambda pipe: [inv_rank[k] for k, _ in pipe])))
    return list(dict.fromkeys(layouts))


def _fitting(model, cluster, framework, plans, global_batch) -> list[Candidate]:
    """``plans`` simulated, those whose every device fits its kind's memory, fastest first; a
    ValueError naming the cluster and the model where none does."""
    memory = {n.kind.name: n.kind.memory for n in cluster.nodes}
    candidates = []
    for plan in plans:
        prediction = simulate(model, cluster, plan, framework)
        peak: dict[str, float] = {}
        for pipe, mems in zip(plan.pipelines, prediction.memory, strict=True):
            for stage, mem in zip(pipe.stages, mems, strict=True):
                peak[stage.kind] = max(peak.get(stage.kind, 0.0), mem)
        if any(peak[k] > memory[k] for k in peak):
            continue
        tokens = plan.global_batch * model.seq_len / prediction.seconds
        candidates.append(Candidate(plan, prediction, tokens, peak))
    candidates.sort(key=lambda c: c.seconds)
    if not candidates:
        params = model.n_layers * model.layer_params + 2 * model.vocab_size * model.d_model
        state = framework.state_bytes * params
        what = ", ".join(f"{v} x {k} ({memory[k] / 1e9:.0f} GB)" for k, v in cluster.inventory().items())
        raise ValueError(
            f"search: no plan fits the model ({params / 1e9:.2f} B parameters, {state / 1e9:.0f} GB of weights,"
            f" gradients and optimizer state, {model.n_layers} layers) on the cluster {what}"
            f" at a global batch of {global_batch} x {model.seq_len} tokens"
        )
    return candidates


def search(
    model: Transformer,
    cluster: Cluster,
    global_batch: int,
    framework: Framework,
    *,
    precision: str = "bf16",
    remat_options: Sequence[bool] = (False, True),
    top: int = 5,
    max_seconds: float = 60.0,
) -> Result:
    """The ``top`` fastest plans found for ``global_batch`` sequences a step (see the module for
    the plan space), each with every device's predicted memory within its kind's; a ValueError
    naming the cluster and the model where no plan fits."""
    start = time.perf_counter()
    layouts, L = _layouts(model, cluster), model.n_layers
    prices = {
        (b, r): _Prices(model, cluster, framework, b, precision, r)
        for b in range(1, global_batch + 1)
        if global_batch % b == 0
        for r in remat_options
    }
    sync = [_sync_bound(next(iter(prices.values())), lay, L) for lay in layouts]
    queue = []
    for (b, r), pr in prices.items():
        total = global_batch // b
        for n, lay in enumerate(layouts):
            if len(lay) > total:
                continue
            p = len(lay[0])
            # every (kind, tp) must hold one layer at the last stage with one micro-batch in flight
            if not all(pr.fits(k, t, 1, p - 1, p, 1) for k, t in {kt for pipe in lay for kt in pipe}):
                continue
            queue.append((_bound(pr, lay, L, total) + sync[n], n, b, r))
    queue.sort()

    found: dict = {}  # plan -> seconds
    kept: list[tuple[float, Plan]] = []
    counter = [0]
    complete = True
    for bound, n, b, r in queue:
        if len(kept) >= top * 2 and bound >= kept[top * 2 - 1][0]:
            break
        if time.perf_counter() - start > max_seconds:
            complete = False
            break
        pr, lay, total = prices[(b, r)], layouts[n], global_batch // b
        p = len(lay[0])
        split = _dp_split(pr, lay, L, p) or _dp_split(pr, lay, L, 1)
        if split is None:
            continue
        if len(kept) >= top * 2:
            plain = _distribute(pr, lay, split, total)
            counter[0] += 1
            if plain is None or plain[0] > kept[top * 2 - 1][0] * (1 + REFINE_SLACK):
                continue  # a hill climb seldom gains this much
        got = _refine(pr, lay, split, total, counter)
        if got is None:
            continue
        seconds, counts, split = got
        plan = Plan(
            tuple(
                Pipeline(tuple(Stage(k, t, split[s]) for s, (k, t) in enumerate(pipe)), m)
                for pipe, m in zip(lay, counts, strict=True)
            ),
            b,
            precision,
            r,
        )
        if plan in found:
            continue
        found[plan] = seconds
        kept.append((seconds, plan))
        kept.sort(key=lambda x: x[0])
        del kept[top * 2 :]

    candidates = _fitting(model, cluster, framework, [plan for _, plan in kept], global_batch)
    memory = {n.kind.name: n.kind.memory for n in cluster.nodes}
    return Result(
        tuple(candidates[:top]),
        complete,
        counter[0],
        len(kept),
        time.perf_counter() - start,
        {k: memory[k] for k in cluster.inventory()},
    )


__all__ = ["Candidate", "Result", "search"]
