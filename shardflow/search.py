"""``sf.plan``: the program solved on every factoring of the devices into mesh axes, ranked by
modelled time — the intra-operator level of an auto-parallel search (Alpa's), with ``sf.AUTO``
in_specs letting the solver lay the parameters out on each mesh. ``sf.alternatives``: what the
next-best annotations of a parallelized step would cost, one argument's spec changed at a time.

Partial, and said so: the ranking is the solver's model (collectives by the α-β link model,
local work by flops and memory bandwidth), not a measurement. A memory budget (``memory_budget``,
else a GPU's memory) bounds each mesh's plan by explain's ``memory_bytes`` — the inputs and what
the layer loops hold, not the temporaries — and a mesh with no plan within it is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import re
import warnings
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

from shardflow.api import Parallelized, ReplicatedAxisWarning, memory_budget_bytes, parallelize, spec_of_each_leaf
from shardflow.explain import Plan
from shardflow.links import LinkModel
from shardflow.mesh import make_mesh
from shardflow.specs import AUTO, ShardingError, definition, to_sbp


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh_shape: dict  # axis name -> size
    seconds: float  # modelled: collectives and local work (Plan.modelled_seconds)
    step: Parallelized | None  # the program on that mesh, ready to call; None where refused
    explain: Plan | None
    refused: str = ""  # why this mesh has no plan (a spec that does not divide, ...)


def factorings(n: int, axes: Sequence[str]) -> list[dict]:
    """Every assignment of sizes to ``axes`` whose product is ``n``, in order."""
    if not axes:
        return [{}] if n == 1 else []
    first, rest = axes[0], axes[1:]
    return [{first: d, **tail} for d in range(1, n + 1) if n % d == 0 for tail in factorings(n // d, rest)]


def plan(
    fn,
    *args,
    in_specs,
    out_specs=None,
    axes: Sequence[str] = ("data", "model"),
    mesh_shapes: Sequence[Mapping[str, int]] | None = None,
    devices=None,
    links: LinkModel | None = None,
    passes=None,
    memory_budget: int | str | None = None,
) -> list[Candidate]:
    """``fn`` on ``args`` (arrays or ShapeDtypeStructs) solved on each mesh shape — by default
    every factoring of the device count into ``axes`` — best first. ``in_specs`` and
    ``out_specs`` as for ``parallelize`` (``sf.AUTO`` leaves: the solver chooses); ``passes``
    defaults to the solver's; ``memory_budget`` as for ``parallelize``. A mesh shape with no
    plan is a Candidate with ``step=None`` and why in ``refused``; when every mesh shape is
    refused, a ShardingError says why for each — under a memory budget, how many bytes the
    leanest plan found without it holds."""
    from shardflow import passes as passes_lib

    where = definition(fn)
    memory_budget = memory_budget_bytes(memory_budget, where)
    devices = list(jax.devices() if devices is None else devices)
    shapes = _mesh_shapes(axes, mesh_shapes, len(devices), f"sf.plan of {where}")
    passes = passes_lib.SOLVER if passes is None else passes

    def planned(shape, budget):
        step = parallelize(
            fn,
            mesh=make_mesh(shape, devices=devices),
            in_specs=in_specs,
            out_specs=out_specs,
            links=links,
            memory_budget=budget,
            passes=passes,
        )
        with _exploring():
            return step, step.explain(*args)

    out, why = [], {}
    for shape in shapes:
        try:
            step, explained = planned(shape, memory_budget)
        except ShardingError as e:
            out.append(Candidate(shape, math.inf, None, None, refused=str(e)))
            why[repr(shape)] = e.message
            continue
        out.append(Candidate(shape, explained.modelled_seconds, step, explained))
    if all(c.step is None for c in out):
        raise ShardingError(f"sf.plan of {where}: " + _every_mesh_refused(shapes, why, memory_budget, planned))
    return sorted(out, key=lambda c: c.seconds)


@contextlib.contextmanager
def _exploring():
    """A layout tried, not chosen: a mesh axis it leaves unsplit is one row of the ranking, not
    a ReplicatedAxisWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedAxisWarning)
        yield


def _mesh_shapes(axes, mesh_shapes, n: int, what: str) -> list[dict]:
    if mesh_shapes is not None:
        shapes = [dict(s) for s in mesh_shapes]
        if not shapes:
            raise ShardingError(
                f"{what}: mesh_shapes={mesh_shapes!r} names no mesh shape; give one or more, "
                f"e.g. mesh_shapes=[{{'data': {n}}}], or leave it None for every factoring of the "
                f"{n} devices into axes"
            )
        return shapes
    axes = tuple(axes)
    if not axes:
        raise ShardingError(
            f"{what}: axes=() names no mesh axis to lay the {n} devices out on; name one or more, "
            "e.g. axes=('data', 'model')"
        )
    for name in axes:
        if axes.count(name) > 1:
            raise ShardingError(
                f"{what}: mesh axis {name!r} is named {axes.count(name)} times in axes={axes!r}; "
                "each mesh axis needs its own name"
            )
    return factorings(n, axes)


def _every_mesh_refused(shapes, why: dict, budget: int | None, planned) -> str:
    """Why no mesh shape has a plan: each one's refusal; under a memory budget, the bytes the
    leanest plan without it holds (explain's ``memory_bytes``), on which mesh shape."""
    reasons = "; ".join(f"on {shape}: {why[repr(shape)]}" for shape in shapes)
    if budget is None:
        return f"every mesh shape tried is refused: {reasons}"
    needs = []
    for shape in shapes:
        try:
            needs.append((planned(shape, None)[1].memory_bytes, repr(shape)))
        except ShardingError:
            continue
    if not needs:
        return f"every mesh shape tried is refused, with the memory budget and without it: {reasons}"
    need, shape = min(needs)
    return (
        f"memory_budget={budget:,} bytes per device refuses every mesh shape tried; the leanest plan "
        f"found without it holds {need:,} bytes per device (explain's memory_bytes: the inputs and what "
        f"the loops hold), on {shape}: give a budget of at least that, or split the arguments further. "
        f"The refusals: {reasons}"
    )


@dataclasses.dataclass(frozen=True)
class Alternative:
    argument: str  # ``args[0]['w1']``
    spec: PartitionSpec  # tried in place of the step's spec for that argument
    seconds: float  # modelled (Plan.modelled_seconds) with it; inf where refused
    delta: float  # seconds - the step's own modelled seconds
    memory_bytes: int  # Plan.memory_bytes with it
    refused: str = ""  # why this spec has no plan (over the memory budget, ...)

    def __str__(self):
        if self.refused:
            return f"{self.argument}: {self.spec} refused: {self.refused}"
        # a difference that rounds to 0.000 ms, of either sign, is no difference
        change = "same as the step" if round(self.delta * 1e3, 3) == 0 else f"{self.delta * 1e3:+.3f} ms"
        return (
            f"{self.argument}: {self.spec}  {self.seconds * 1e3:.3f} ms modelled ({change}), "
            f"{self.memory_bytes:,} bytes per device"
        )


def alternatives(step: Parallelized, *args, only: str | None = None, top: int | None = 10) -> list[Alternative]:
    """What the next-best annotations would cost: each argument's spec replaced, one argument
    at a time, by every other layout on the step's mesh whose blocks divide (each mesh axis
    splitting one dim or none; a dim split over several axes in mesh order), the program
    planned again by the step's own passes, link model and memory budget; best first,
    ``top`` of them (None: all). ``only``: a regular expression an argument's name
    (``args[0]['w1']``) must match. An ``sf.AUTO`` argument is the planner's to choose and is
    not varied. One plan per candidate: on a large program, narrow it with ``only``."""
    if not isinstance(step, Parallelized):
        name = getattr(step, "__name__", type(step).__name__)
        kind = "a function" if callable(step) else f"a {type(step).__name__}"
        raise ShardingError(
            f"sf.alternatives of {definition(step)}: {kind}, not a parallelized step; pass the "
            f"step sf.parallelize made: sf.alternatives(sf.parallelize({name}, mesh=..., "
            "in_specs=...), *args)"
        )
    from shardflow.passes.solve import shared_solves  # scipy loads only when a program is solved

    with shared_solves():
        out = _alternatives(step, args, only)
    out.sort(key=lambda a: (a.seconds, a.argument, str(a.spec)))
    return out if top is None else out[:top]


def _alternatives(step: Parallelized, args, only: str | None) -> list[Alternative]:
    in_tree = jax.tree.structure(args)
    given = [
        spec for _, spec in spec_of_each_leaf(step.in_specs, args, "in_specs", "args", "argument", definition(step.fn))
    ]
    plan = step.explain(*args)
    base = plan.modelled_seconds
    varied = [name for (name, _, _), spec in zip(plan.inputs, given) if spec is not AUTO]
    chosen = _matching(only, varied, f"sf.alternatives of {definition(step.fn)}")
    out = []
    for i, (name, shape, current) in enumerate(plan.inputs):
        if name not in chosen:
            continue
        for candidate in _layouts(shape, step.mesh):
            if to_sbp(candidate, step.mesh, len(shape)) == current:
                continue
            specs = list(given)
            specs[i] = candidate
            tried = parallelize(
                step.fn,
                mesh=step.mesh,
                in_specs=jax.tree.unflatten(in_tree, specs),
                out_specs=step.out_specs,
                links=step.links,
                passes=step.passes,
                memory_budget=step.memory_budget,
                stationary=step.stationary,
            )
            try:
                with _exploring():
                    explained = tried.explain(*args)
            except ShardingError as e:
                out.append(Alternative(name, candidate, math.inf, math.inf, 0, refused=str(e)))
                continue
            out.append(
                Alternative(
                    name,
                    candidate,
                    explained.modelled_seconds,
                    explained.modelled_seconds - base,
                    explained.memory_bytes,
                )
            )
    return out


def _matching(only: str | None, names: list, what: str) -> set:
    """The argument names the regular expression ``only`` finds (all for None); a ShardingError
    listing the names when it is not a regular expression or finds none of them."""
    if only is None:
        return set(names)
    listed = (
        f"the arguments whose annotations can vary are {', '.join(names) or 'none'} (sf.AUTO ones are the solver's)"
    )
    try:
        pattern = re.compile(only)
    except (re.error, TypeError) as e:
        raise ShardingError(f"{what}: only={only!r} is not a regular expression ({e}); {listed}") from None
    found = {name for name in names if pattern.search(name)}
    if not found:
        literal = [name for name in names if only in name]
        special = "'[' opens a character class" if "[" in only else "its special characters match otherwise"
        hint = (
            f"; as a regular expression {special}: for the name as written, use re.escape({only!r}) or "
            f"{re.escape(only)!r}"
            if literal and only != re.escape(only)
            else ""
        )
        raise ShardingError(f"{what}: only={only!r} matches no argument; {listed}{hint}")
    return found


def _layouts(shape, mesh) -> list[PartitionSpec]:
    """Every PartitionSpec of ``shape`` on ``mesh`` whose blocks divide: each axis splits one dim
    or none, the axes of a dim in mesh order."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    out = []
    for dims in itertools.product([None, *range(len(shape))], repeat=len(sizes)):
        per_dim = [tuple(a for a, d in zip(sizes, dims) if d == dim) for dim in range(len(shape))]
        if all(shape[d] % math.prod(sizes[a] for a in axes) == 0 for d, axes in enumerate(per_dim)):
            out.append(PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in per_dim)))
    return out
