"""A compiled program's modelled time, priced from its HLO by shardflow's link model.

GSPMD's plan exists only as compiled HLO, so to put it and shardflow's plan on one yardstick
both are priced from their HLO by the same function and the same ``sf.LinkModel``:

  collectives  each collective of the HLO (``shardflow.hlo``: kind, ring-priced bytes per device,
               executions per call) at ``links.seconds(axes, bytes)``, its mesh axes read from
               its replica groups (or source-target pairs); independent all-reduces,
               all-gathers or reduce-scatters of one kind over the same devices pay one
               latency (``hlo.combined``), as XLA's combiners on GPU run them and as explain
               prices shardflow's plans (XLA:CPU combines the all-reduces only)
  work         XLA's cost analysis of the module (flops, bytes accessed) at
               ``links.compute_seconds`` — a while loop's body counted once, in both engines

No overlap of collectives with compute is credited to either plan.

    priced = price(compiled, mesh_shape, sf.LinkModel())
    priced.seconds, priced.collective_seconds, priced.work_seconds
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from shardflow import hlo

_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[0-9,\s]*\},?\s*)*)\}")
_IOTA = r"\[(?P<shape>[0-9,]+)\]<=\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?"
_IOTA_GROUPS = re.compile(r"replica_groups=" + _IOTA)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?\s*)*)\}")
_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:\s*,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?\s*\{(?P<group>[^}]*)\}"
)
_DEVICE_IDS = re.compile(r"\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?")  # mesh[...], device_ids=(...)
_MESH_AXIS = re.compile(r"'(?P<name>[^']*)'\s*=\s*(?P<size>\d+)")
_GROUP_AXIS = re.compile(r"'(?P<name>[^']*)'(?::\((?P<pre>\d+)\)(?P<size>\d+))?")


def _ints(text: str) -> tuple:
    return tuple(int(d) for d in text.split(",") if d.strip())


def _iota(m, shape=None) -> np.ndarray:
    """The device ids of an iota tile assignment ``[shape]<=[dims]T(perm)``, or of a mesh's
    ``device_ids=([dims]T(perm))`` (flat)."""
    ids = np.arange(math.prod(_ints(m.group("dims")))).reshape(_ints(m.group("dims")))
    if m.group("perm"):
        ids = ids.transpose(_ints(m.group("perm")))
    return ids.reshape(_ints(m.group("shape")) if shape is None else shape)


def _mesh_groups(m) -> list:
    """The groups of ``replica_groups=mesh[axes], device_ids=(iota) {group axes}``: the module's
    devices laid on its mesh, one group per index of the axes the collective does not span. A
    sub-axis ``'a':(pre)size`` spans the middle factor of ``a`` split as pre × size × rest."""
    axes = [(a.group("name"), int(a.group("size"))) for a in _MESH_AXIS.finditer(m.group("axes"))]
    n = math.prod(size for _, size in axes)
    ids = _iota(_DEVICE_IDS.match(m.group("ids").strip()), (-1,)) if m.group("ids") else np.arange(n)
    spans = {g.group("name"): g for g in _GROUP_AXIS.finditer(m.group("group"))}
    dims, spanned = [], []
    for name, size in axes:
        g = spans.get(name)
        if g is not None and g.group("size"):
            pre, sub = int(g.group("pre")), int(g.group("size"))
            spanned.append(len(dims) + 1)
            dims += [pre, sub, size // (pre * sub)]
        else:
            if g is not None:
                spanned.append(len(dims))
            dims.append(size)
    grid = ids.reshape(dims)
    rest = [k for k in range(len(dims)) if k not in spanned]
    width = math.prod(dims[k] for k in spanned)
    return [tuple(g) for g in grid.transpose(rest + spanned).reshape(-1, width)]


def device_groups(attrs: str, num_devices: int) -> list:
    """The device groups of a collective's attribute text (the forms of ``shardflow.hlo``'s
    docstring): its replica groups, or for a collective-permute its moving source-target
    pairs; one group of every device where none is printed (``replica_groups={}``)."""
    if m := _PAIRS.search(attrs):
        return [p for p in (_ints(s) for s in re.findall(r"\{(\d+,\d+)\}", m.group(1))) if p[0] != p[1]]
    if m := _MESH.search(attrs):
        return _mesh_groups(m)
    if m := _IOTA_GROUPS.search(attrs):
        return [tuple(g) for g in _iota(m)]
    if (m := _EXPLICIT.search(attrs)) and m.group(1).strip():
        return [_ints(g) for g in re.findall(r"\{([0-9,\s]*)\}", m.group(1))]
    return [tuple(range(num_devices))]


def mesh_axes(groups: list, mesh_shape: dict) -> tuple:
    """The mesh axes (in mesh order) along which the members of any group differ: device ``i``
    of the module is the mesh's ``i``-th device in row-major order, as jax.jit numbers a
    NamedSharding's partitions and shard_map its devices."""
    names, sizes = tuple(mesh_shape), tuple(mesh_shape.values())
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
        varying.update(k for k in range(len(names)) if len(set(coords[:, k])) > 1)
    return tuple(names[k] for k in sorted(varying))


def collective_axes(c: hlo.HloCollective, mesh_shape: dict) -> tuple:
    return mesh_axes(device_groups(c.attrs, math.prod(mesh_shape.values())), mesh_shape)


@dataclasses.dataclass(frozen=True)
class Priced:
    collective_seconds: float
    work_seconds: float
    bytes: int  # collective bytes per device per call (hlo.total_bytes(weighted=True))
    flops: float | None
    collectives: int  # executions per call

    @property
    def seconds(self) -> float:
        return self.collective_seconds + self.work_seconds


def cost_analysis(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return dict(cost or {})


def price(compiled, mesh_shape: dict, links) -> Priced:
    """``compiled`` (a jax Compiled, of jax.jit or of sf.parallelize) priced by ``links``. Where
    XLA cannot cost the module (a TopK custom call on CPU: flops -1) its work is priced at 0."""
    collectives = [c for c in hlo.collectives(compiled.as_text()) if c.bytes]
    comm = 0.0
    for c, joined in zip(collectives, hlo.combined(collectives)):
        axes = collective_axes(c, mesh_shape)
        comm += c.count * (links.seconds(axes, c.bytes) - (links.latency(axes) if joined else 0.0))
    cost = cost_analysis(compiled)
    flops, accessed = cost.get("flops", -1.0), cost.get("bytes accessed", -1.0)
    known = flops >= 0 and accessed >= 0
    work = links.compute_seconds(flops, accessed) if known else 0.0
    return Priced(
        comm,
        work,
        sum(c.bytes * c.count for c in collectives),
        float(flops) if flops >= 0 else None,
        sum(c.count for c in collectives),
    )
