"""``sf.plan``: the program solved on every factoring of the devices into mesh axes, ranked by
modelled time — the intra-operator level of an auto-parallel search (Alpa's), with ``sf.AUTO``
in_specs letting the solver lay the parameters out on each mesh.

Partial, and said so: the ranking is the solver's model (collectives by the α-β link model,
local work by flops and memory bandwidth), not a measurement. A memory budget (``memory_budget``,
else a GPU's memory) bounds each mesh's plan by explain's ``memory_bytes`` — the inputs and what
the layer loops hold, not the temporaries — and a mesh with no plan within it is refused.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax

from shardflow.api import Parallelized, parallelize
from shardflow.explain import Plan
from shardflow.mesh import LinkModel, make_mesh
from shardflow.specs import ShardingError


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
    out = []
    for shape in shapes:
        try:
            step = parallelize(fn, mesh=make_mesh(shape, devices=devices), in_specs=in_specs,
                               out_specs=out_specs, links=links, memory_budget=memory_budget,
                               passes=passes_lib.SOLVER if passes is None else passes)
            explained = step.explain(*args)
        except ShardingError as e:
            out.append(Candidate(shape, math.inf, None, None, refused=str(e)))
            continue
        out.append(Candidate(shape, explained.modelled_seconds, step, explained))
    return sorted(out, key=lambda c: c.seconds)
