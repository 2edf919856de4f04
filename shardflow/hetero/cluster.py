"""A cluster: nodes of devices of one kind each, the links within a node and between nodes.

An inventory such as ``{"H100": 8, "A100-40GB": 8}`` becomes nodes of ``per_node`` devices
(8 unless given per kind); within a node devices talk over NVLink where the kind has it, else
PCIe; between nodes over each node's network (``inter_node_GBps`` each way per node, shared by
its devices). Every number may be overridden by a measured one (``intra_GBps`` per kind)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shardflow.hetero.devices import GB, DeviceKind, device_kind


@dataclasses.dataclass(frozen=True)
class Node:
    kind: DeviceKind
    devices: int
    intra: float  # bytes / s each way per device, between devices of this node
    inter: float  # bytes / s each way, this node to the others (shared by its devices)


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    intra_latency: float = 5e-6  # seconds per collective step within a node
    inter_latency: float = 20e-6  # and between nodes

    @classmethod
    def from_inventory(
        cls,
        inventory: Mapping[str, int],
        *,
        per_node: int | Mapping[str, int] = 8,
        inter_node_GBps: float | Mapping[str, float] = 25.0,
        intra_GBps: Mapping[str, float] | None = None,
    ) -> Cluster:
        """Nodes of ``per_node`` devices (per kind where a mapping) holding ``inventory``'s
        devices, kinds in the inventory's order; ``inter_node_GBps`` each node's network (200
        Gb/s = 25 GB/s by default, per kind where a mapping); ``intra_GBps`` measured
        device-to-device bandwidths within a node, per kind, in place of the catalogue's."""
        nodes = []
        for name, count in inventory.items():
            kind = device_kind(name)
            size = per_node[name] if isinstance(per_node, Mapping) else per_node
            if count < 1 or size < 1:
                raise ValueError(f"cluster: {count} x {name} in nodes of {size}: both must be positive")
            inter = (inter_node_GBps[name] if isinstance(inter_node_GBps, Mapping) else inter_node_GBps) * GB
            intra = (intra_GBps or {}).get(name)
            intra = intra * GB if intra is not None else (kind.nvlink or kind.pcie)
            full, rest = divmod(count, size)
            nodes += [Node(kind, size, intra, inter)] * full + ([Node(kind, rest, intra, inter)] if rest else [])
        return cls(tuple(nodes))

    @classmethod
    def from_config(cls, block: Mapping) -> Cluster:
        """From a config's ``cluster:`` block: ``inventory`` (kind: count) and optionally
        ``per_node``, ``inter_node_GBps``, ``intra_GBps``."""
        unknown = set(block) - {"inventory", "per_node", "inter_node_GBps", "intra_GBps"}
        if unknown or "inventory" not in block:
            raise ValueError(
                f"cluster: keys {sorted(unknown)} unknown"
                if unknown
                else "cluster: needs an inventory, e.g. {inventory: {H100: 8, A100-40GB: 8}}"
            )
        return cls.from_inventory(block["inventory"], **{k: v for k, v in block.items() if k != "inventory"})

    @property
    def size(self) -> int:
        return sum(n.devices for n in self.nodes)

    def inventory(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.kind.name] = counts.get(n.kind.name, 0) + n.devices
        return counts

    def without(self, kind: str, count: int) -> Cluster:
        """The cluster after losing ``count`` devices of ``kind`` (a preemption), from its last
        nodes of that kind."""
        nodes, left = list(self.nodes), count
        for i in reversed(range(len(nodes))):
            if left and nodes[i].kind.name == kind:
                take = min(left, nodes[i].devices)
                nodes[i] = dataclasses.replace(nodes[i], devices=nodes[i].devices - take)
                left -= take
        if left:
            raise ValueError(f"cluster: cannot lose {count} x {kind}; it has {self.inventory().get(kind, 0)}")
        return dataclasses.replace(self, nodes=tuple(n for n in nodes if n.devices))
