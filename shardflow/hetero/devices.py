"""The device catalogue: per GPU kind its datasheet peaks (dense tensor-core flop/s per
precision), memory, memory bandwidth and links, as NVIDIA publishes them. A measured profile
overrides any of them (``DeviceKind.replace``); the simulator's calibration does that for the
sustained fraction of peak.

Peaks are dense (half the sparse figures NVIDIA often leads with); GeForce parts' fp16 / bf16
peaks are with fp32 accumulate (what mixed-precision training runs), half their fp16-accumulate
rate. ``fp32`` is the CUDA-core rate; ``tf32`` the tensor-core rate fp32 matmuls reach where
TF32 is allowed (PyTorch's default for cuDNN, NGC's for cuBLAS)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

TB, GB = 1e12, 1e9


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    name: str
    memory: float  # bytes
    memory_bandwidth: float  # bytes / s
    peak: Mapping[str, float]  # precision ("fp8", "bf16", "fp16", "tf32", "fp32") -> dense flop/s
    nvlink: float | None  # bytes / s each way per device, None where the part has no NVLink
    pcie: float  # bytes / s each way per device
    source: str

    def flops(self, precision: str) -> float:
        """Peak flop/s of matmuls in ``precision``; a ValueError naming the kind where it has
        no such unit (a V100 has no bf16)."""
        if self.peak.get(precision) is None:
            has = ", ".join(sorted(p for p, v in self.peak.items() if v))
            raise ValueError(f"device kind {self.name} has no {precision} tensor cores (it has {has})")
        return self.peak[precision]

    def replace(self, **changes) -> DeviceKind:
        return dataclasses.replace(self, **changes)


_HOPPER = dict(fp8=1979, bf16=989, fp16=989, tf32=494, fp32=67)
_AMPERE = dict(bf16=312, fp16=312, tf32=156, fp32=19.5)
_A10G_SOURCE = (
    "no NVIDIA datasheet (an AWS part): the A10's memory, its tensor rate at fp32 accumulate estimated as half "
    "the A10's; override with a measured profile"
)
# fmt: off
_ROWS = (  # name, memory GB, memory GB/s, NVLink GB/s each way (None: none), PCIe GB/s each way, dense TFLOP/s, source
    ("H100", 80, 3350, 450, 64, _HOPPER, "H100 Tensor Core GPU datasheet, SXM5"),
    ("H100-PCIe", 80, 2000, 300, 64, dict(fp8=1513, bf16=756, fp16=756, tf32=378, fp32=51), "H100 datasheet, PCIe"),
    ("H200", 141, 4800, 450, 64, _HOPPER, "H200 Tensor Core GPU datasheet, SXM"),
    ("GH200", 96, 4000, 450, 64, _HOPPER, "GH200 Grace Hopper Superchip datasheet, 96 GB HBM3"),
    ("A100-40GB", 40, 1555, 300, 32, _AMPERE, "A100 Tensor Core GPU datasheet, 40GB SXM"),
    ("A100-80GB", 80, 2039, 300, 32, _AMPERE, "A100 Tensor Core GPU datasheet, 80GB SXM"),
    ("L4", 24, 300, None, 32, dict(fp8=242, bf16=121, fp16=121, tf32=60, fp32=30.3), "L4 Tensor Core GPU datasheet"),
    ("A10", 24, 600, None, 32, dict(bf16=125, fp16=125, tf32=62.5, fp32=31.2), "A10 Tensor Core GPU datasheet"),
    ("A10G", 24, 600, None, 32, dict(bf16=62.5, fp16=62.5, tf32=31.2, fp32=31.2), _A10G_SOURCE),
    ("V100-16GB", 16, 900, 150, 16, dict(fp16=125, fp32=15.7), "V100 Tensor Core GPU datasheet, SXM2"),
    ("V100-32GB", 32, 900, 150, 16, dict(fp16=125, fp32=15.7), "V100 Tensor Core GPU datasheet, SXM2"),
    ("T4", 16, 320, None, 16, dict(fp16=65, fp32=8.1), "T4 Tensor Core GPU datasheet"),
    ("RTX-3090", 24, 936, 56, 32, dict(bf16=71, fp16=71, tf32=35.6, fp32=35.6), "GA102 whitepaper, RTX 3090"),
    ("RTX-4090", 24, 1008, None, 32, dict(fp8=330, bf16=165, fp16=165, tf32=82.6, fp32=82.6), "Ada whitepaper"),
    ("RTX-2080Ti", 11, 616, 50, 16, dict(fp16=56.9, fp32=14.2), "Turing whitepaper, RTX 2080 Ti FE"),
    ("Titan-RTX", 24, 672, 50, 16, dict(fp16=130, fp32=16.3), "TITAN RTX specifications"),
)
# fmt: on
CATALOGUE: dict[str, DeviceKind] = {
    name: DeviceKind(
        name,
        memory * GB,
        bandwidth * GB,
        {precision: tflops * TB for precision, tflops in peaks.items()},
        None if nvlink is None else nvlink * GB,
        pcie * GB,
        source,
    )
    for name, memory, bandwidth, nvlink, pcie, peaks, source in _ROWS
}
ALIASES = {
    "H100-SXM": "H100",
    "H200-SXM": "H200",
    "A100": "A100-80GB",
    "V100": "V100-32GB",
    "RTX-2080-Ti": "RTX-2080Ti",
}


def device_kind(name: str) -> DeviceKind:
    """The catalogue's entry for ``name`` (or an alias), or a ValueError listing the kinds."""
    found = CATALOGUE.get(ALIASES.get(name, name))
    if found is None:
        raise ValueError(f"unknown device kind {name!r}; the catalogue has {', '.join(CATALOGUE)}")
    return found


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[^0-9A-Z]+", name.upper()) if t]


def catalogue_kind(device_kind: str, kinds=CATALOGUE) -> str | None:
    """Which of ``kinds`` (catalogue names) a device whose jax ``device_kind`` is the given string
    is ("NVIDIA A100-SXM4-40GB" is an A100-40GB): every token of the kind's name is one of the
    string's tokens, or consecutive ones run together ("RTX 2080 Ti" for RTX-2080Ti); the kind
    naming the most tokens, where several match (H100-PCIe over H100); None where none does."""
    device = _tokens(device_kind)
    joined = {"".join(device[i:j]) for i in range(len(device)) for j in range(i + 1, len(device) + 1)}
    matches = [k for k in kinds if all(t in joined for t in _tokens(k))]
    return max(matches, key=lambda k: len(_tokens(k)), default=None)


def memory_limit(devices) -> int | None:
    """The fewest bytes XLA may allocate on any of ``devices`` (None unless they are GPUs). In
    one SPMD program every device holds blocks of the same shapes, so the smallest device bounds
    the plan. A device of this process counts at its own limit (``memory_stats``); one of another
    host, whose memory this process cannot read, at the limit of a device here of its kind, else
    at its kind's catalogue memory times the share of the catalogue's memory XLA may take here.
    None, as for other platforms, where a device here reports no limit; a ValueError where
    another host's device's memory cannot be known that way."""
    import jax

    devices = list(devices)
    if not devices or devices[0].platform != "gpu":
        return None
    here = [d for d in devices if d.process_index == jax.process_index()]
    by_kind: dict[str, int] = {}
    for d in here:
        limit = (d.memory_stats() or {}).get("bytes_limit")
        if limit is None:
            return None
        by_kind[d.device_kind] = min(limit, by_kind.get(d.device_kind, limit))
    shares = [by_kind[k] / CATALOGUE[c].memory for k in by_kind if (c := catalogue_kind(k)) is not None]
    limits = []
    for kind in {d.device_kind for d in devices} - set(by_kind):
        name = catalogue_kind(kind)
        if name is None or not shares:
            raise ValueError(
                f"the memory of the {kind} devices of other hosts is unknown here "
                f"({'not a catalogue kind' if name is None else 'no device here of a catalogue kind to scale it by'})"
            )
        limits.append(int(CATALOGUE[name].memory * min(shares)))
    return min(list(by_kind.values()) + limits)
