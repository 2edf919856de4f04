"""``costs``: what a boxed program's plan costs by the model, each figure from the one pricer
(``conversion`` and the link model): its collectives (``Collective``, ``collectives``), the
local work of its equations, what its loops hide behind their matmuls (``overlap``), what they
hold across the step (``held_bytes``), its arguments gathered whole (``gathered_inputs``), and
their totals (``modelled``). The solver compares plans by them and the lowering asks them;
explain reports them."""

from __future__ import annotations

import dataclasses

from shardflow import conversion, registry
from shardflow.hlo import COMBINED
from shardflow.primitives import box_p
from shardflow.program import Program, is_literal, named_bodies, open_jaxpr, source_line
from shardflow.registry import Call, Loop
from shardflow.specs import B, Split, as_dtype, format_sbp


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | ppermute
    axes: tuple  # mesh axis names
    shape: tuple  # global shape of the value converted
    dtype: str
    bytes: int  # per-device bytes sent, per execution
    count: int  # executions per call (trip counts of enclosing scans)
    source: str  # file.py:LINE of the user code that made the value
    used_at: str  # file.py:LINE of the use that needed the conversion
    reason: str
    src: str  # NdSbp before / after the whole conversion
    dst: str
    seconds: float = 0.0  # modelled time per execution (the link model's α + bytes/β; β alone if ``combined``)
    # run as one with an earlier collective (``combined_levels``): XLA's combiners merge
    # independent collectives of one kind over the same devices, one latency for them all
    combined: bool = False


class Totals:
    """The totals of a plan's ``collectives``, ``work_seconds``, ``hidden_seconds``,
    ``input_bytes`` and ``loop_bytes``: ``Modelled``'s, and explain's ``Plan``'s."""

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes * c.count for c in self.collectives)

    @property
    def total_seconds(self) -> float:
        return sum(c.seconds * c.count for c in self.collectives)

    @property
    def memory_bytes(self) -> int:
        """What a memory budget bounds: the inputs and what the loops hold (partial: the
        other intermediates and temporaries are not counted)."""
        return self.input_bytes + self.loop_bytes

    @property
    def modelled_seconds(self) -> float:
        """What the solver minimises: the collectives and the local work, less what loops hide."""
        return self.total_seconds + self.work_seconds - self.hidden_seconds


@dataclasses.dataclass(frozen=True)
class Modelled(Totals):
    """A boxed program's modelled costs per device (``modelled``): what the solver compares plans
    by, and what explain's Plan reports."""

    collectives: list  # Collective, in program order
    work_seconds: float  # the local work of every equation (conversion.local_seconds)
    hidden_seconds: float  # collectives the loops overlap with their matmuls (``overlap``)
    flops: float  # the local flops of every equation whose rule counts them
    input_bytes: int  # the arguments' blocks
    loop_bytes: int  # what the loops hold across the step (``held_bytes``)


def modelled(program: Program) -> Modelled:
    """The modelled costs of ``program``, a boxed program."""
    jaxpr, found = program.jaxpr.jaxpr, []
    work, hidden, flops = _collectives(program, jaxpr, 1, found, combined_levels(jaxpr))
    input_bytes = sum(conversion.local_bytes(v.aval, program.sbp[v], program.mesh) for v in jaxpr.invars)
    return Modelled(found, work, hidden, flops, input_bytes, held_bytes(program, jaxpr))


def overlap(program: Program, eqn) -> float:
    """Seconds per execution of a scan's body that its collectives hide behind its matmuls."""
    return min(*hideable(program, eqn))


def hideable(program: Program, eqn) -> tuple[float, float]:
    """(seconds of the conversions XLA may run ahead of or behind a boxed loop body's compute —
    of its sliced inputs (a layer's weights, gathered ahead) and to its stacked outputs (a
    layer's gradient, reduced behind the next layer) —, seconds of its matmuls' flops, remat
    regions included), per execution; a remat's conversions of a sliced operand count as the
    weight's own (the solver prices them so: ``passes.solve``). Collectives on the layer's own
    critical path (a tensor-parallel all-reduce) hide nothing. No schedule is imposed: within an
    iteration XLA's latency-hiding scheduler places them (moving them an iteration early or late
    in the lowering measured 1-1.5 % slower on 7b FSDP, 2 x H200: benchmarks/results/scaling.md)."""
    loop = registry.region_of(eqn)
    body = open_jaxpr(eqn.params[loop.body])
    nc, nk = loop.consts, loop.carries
    ahead, behind = set(body.invars[nc + nk :]), {v for v in body.outvars[nk:] if not is_literal(v)}
    boxes = [(e, ahead) for e in body.eqns]
    for e in body.eqns:  # a remat's body converting a sliced operand (a backward's recomputed forward)
        if isinstance(call := registry.region_of(e), Call):
            inner = open_jaxpr(e.params[call.body])
            sliced = {v for x, v in zip(e.invars, inner.invars) if not is_literal(x) and x in ahead}
            boxes += [(b, sliced) for b in inner.eqns]
    comm = sum(
        conversion.steps_seconds([s for s in e.params["steps"] if s.is_collective], program.links)
        for e, sliced in boxes
        if e.primitive is box_p and (not is_literal(e.invars[0]) and e.invars[0] in sliced or e.outvars[0] in behind)
    )
    return comm, _matmul_seconds(program, body)


def _matmul_seconds(program: Program, jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        if isinstance(call := registry.region_of(eqn), Call):
            total += _matmul_seconds(program, open_jaxpr(eqn.params[call.body]))
        elif (rule := registry.rule_of(eqn.primitive)) is not None and rule.flops is not None:
            d = registry.decision_of(eqn)
            flops, _ = conversion.local_work(eqn, d.ins, d.outs, program.mesh)
            total += program.links.compute_seconds(flops, 0)
    return total


def collectives(program: Program, jaxpr) -> list:
    """The collectives one run of ``jaxpr`` (a boxed program's, or a body of it) runs."""
    out = []
    _collectives(program, jaxpr, 1, out)
    return out


def combined_key(steps, aval) -> tuple | None:
    """(kind, axes, op, dim, dtype) of a conversion that is one all-reduce, all-gather or
    reduce-scatter, else None: XLA's combiners run independent collectives of one key as one
    (on GPU; XLA:CPU combines all-reduces only)."""
    if len(steps) != 1 or steps[0].kind not in COMBINED:
        return None
    st = steps[0]
    return st.kind, st.axes, st.op, st.dim, as_dtype(aval.dtype).name


def combined_levels(jaxpr) -> dict:
    """{box: (its ``combined_key``, level)} of the boxes of ``jaxpr`` (not of its bodies) that
    are one combinable collective: level 1 + the highest level of the same key among the
    collectives it depends on. Collectives of one key and level are independent, and the
    levels are as few as a dependence chain allows (Mirsky): the model runs each (key, level)
    as one collective, as XLA's combiners can (a training step's gradient all-reduces: one)."""
    below, out = {}, {}  # var -> {key: the highest level of that key it depends on}
    for eqn in jaxpr.eqns:
        seen = {}
        for x in eqn.invars:
            for key, level in below.get(x, {}).items() if not is_literal(x) else ():
                seen[key] = max(seen.get(key, 0), level)
        key = combined_key(eqn.params["steps"], eqn.invars[0].aval) if eqn.primitive is box_p else None
        if key is not None:
            out[eqn] = key, seen.get(key, 0) + 1
            seen = {**seen, key: out[eqn][1]}
        for v in eqn.outvars:
            below[v] = seen
    return out


def _collectives(program: Program, jaxpr, count: int, out: list, levels=None) -> tuple[float, float, float]:
    """The collectives of ``jaxpr`` (into ``out``): each box's plan, and those a rule's own
    lowering runs. Returns the modelled local work of its equations, the seconds its loops
    hide (``overlap``) and its flops per device (those its rules count: matmuls, convolutions).
    With ``levels`` (``combined_levels(jaxpr)``), the collectives of one key and level pay one
    latency."""
    work = hidden = flops = 0.0
    groups = set()
    for eqn in jaxpr.eqns:
        x, d = eqn.invars[0] if eqn.invars else None, registry.decision_of(eqn)
        rule = registry.rule_of(eqn.primitive)
        if eqn.primitive is box_p:
            p = eqn.params
            steps, why = p["steps"], (p["source"], p["used_at"], p["reason"], p["src"], p["dst"])
        elif rule is not None and rule.comm is not None:
            steps = rule.comm(eqn, d.ins, d.sigs, program.mesh)
            why = (source_line(eqn), source_line(eqn), f"{eqn.primitive.name} {rule.comm_reason}", d.ins[0], d.outs[0])
        else:
            steps = ()
        repeats: dict = {}  # a rule's identical steps (a pipeline's per-tick ppermute) counted once
        for st in steps:
            if st.is_collective:
                repeats[st] = repeats.get(st, 0) + 1
        group = None if levels is None else levels.get(eqn)
        combined = group is not None and group in groups
        groups.add(group)
        for st, times in repeats.items():
            source, used_at, reason, src, dst = why
            moved = st.value or x.aval
            seconds = program.links.seconds(st.axes, st.bytes)
            out.append(
                Collective(
                    st.kind,
                    st.axes,
                    tuple(moved.shape),
                    as_dtype(moved.dtype).name,
                    st.bytes,
                    count * times,
                    source,
                    used_at,
                    reason,
                    format_sbp(src),
                    format_sbp(dst),
                    seconds - program.links.latency(st.axes) if combined else seconds,
                    combined,
                )
            )
        bodies = list(named_bodies(eqn))
        for name, body in bodies:
            trips = registry.trips_of(eqn, name, program.mesh)
            w, h, f = _collectives(program, body, count * trips, out)
            work, hidden, flops = work + w, hidden + h, flops + f
        if isinstance(loop := registry.region_of(eqn), Loop):
            hidden += count * loop.trips * overlap(program, eqn)
        if not bodies and eqn.primitive is not box_p and d is not None:
            work += count * conversion.local_seconds(eqn, d.ins, d.outs, program.mesh, program.links)
            flops += count * conversion.local_work(eqn, d.ins, d.outs, program.mesh)[0]
    return work, hidden, flops


def held_bytes(program: Program, jaxpr) -> int:
    """Per device, what the loops of ``jaxpr`` not in a loop hold across the step (call bodies
    such as remat's included; a loop's per-iteration values come and go): their stacked outputs — what a layer
    loop keeps for the backward, its stacked gradients — and their operands other than carries
    as the loops take them — a layer's weights, cast or gathered —, each value once; not the
    arguments (``input_bytes``), the constants, or one loop's stacked output taken by another
    as it is (the integer program's ``_taken``, passes.solve.build, counts the same)."""
    held, alias = {}, {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            region = registry.region_of(eqn)
            if isinstance(region, Loop):
                nc, nk = region.consts, region.carries
                for k, x in enumerate(eqn.invars):
                    if not (nc <= k < nc + nk) and not is_literal(x):
                        held.setdefault(alias.get(x, x), x)
                for o in eqn.outvars[nk:]:
                    held[o] = o
            elif isinstance(region, Call):
                body = open_jaxpr(eqn.params[region.body])
                alias.update((v, alias.get(x, x)) for x, v in zip(eqn.invars, body.invars) if not is_literal(x))
                walk(body)
                alias.update((o, alias.get(v, v)) for v, o in zip(body.outvars, eqn.outvars) if not is_literal(v))

    walk(jaxpr)
    given = set(program.jaxpr.jaxpr.invars) | set(program.jaxpr.jaxpr.constvars)  # held however laid out
    return sum(
        conversion.local_bytes(x.aval, program.sbp[x], program.mesh)
        for v, x in held.items()
        if v not in given and x in program.sbp
    )


def gathered_inputs(program: Program) -> list:
    """(argument, its NdSbp, the NdSbp converted to, where, bytes sent per device per step) of
    every conversion that gathers an argument — or its cast, or a layer's slice of it inside a
    loop — over a mesh axis its spec splits: a weight pinned split, materialised whole there."""
    jaxpr, out = program.jaxpr.jaxpr, []
    origin = dict(zip(jaxpr.invars, program.arg_names))

    def walk(jaxpr, count):
        for eqn in jaxpr.eqns:
            x = eqn.invars[0] if eqn.invars and not is_literal(eqn.invars[0]) else None
            if eqn.primitive is box_p and x in origin:
                p = eqn.params
                if any(isinstance(a, Split) and b == B for a, b in zip(p["src"], p["dst"])):
                    sent = sum(st.bytes for st in p["steps"] if st.is_collective) * count
                    out.append((origin[x], format_sbp(p["src"]), format_sbp(p["dst"]), p["used_at"], sent))
                origin[eqn.outvars[0]] = origin[x]
            elif (rule := registry.rule_of(eqn.primitive)) is not None and rule.same_value and x in origin:
                origin[eqn.outvars[0]] = origin[x]  # a weight's cast is still the weight
            elif isinstance(region := registry.region_of(eqn), (Loop, Call)):
                body = open_jaxpr(eqn.params[region.body])
                nc, nk = (region.consts, region.carries) if isinstance(region, Loop) else (len(body.invars), 0)
                for k, (y, v) in enumerate(zip(eqn.invars, body.invars)):
                    if not (nc <= k < nc + nk) and not is_literal(y) and y in origin:
                        origin[v] = origin[y] + ("[layer]" if k >= nc + nk else "")
                walk(body, count * registry.trips_of(eqn, region.body, program.mesh))

    walk(jaxpr, 1)
    return out


# What a plan pays, on top of its modelled seconds, for moving a stationary value over one of its
# stationary axes: more than any plan's modelled step, so every plan that keeps them ranks first.
STATIONARY_PENALTY = 1e3


def stationary_values(program: Program) -> dict:
    """Var -> the mesh axis indices over which it may not move from its layout: each input split
    over one of ``program.stationary``'s axes, its casts and a loop's or branch's view of it (a
    layer's slice of a stacked weight; not a carry, which each trip makes anew)."""
    if not program.stationary:
        return {}
    names = program.axis_names
    pinned = {names.index(a) for a in program.stationary}
    jaxpr, out = program.jaxpr.jaxpr, {}
    for v, sbp in zip(jaxpr.invars, program.in_sbp):
        axes = frozenset(i for i in pinned if isinstance(sbp[i], Split))
        if axes:
            out[v] = axes

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            x = eqn.invars[0] if eqn.invars and not is_literal(eqn.invars[0]) else None
            if (rule := registry.rule_of(eqn.primitive)) is not None and rule.same_value and x in out:
                out[eqn.outvars[0]] = out[x]
            elif isinstance(region := registry.region_of(eqn), (Loop, Call)):
                body = open_jaxpr(eqn.params[region.body])
                carries = range(region.consts, region.consts + region.carries) if isinstance(region, Loop) else ()
                for k, (y, v) in enumerate(zip(eqn.invars, body.invars)):
                    if k not in carries and not is_literal(y) and y in out:
                        out[v] = out[y]
                walk(body)

    walk(jaxpr)
    return out


def moves(src, dst, axes) -> bool:
    """Whether converting ``src`` to ``dst`` moves a split over one of the mesh axis indices ``axes``."""
    return any(isinstance(src[i], Split) and dst[i] != src[i] for i in axes)
