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

import dataclasses
import itertools
import math
import re
from typing import Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

from shardflow.api import Parallelized, _definition, _spec_of_each_leaf, parallelize
from shardflow.explain import Plan
from shardflow.mesh import LinkModel, make_mesh
from shardflow.passes.solve import shared_solves
from shardflow.specs import AUTO, ShardingError, to_sbp


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh_shape: dict              # axis name -> size
    seconds: float                # modelled: collectives and local work (Plan.modelled_seconds)
    step: Parallelized | None     # the program on that mesh, ready to call; None where refused
    explain: Plan | None
    refused: str = ""             # why this mesh has no plan (a spec that does not divide, ...)


def factorings(n: int, axes: Sequence[str]) -> list[dict]:
    """Every assignment of sizes to ``axes`` whose product is ``n``, in order."""
    if not axes:
        return [{}] if n == 1 else []
    first, rest = axes[0], axes[1:]
    return [{first: d, **tail} for d in range(1, n + 1) if n % d == 0 for tail in factorings(n // d, rest)]


def plan(fn, *args, in_specs, out_specs=None, axes: Sequence[str] = ("data", "model"),
         mesh_shapes: Sequence[Mapping[str, int]] | None = None, devices=None,
         links: LinkModel | None = None, passes=None, memory_budget: int | None = None) -> list[Candidate]:
    """``fn`` on ``args`` (arrays or ShapeDtypeStructs) solved on each mesh shape — by default
    every factoring of the device count into ``axes`` — best first. ``in_specs`` and
    ``out_specs`` as for ``parallelize`` (``sf.AUTO`` leaves: the solver chooses); ``passes``
    defaults to the solver's; ``memory_budget`` as for ``parallelize``."""
    from shardflow import passes as passes_lib
    devices = list(jax.devices() if devices is None else devices)
    shapes = [dict(s) for s in mesh_shapes] if mesh_shapes is not None else factorings(len(devices), tuple(axes))
    passes = passes_lib.SOLVER if passes is None else passes
    out = []
    for shape in shapes:
        try:
            step = parallelize(fn, mesh=make_mesh(shape, devices=devices), in_specs=in_specs,
                               out_specs=out_specs, links=links, memory_budget=memory_budget, passes=passes)
            explained = step.explain(*args)
        except ShardingError as e:
            out.append(Candidate(shape, math.inf, None, None, refused=str(e)))
            continue
        out.append(Candidate(shape, explained.modelled_seconds, step, explained))
    return sorted(out, key=lambda c: c.seconds)


@dataclasses.dataclass(frozen=True)
class Alternative:
    argument: str                 # ``args[0]['w1']``
    spec: PartitionSpec           # tried in place of the step's spec for that argument
    seconds: float                # modelled (Plan.modelled_seconds) with it; inf where refused
    delta: float                  # seconds - the step's own modelled seconds
    memory_bytes: int             # Plan.memory_bytes with it
    refused: str = ""             # why this spec has no plan (over the memory budget, ...)

    def __str__(self):
        if self.refused:
            return f"{self.argument}: {self.spec} refused: {self.refused}"
        return (f"{self.argument}: {self.spec}  {self.seconds * 1e3:.3f} ms modelled "
                f"({self.delta * 1e3:+.3f} ms), {self.memory_bytes:,} bytes per device")


def alternatives(step: Parallelized, *args, only: str | None = None, top: int | None = 10) -> list[Alternative]:
    """What the next-best annotations would cost: each argument's spec replaced, one argument
    at a time, by every other layout on the step's mesh whose blocks divide (each mesh axis
    splitting one dim or none; a dim split over several axes in mesh order), the program
    planned again by the step's own passes, link model and memory budget; best first,
    ``top`` of them (None: all). ``only``: a regular expression an argument's name
    (``args[0]['w1']``) must match. An ``sf.AUTO`` argument is the planner's to choose and is
    not varied. One plan per candidate: on a large program, narrow it with ``only``."""
    with shared_solves():
        out = _alternatives(step, args, only)
    out.sort(key=lambda a: (a.seconds, a.argument, str(a.spec)))
    return out if top is None else out[:top]


def _alternatives(step: Parallelized, args, only: str | None) -> list[Alternative]:
    in_tree = jax.tree.structure(args)
    given = [spec for _, spec in _spec_of_each_leaf(step.in_specs, args, "in_specs", "args", "argument",
                                                    _definition(step.fn))]
    plan = step.explain(*args)
    base = plan.modelled_seconds
    out = []
    for i, ((name, shape, current), spec) in enumerate(zip(plan.inputs, given)):
        if spec is AUTO or (only is not None and not re.search(only, name)):
            continue
        for candidate in _layouts(shape, step.mesh):
            if to_sbp(candidate, step.mesh, len(shape)) == current:
                continue
            specs = list(given)
            specs[i] = candidate
            tried = parallelize(step.fn, mesh=step.mesh, in_specs=jax.tree.unflatten(in_tree, specs),
                                out_specs=step.out_specs, links=step.links, passes=step.passes,
                                memory_budget=step.memory_budget)
            try:
                explained = tried.explain(*args)
            except ShardingError as e:
                out.append(Alternative(name, candidate, math.inf, math.inf, 0, refused=str(e)))
                continue
            out.append(Alternative(name, candidate, explained.modelled_seconds, explained.modelled_seconds - base,
                                   explained.memory_bytes))
    return out


def _layouts(shape, mesh) -> list[PartitionSpec]:
    """Every PartitionSpec of ``shape`` on ``mesh`` whose blocks divide: each axis splits one dim
    or none, the axes of a dim in mesh order."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    out = []
    for dims in itertools.product([None, *range(len(shape))], repeat=len(sizes)):
        per_dim = [tuple(a for a, d in zip(sizes, dims) if d == dim) for dim in range(len(shape))]
        if all(shape[d] % math.prod(sizes[a] for a in axes) == 0 for d, axes in enumerate(per_dim)):
            out.append(PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes
                                       for axes in per_dim)))
    return out
