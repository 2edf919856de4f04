"""Read the collectives of compiled HLO text, priced with the same ring formulas as ``explain``.

Used to check that what ``explain`` promises is what XLA runs:
``hlo.collectives(f.lower(*args).compile().as_text())``. Bytes are per device and per static
occurrence (a collective inside a loop body counts once, like ``Collective.bytes``).
"""
from __future__ import annotations

import dataclasses
import math
import re

_KINDS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
          "all-to-all": "all_to_all", "collective-permute": "ppermute"}
_ITEMSIZE = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "s16": 2, "s8": 1, "u64": 8,
             "u32": 4, "u16": 2, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"=\s*(?P<result>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                 r"(?:-start)?\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_SHAPE = re.compile(r"(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class HloCollective:
    kind: str
    group_size: int
    result_bytes: int
    operand_bytes: int
    bytes: int


def _bytes(text: str) -> int:
    total = 0
    for m in _SHAPE.finditer(text):
        if m.group("dtype") in _ITEMSIZE:
            dims = [int(d) for d in m.group("dims").split(",") if d]
            total += math.prod(dims) * _ITEMSIZE[m.group("dtype")]
    return total


def _group_size(attrs: str) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:  # replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}: groups span the named axes
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=\{", attrs)
    return 2 if m else 1


def collectives(hlo_text: str) -> list:
    out = []
    for line in hlo_text.splitlines():
        if "-done" in line.split("=")[-1][:40]:
            continue
        m = _OP.search(line)
        if not m:
            continue
        kind = _KINDS[m.group("op")]
        n = _group_size(m.group("attrs"))
        result = _bytes(m.group("result"))  # operand shapes are not always printed: derive them
        operand = result * n if kind == "reduce_scatter" else result // n if kind == "all_gather" else result
        if kind == "all_reduce":
            sent = 2 * (n - 1) / n * result
        elif kind == "all_gather":
            sent = (n - 1) / n * result
        elif kind in ("reduce_scatter", "all_to_all"):
            sent = (n - 1) / n * operand
        else:
            sent = operand
        out.append(HloCollective(kind, n, result, operand, int(round(sent))))
    return out


def total_bytes(hlo_text: str) -> int:
    return sum(c.bytes for c in collectives(hlo_text))
