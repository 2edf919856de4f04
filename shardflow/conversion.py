"""How to turn one NdSbp into another: a list of steps, each a collective or a local op.

``route(shape, dtype, src, dst, mesh)`` is the single source of truth for boxing, and
``seconds`` — the plan priced by the link model — the one pricer: propagation prices candidates
with it, the boxing pass stores the plan in the program, lowering runs it (``run``) and
``explain`` reports it. Per mesh axis:

  S(i) -> B      all_gather       (n-1)/n · T      (T: bytes of the tensor it produces)
  P    -> B      all_reduce       2(n-1)/n · T
  P    -> S(i)   reduce_scatter   (n-1)/n · T      (T: bytes of the tensor it reduces)
  S(i) -> S(j)   all_to_all       (n-1)/n · L      (L: local block)
  B    -> S(i)   slice            0
  B    -> P      mask             0  (value on index 0 of the axis, zeros elsewhere)
  S    -> P      pad              0  (own shard in place, zeros elsewhere)

For several axes the order is chosen to keep tensors small while they travel: local slices
first, then reductions that scatter, all_to_all, all_reduce, all_gather last. A dim split by
several axes is split in mesh order; a conversion that would break that order gathers the
minor axes first (correct, if not always cheapest). Axes of one device change for free.

That direct plan is not always the cheapest: (B, P) -> (B, B) all-reduces the whole tensor
over the second axis where slicing it over the first, all-reducing the half and gathering it
back moves 1.25 T instead of 1.5 T on {2, 4} devices, and (S(0), S(1)) -> (S(1), S(0)) gathers
twice where a gather and an all-to-all do. Priced by a link model, ``plan`` takes the
cheaper of the direct plan and the shortest route over the steps plans take — one mesh
axis changed, or several by one collective (a gather, all-reduce or reduce-scatter over them)
— (``_graph``: every NdSbp of the value's shape, all pairs by Floyd-Warshall, once per shape;
only where a value has at most ``ROUTED_LAYOUTS`` of them). Every step of a direct plan being
such a hop, the price is a shortest path: no chain of conversions is priced below the one.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from shardflow import registry
from shardflow.elementwise_primitives import SHAPE_KEEPING
from shardflow.specs import B, Broadcast, NdSbp, Partial, Split, as_dtype, axis_sizes, divides, local_shape

EPSILON = 1e-12  # seconds charged for a local step (slice, mask, pad): free, but not for nothing
ROUTED_LAYOUTS = 256  # layouts of a value beyond which conversions take the direct plan (Floyd-Warshall is cubic:
# a 4-D value on three mesh axes has 150-216, ~10 ms a shape; on four, up to 1,296)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")


class Step(NamedTuple):
    """One step of a conversion (a tuple: hashed and built in C; a plan of the 1b step's
    integer program builds 30k of them)."""

    kind: str  # one of COLLECTIVES, or the local "slice" / "mask" / "pad"
    axes: tuple  # mesh axis names
    dim: int = -1  # tensor dim gathered / scattered / sliced (all_to_all: split dim)
    src_dim: int = -1  # all_to_all: the dim that was split before
    op: str = "sum"  # all_reduce: "sum", "max" or "min"
    local_shape: tuple = ()  # shape of the local block the step starts from
    bytes: int = 0  # per-device bytes sent
    after: tuple = ()  # NdSbp after this step
    perm: tuple = ()  # ppermute: (source, destination) pairs of linear indices over ``axes``
    value: object = None  # a rule's own step: the aval of what moves, if not its first operand

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES


def _axes_on(sbp, dim, names):
    return [a for a, s in zip(names, sbp) if isinstance(s, Split) and s.dim == dim]


def route(shape, dtype, src: NdSbp, dst: NdSbp, mesh, links=None) -> tuple:
    """Steps converting a ``dtype[shape]`` value from ``src`` to ``dst`` (both NdSbp): the
    direct plan, or with ``links`` (a LinkModel) the cheaper of it and the shortest route
    through NdSbps between (``Pricer.route``)."""
    src, dst = tuple(src), tuple(dst)
    if src == dst:
        return ()
    shape, dtype, mesh = _normalized(shape, dtype, mesh)
    if links is None:
        return _plan(shape, dtype, src, dst, mesh)
    return Pricer(shape, dtype, mesh, links).steps(src, dst)


def _normalized(shape, dtype, mesh) -> tuple:
    """(shape, dtype, mesh) as the caches key them."""
    return tuple(shape), as_dtype(dtype), _MeshShape(tuple(mesh.axis_names), tuple(mesh.devices.shape))


class _MeshShape(NamedTuple):
    """What a plan depends on of a mesh: its axis names and sizes. Hashable (for the cache), and
    shaped like a Mesh where ``specs.axis_sizes`` / ``specs.local_shape`` read one."""

    axis_names: tuple
    shape: tuple

    @property
    def devices(self):
        return self


@functools.lru_cache(maxsize=65536)
def _plan(shape, dtype, src, dst, mesh) -> tuple:
    """``_steps``'s collectives and local steps, sized for a ``dtype[shape]`` value."""
    itemsize = as_dtype(dtype).itemsize
    out = []
    for kind, axes, n, dim, src_dim, op, before, after, cost in _steps(len(shape), src, dst, mesh):
        before_shape = _block(shape, before, mesh.shape)
        sent = cost(n, math.prod(before_shape) * itemsize, math.prod(_block(shape, after, mesh.shape)) * itemsize)
        out.append(Step(kind, axes, dim, src_dim, op, before_shape, int(round(sent)), after))
    return tuple(out)


def _block(shape, sbp, sizes) -> tuple:
    """``specs.local_shape`` with the mesh's axis sizes in mesh order."""
    out = list(shape)
    for n, s in zip(sizes, sbp):
        if type(s) is Split:
            out[s.dim] //= n
    return tuple(out)


def _free(n, before, after) -> float:
    return 0.0


def _scattered(n, before, after) -> float:  # reduce_scatter, all_to_all
    return (n - 1) / n * before


def _reduced(n, before, after) -> float:  # all_reduce
    return 2 * (n - 1) / n * before


def _gathered(n, before, after) -> float:  # all_gather
    return (n - 1) / n * after


@functools.lru_cache(maxsize=16384)
def _steps(rank, src, dst, mesh) -> tuple:
    """The steps from ``src`` to ``dst`` of a value of ``rank`` dims — which steps a conversion
    takes depends on its layouts, not on its dims' sizes —, each (kind, axes, their device
    count, dim, src_dim, op, NdSbp before, NdSbp after, its bytes sent as a function of that
    count and the block bytes before and after it)."""
    names = tuple(mesh.axis_names)
    sizes = axis_sizes(mesh)
    order = {a: i for i, a in enumerate(names)}
    want = dict(zip(names, dst))
    # On an axis of one device every SBP is the same local block, so it takes the wanted SBP
    # first, for free: it can then never force a gather to restore a dim's split order (on
    # the tensor-parallel mesh {data: 1, model: n}, (S(0), S(2)) -> (S(2), S(2)) gathered the
    # whole tensor over model).
    cur = {a: want[a] if sizes[a] == 1 else s for a, s in zip(names, src)}
    steps = []

    def now():
        return tuple(cur[a] for a in names)

    if now() == tuple(dst):
        return ()

    def step(kind, changes: dict, *, dim=-1, src_dim=-1, op="sum", cost=_free):
        before = now()
        cur.update(changes)
        n = math.prod(sizes[a] for a in changes)
        steps.append((kind, tuple(changes), n, dim, src_dim, op, before, now(), cost))

    def can_append(axis, dim, also=()):
        """May ``axis`` split ``dim`` next, as its minor-most axis (after those of ``also``), on
        the way to ``dst``?"""
        have = [a for a in _axes_on(now(), dim, names) if a != axis] + list(also)
        return have == [a for a in _axes_on(dst, dim, names) if order[a] < order[axis]]

    def slices():
        for a in names:
            if isinstance(cur[a], Broadcast) and isinstance(want[a], Split) and can_append(a, want[a].dim):
                step("slice", {a: want[a]}, dim=want[a].dim)

    slices()
    for dim in range(rank):  # P(sum) -> S: reduce_scatter, one over the axes that scatter a dim
        group = []
        for a in names:
            if cur[a] == Partial("sum") and want[a] == Split(dim) and can_append(a, dim, group):
                group.append(a)
        if group:
            step("reduce_scatter", {a: want[a] for a in group}, dim=dim, cost=_scattered)
    for a in names:  # S(i) -> S(j) on one axis: all_to_all
        s, t = cur[a], want[a]
        if (
            isinstance(s, Split)
            and isinstance(t, Split)
            and s.dim != t.dim
            and _axes_on(now(), s.dim, names)[-1] == a
            and can_append(a, t.dim)
        ):
            step("all_to_all", {a: t}, dim=t.dim, src_dim=s.dim, cost=_scattered)
    for op in ("sum", "max", "min"):  # P -> B: all_reduce, one collective over all such axes
        group = [a for a in names if cur[a] == Partial(op) and want[a] != cur[a]]
        if group:
            step("all_reduce", {a: B for a in group}, op=op, cost=_reduced)
    for a in names:  # S -> P(sum): own shard in place, zeros elsewhere
        s, t = cur[a], want[a]
        if isinstance(s, Split) and t == Partial("sum") and _axes_on(now(), s.dim, names)[-1] == a:
            step("pad", {a: t}, dim=s.dim)
    for dim in range(rank):  # S -> B: gather what differs from the wanted split order
        have, goal = _axes_on(now(), dim, names), _axes_on(dst, dim, names)
        k = 0
        while k < min(len(have), len(goal)) and have[k] == goal[k]:
            k += 1
        if have[k:]:
            step("all_gather", {a: B for a in have[k:]}, dim=dim, cost=_gathered)
    slices()
    for a in names:  # B -> P: keep the value on index 0 of the axis
        if isinstance(want[a], Partial) and cur[a] != want[a]:
            assert isinstance(cur[a], Broadcast), (src, dst, now())
            step("mask", {a: want[a]}, op=want[a].op)
    assert now() == tuple(dst), (src, dst, now())
    return tuple(steps)


def total_bytes(steps) -> int:
    return sum(s.bytes for s in steps)


def steps_seconds(steps, links) -> float:
    """Modelled seconds of a plan: each collective by the link model, each local step EPSILON."""
    return sum(links.seconds(s.axes, s.bytes) if s.is_collective else EPSILON for s in steps)


def seconds(shape, dtype, src: NdSbp, dst: NdSbp, mesh, links) -> float:
    """The one pricer: modelled seconds of the plan that converts ``src`` to ``dst``
    (``Pricer``'s, for one conversion)."""
    return Pricer(shape, dtype, mesh, links)(tuple(src), tuple(dst))


class Pricer:
    """``seconds`` of conversions of a ``dtype[shape]`` value on ``mesh`` under ``links``, as a
    function of (src, dst) NdSbp tuples: what ``steps_seconds(route(...))`` gives, to the bit,
    without building the plan's Steps (``_sizes``); each pair priced once, and what a pricing
    loop would redo per pair — the axes' speeds and layouts — once."""

    def __init__(self, shape, dtype, mesh, links):
        self.shape, self.dtype, self.mesh = _normalized(shape, dtype, mesh)
        self.links = links
        self.speeds = tuple(
            (links.per_axis_alpha.get(a, links.alpha), links.per_axis_beta.get(a, links.beta))
            for a in self.mesh.axis_names
        )
        self.layouts = tuple(_whole_or_split(self.shape, n) for n in self.mesh.shape)
        self.routed = math.prod(len(o) for o in self.layouts) <= ROUTED_LAYOUTS
        self.memo, self.legs = {}, {}

    def __call__(self, src: tuple, dst: tuple) -> float:
        got = self.memo.get((src, dst))
        if got is None:
            got = self.memo[src, dst] = self._seconds(src, dst)
        return got

    def steps(self, src, dst) -> tuple:
        """The plan this pricer prices from ``src`` to ``dst``: ``route``'s steps."""
        if src == dst:
            return ()
        direct = _plan(self.shape, self.dtype, src, dst, self.mesh)
        routed = self.route(src, dst, steps_seconds(direct, self.links))
        if routed is None:
            return direct
        states = routed[0]
        plans = (_plan(self.shape, self.dtype, u, v, self.mesh) for u, v in zip(states, states[1:]))
        return tuple(step for plan in plans for step in plan)

    def _seconds(self, src, dst) -> float:
        if src == dst:
            return 0.0
        direct = sum(self._terms(src, dst))
        routed = self.route(src, dst, direct)
        return direct if routed is None else routed[1]

    def _terms(self, src, dst):
        """The seconds of each step of the direct plan from ``src`` to ``dst``, in order: summed
        by ``sum`` as ``steps_seconds`` sums them, equal to it to the bit (``sum`` of floats is
        compensated from Python 3.12 on; a loop of ``+=`` is not)."""
        shape, itemsize = self.shape, self.dtype.itemsize
        for step in _sizes(len(shape), src, dst, self.mesh):
            if step is None:
                yield EPSILON
                continue
            axes, n, cost, before, after = step
            sent = cost(n, _block_bytes(shape, before, itemsize), _block_bytes(shape, after, itemsize))
            yield self.links.seconds(axes, int(round(sent)))

    def _leg(self, u, v) -> tuple:
        """``_terms`` of a hop, once per Pricer: routes of one value share their hops."""
        got = self.legs.get((u, v))
        if got is None:
            got = self.legs[u, v] = tuple(self._terms(u, v))
        return got

    def route(self, src, dst, direct: float) -> tuple | None:
        """(The NdSbps of the shortest route from ``src`` to ``dst``, both included, and its
        seconds) where it is cheaper than ``direct`` seconds, else None: each hop one direct plan
        of one step, over the NdSbps each axis may hold on the way (``_options``), only where
        they are at most ``ROUTED_LAYOUTS``."""
        if not self.routed:
            return None
        options = self.layouts
        if any(type(a) is Partial for a in src + dst):
            options = tuple(_options(o, s, t) for o, s, t in zip(options, src, dst))
            if math.prod(len(o) for o in options) > ROUTED_LAYOUTS:
                return None
        graph = _graph(self.shape, self.dtype.itemsize, options, self.mesh, self.speeds)
        i, j = graph.index.get(src), graph.index.get(dst)
        if i is None or j is None:  # priced before being found not to divide
            return None
        if not graph.dist[i, j] < direct * (1 - 1e-9):
            return None
        states = [src]
        while i != j:
            i = graph.next[i, j]
            states.append(graph.states[i])
        total = sum(t for u, v in zip(states, states[1:]) for t in self._leg(u, v))
        return (states, total) if total < direct * (1 - 1e-9) else None


@functools.lru_cache(maxsize=1 << 19)
def _sizes(rank, src, dst, mesh) -> tuple:
    """``_steps`` as ``Pricer`` needs them, small enough (~0.2 KB an entry) to cache by the
    hundred thousand: the 1b step pipelined on {pipe: 2, data: 2, model: 2} prices 230k
    (rank, src, dst), and with ``_steps``'s cache thrashing, half its integer program's build
    went to planning them again (at 131k entries this cache thrashed too: build 27.1 s and
    297k misses, against 24.5 s, 230k, and 43 MB more peak memory, at 524k). Per step None
    where it is local, else a collective's axes and device count, its bytes as a function of
    those, and per dim how many ways the NdSbps before and after it split that dim."""

    def ways(sbp):
        key = tuple(
            math.prod(n for n, s in zip(mesh.shape, sbp) if type(s) is Split and s.dim == d) for d in range(rank)
        )
        return _WAYS.setdefault(key, key)

    return tuple(
        (axes, n, cost, ways(before), ways(after)) if kind in COLLECTIVES else None
        for kind, axes, n, _, _, _, before, after, cost in _steps(rank, src, dst, mesh)
    )


_WAYS = {}  # interned: a few dozen distinct tuples among ``_sizes``'s entries


def _block_bytes(shape, ways, itemsize) -> int:
    """Bytes of the local block, a dim of ``shape`` split ``ways[dim]`` ways (``_block``'s)."""
    return math.prod(d // k for d, k in zip(shape, ways)) * itemsize


# ------------------------------------------------------------------------------ routes


def _options(layouts, src, dst) -> tuple:
    """What a mesh axis may hold on a route from ``src`` to ``dst``: its ``layouts`` (B and a
    split of any dim it divides), and a partial value only where the route starts or ends as one."""
    if type(src) is Partial:
        layouts += (src,)
    if type(dst) is Partial and dst != src:
        layouts += (dst,)
    return layouts


@functools.lru_cache(maxsize=4096)
def _whole_or_split(shape, n) -> tuple:
    return (B,) + tuple(Split(d) for d in range(len(shape)) if shape[d] % n == 0)


class _Graph(NamedTuple):
    states: list  # the NdSbps a value of this shape can take
    index: dict  # NdSbp -> its row
    dist: np.ndarray  # seconds of the cheapest route, state to state
    next: np.ndarray  # the first hop of that route


@functools.lru_cache(maxsize=4096)
def _graph(shape, itemsize, options, mesh, speeds) -> _Graph:
    """All-pairs shortest routes (Floyd-Warshall) between the NdSbps of a ``shape`` value whose
    axes hold ``options``, over hops that are one step of ``_plan`` (``_hops``): every step a
    direct plan takes is a hop, so a route is never dearer than the direct plan, and a chain of
    routes never cheaper than the route. Each hop costs EPSILON more than its step: fewer steps
    on a tie."""
    states = [s for s in itertools.product(*options) if divides(shape, s, mesh)]
    index = {s: i for i, s in enumerate(states)}
    n, position = len(states), {a: k for k, a in enumerate(mesh.axis_names)}
    dist = np.full((n, n), np.inf)
    np.fill_diagonal(dist, 0.0)
    for u, v, step in _hops(len(shape), options, mesh):
        i, j = index.get(u), index.get(v)
        if i is None or j is None:
            continue
        seconds = EPSILON
        if step is not None:
            axes, k, cost, before, after = step
            sent = round(cost(k, _block_bytes(shape, before, itemsize), _block_bytes(shape, after, itemsize)))
            alpha = max(speeds[position[a]][0] for a in axes)
            seconds += sent and alpha + sent / min(speeds[position[a]][1] for a in axes)
        dist[i, j] = min(dist[i, j], seconds)
    hop = np.where(np.isfinite(dist), np.arange(n)[None, :], -1)
    for k in range(n):
        via = dist[:, k : k + 1] + dist[k : k + 1, :]
        better = via < dist
        dist = np.where(better, via, dist)
        hop = np.where(better, hop[:, k : k + 1], hop)
    return _Graph(states, index, dist, hop)


@functools.lru_cache(maxsize=1024)
def _hops(rank, options, mesh) -> tuple:
    """(u, v, its ``_sizes`` step, None where local) of every change from an NdSbp u to v whose
    axes hold ``options`` that ``_plan`` makes in at most one step (``_moves``): what a route may
    take, whatever the shape's sizes (the graph keeps the states a shape divides)."""
    out = []
    for u in itertools.product(*options):
        for v in dict.fromkeys(_moves(u, options, rank)):
            if v != u and all(t in held for t, held in zip(v, options)):
                steps = _sizes(rank, u, v, mesh)
                if len(steps) <= 1:
                    out.append((u, v, steps[0] if steps else None))
    return tuple(out)


def _moves(u, options, rank):
    """The NdSbps one step of ``_plan`` may take ``u`` to: one mesh axis changed (a slice,
    reduce-scatter, all-to-all, pad, mask, or a gather or all-reduce over it), or several
    changed alike, by one collective over them (a gather of a dim's minor axes, an all-reduce
    of the axes of one partial op, a reduce-scatter of partial sums into one dim)."""
    for a, held in enumerate(options):
        for t in held:
            if t != u[a]:
                yield u[:a] + (t,) + u[a + 1 :]
    for k in range(2, len(u) + 1):
        for axes in itertools.combinations(range(len(u)), k):
            for t in (B,) + tuple(Split(d) for d in range(rank)):
                yield tuple(t if a in axes else s for a, s in enumerate(u))


def local_bytes(aval, sbp: NdSbp, mesh) -> int:
    """Bytes of one device's block of ``aval`` at ``sbp``."""
    return math.prod(local_shape(aval.shape, sbp, mesh)) * aval.dtype.itemsize


def local_work(eqn, ins, outs, mesh) -> tuple[float, int]:
    """(flops, bytes) of ``eqn``'s local work with its operands at NdSbps ``ins`` and results
    at ``outs``: its rule's flops (a matmul's, a convolution's; 0 where a rule declares none) on
    the local blocks, and the bytes of those blocks, read and written — for an elementwise
    equation its result's only: XLA fuses elementwise chains, so their operands are not read
    from memory one equation at a time (priced so, an optimizer's chain of a dozen elementwise
    updates looked many times its memory traffic, and sharding it worth an extra all-gather of
    the fp32 weights: 0.953x jit under dp on 4 GPUs). A fused chain writes less than its
    results; pricing them keeps a split layout cheaper than a whole one, and the solver's LP
    off the ties pricing nothing made (1b tp step: 35 s -> 16 s)."""
    shapes = [
        [local_shape(x.aval.shape, s, mesh) for x, s in zip(xs, sbps)]
        for xs, sbps in ((eqn.invars, ins), (eqn.outvars, outs))
    ]
    moved = zip((eqn.invars, eqn.outvars), shapes)
    if eqn.primitive in SHAPE_KEEPING:
        moved = [(eqn.outvars, shapes[1])]
    nbytes = sum(math.prod(shape) * x.aval.dtype.itemsize for xs, group in moved for x, shape in zip(xs, group))
    rule = registry.rule_of(eqn.primitive)
    return (rule.flops(eqn, *shapes) if rule is not None and rule.flops is not None else 0.0), nbytes


def local_seconds(eqn, ins, outs, mesh, links) -> float:
    """Modelled seconds of ``eqn``'s local work (``local_work``)."""
    return links.compute_seconds(*local_work(eqn, ins, outs, mesh))


def reorder(shape, dtype, sbp: NdSbp, dim: int, order: tuple, mesh, *, to_mesh_order: bool) -> tuple:
    """The ppermute that moves the blocks of ``dim`` between a split over ``order`` (major
    first, against mesh order) and the same axes in mesh order — or back."""
    names = tuple(mesh.axis_names)
    sizes = axis_sizes(mesh)
    axes = tuple(a for a in names if a in order)  # ppermute indexes devices in this order

    def linear(coords, over):
        i = 0
        for a in over:
            i = i * sizes[a] + coords[a]
        return i

    grid = [{}]
    for a in axes:
        grid = [{**c, a: k} for c in grid for k in range(sizes[a])]
    holder = {linear(c, order): linear(c, axes) for c in grid}  # block in user order -> device
    pairs = []
    for c in grid:
        here = linear(c, axes)
        if to_mesh_order:  # the device holding block b (user order) sends it to device b
            pairs.append((here, linear(c, order)))
        else:  # device b holds block b (mesh order); it goes where user order puts b
            pairs.append((here, holder[here]))
    block = math.prod(local_shape(shape, sbp, mesh)) * as_dtype(dtype).itemsize
    moved = any(s != d for s, d in pairs)
    return (
        Step(
            "ppermute",
            axes,
            dim,
            local_shape=local_shape(shape, sbp, mesh),
            bytes=block if moved else 0,
            after=tuple(sbp),
            perm=tuple(sorted(pairs)),
        ),
    )


# ------------------------------------------------------------------------------ running a plan


def run(steps, x, sizes: dict):
    """Execute ``steps`` on the local block ``x`` inside shard_map (``sizes``: mesh axis sizes)."""
    for st in steps:
        x = _RUN[st.kind](st, x, sizes)
    return x


def _axis_names(axes):
    return axes if len(axes) > 1 else axes[0]


def _all_gather(st, x, sizes):
    return lax.all_gather(x, _axis_names(st.axes), axis=st.dim, tiled=True)


def _all_reduce(st, x, sizes):
    if st.op == "sum":
        return lax.psum(x, st.axes)
    if st.op not in ("max", "min"):
        raise NotImplementedError(f"all_reduce of a partial {st.op} value")
    reduce = lax.pmax if st.op == "max" else lax.pmin
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return reduce(x, st.axes)  # ints and bools have no NaN
    # XLA's all-reduce max/min drops NaN on some backends (CPU), where jnp.max on one device
    # returns it. Reduce order-preserving integers instead, with no extra bytes: NaN made +NaN
    # (-NaN for min) so that it orders above +inf (below -inf), then the sign-magnitude float
    # bits turned two's complement (negative floats' magnitude bits flipped, so -0.0 < +0.0).
    ints = jnp.dtype(f"int{8 * x.dtype.itemsize}")
    low = jnp.array(jnp.iinfo(ints).max, ints)  # 0x7f..f: every bit but the sign
    nan = jnp.array(jnp.nan if st.op == "max" else -jnp.nan, x.dtype)
    bits = lax.bitcast_convert_type(jnp.where(jnp.isnan(x), nan, x), ints)
    key = jnp.where(bits < 0, bits ^ low, bits)
    key = reduce(key, st.axes)
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ low, key), x.dtype)


def _slice(st, x, sizes):
    size = x.shape[st.dim] // sizes[st.axes[0]]
    return lax.dynamic_slice_in_dim(x, lax.axis_index(st.axes[0]) * size, size, st.dim)


def _pad(st, x, sizes):
    n, size = sizes[st.axes[0]], x.shape[st.dim]
    shape = x.shape[: st.dim] + (size * n,) + x.shape[st.dim + 1 :]
    return lax.dynamic_update_slice_in_dim(jnp.zeros(shape, x.dtype), x, lax.axis_index(st.axes[0]) * size, st.dim)


def _mask(st, x, sizes):
    if st.op != "sum":  # max over equal copies is the copy
        return x
    return jnp.where(lax.axis_index(st.axes[0]) == 0, x, jnp.zeros_like(x))


_RUN = {
    "all_gather": _all_gather,
    "all_reduce": _all_reduce,
    "reduce_scatter": lambda st, x, sizes: lax.psum_scatter(
        x, _axis_names(st.axes), scatter_dimension=st.dim, tiled=True
    ),
    "all_to_all": lambda st, x, sizes: lax.all_to_all(x, st.axes[0], st.dim, st.src_dim, tiled=True),
    "ppermute": lambda st, x, sizes: lax.ppermute(x, st.axes, perm=st.perm),
    "slice": _slice,
    "pad": _pad,
    "mask": _mask,
}
