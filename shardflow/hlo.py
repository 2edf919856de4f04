"""Read the collectives of compiled HLO text, priced with the same ring formulas as ``explain``.

Used to check that what ``explain`` promises is what XLA runs, and to price XLA GSPMD's own
plans with the same yardstick: ``hlo.collectives(f.lower(*args).compile().as_text())``.

Bytes are per device. ``HloCollective.bytes`` is per static occurrence; ``HloCollective.count``
is how many times the occurrence runs per call of the module: the product of the
``known_trip_count`` XLA annotates on every enclosing while loop (1 where a loop's trip count is
not annotated; ``trip_count_known`` says so). ``total_bytes(text)`` sums static occurrences
(a collective inside a loop body once, like ``Collective.bytes``); ``total_bytes(text,
weighted=True)`` weights each by its count (like ``Plan.total_bytes``).

The replica-group forms XLA prints, all read here:

    replica_groups={{0,1,2,3},{4,5,6,7}}                  explicit lists
    replica_groups={}                                      every device of the module
    replica_groups=[2,4]<=[8]   [4,2]<=[2,4]T(1,0)        iota: [groups, group size]<=...
    replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}  mesh axes: group = those axes
    replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}
    replica_groups=mesh['a'=8] {'a':(1)2}                  a sub-axis of size 2
    source_target_pairs={{0,1},{1,0}}                      collective-permute
"""

from __future__ import annotations

import dataclasses
import math
import re

_KINDS = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all",
    "collective-permute": "ppermute",
}
_ITEMSIZE = {
    "f64": 8,
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "s64": 8,
    "s32": 4,
    "s16": 2,
    "s8": 1,
    "u64": 8,
    "u32": 4,
    "u16": 2,
    "u8": 1,
    "pred": 1,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "s4": 1,
    "u4": 1,
}
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<result>.*?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_SHAPE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*[(=]?.*\{\s*$")
_CALLEE = re.compile(
    r"\b(?P<key>body|condition|calls|to_apply|true_computation|false_computation)="
    r"%?(?P<name>[\w.\-]+)"
)
_CALLEES = re.compile(r"\b(?:branch_computations|calls)=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:\s*,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{(?P<group>[^}]*)\}"
)
_MESH_AXIS = re.compile(r"(?P<name>'[^']*'|\"[^\"]*\"|[^,=\s]+)\s*=\s*(?P<size>\d+)")
_GROUP_AXIS = re.compile(r"(?P<name>'[^']*'|\"[^\"]*\"|[^,:\s]+)(?::\((?P<pre>\d+)\)(?P<size>\d+))?")
_NUM_DEVICES = re.compile(r"\bnum_partitions=(\d+)")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_GROUPS = re.compile(  # the devices of a collective, as printed
    r"(?:replica_groups|source_target_pairs)="
    r"(?:mesh\[[^\]]*\][^{}]*\{[^}]*\}|\{(?:[^{}]|\{[^{}]*\})*\}|\[[^\]]*\]<=\[[^\]]*\](?:T\([^)]*\))?)"
)
COMBINED = ("all_reduce", "all_gather", "reduce_scatter")  # the collectives XLA's combiners merge
_NUM_REPLICAS = re.compile(r"\breplica_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class HloCollective:
    kind: str
    group_size: int
    result_bytes: int
    operand_bytes: int
    bytes: int  # per device, per execution
    count: int = 1  # executions per call: trip counts of the enclosing loops
    computation: str = ""  # the HLO computation it sits in
    trip_count_known: bool = True  # False: an enclosing loop had no known_trip_count (count 1)
    attrs: str = ""  # the instruction's text after its operands: replica groups, source-target pairs
    dtype: str = ""  # of its result
    # 1 + the highest level of the collectives of its kind, dtype and devices that it depends on
    # in its computation: those of one level are independent, and XLA's combiners may run them
    # as one (``combined``), as explain's model assumes of shardflow's plans
    level: int = 1

    def combine_key(self) -> tuple:
        return self.computation, self.kind, self.dtype, _groups_text(self.attrs)


def _groups_text(attrs: str) -> str:
    m = _GROUPS.search(attrs)
    return m.group(0) if m else ""


def combined(collectives: list) -> list:
    """Per collective, whether it runs with an earlier one of its ``combine_key`` and level as one
    collective (XLA's combiners: independent all-reduces, all-gathers or reduce-scatters of one
    kind over the same devices): the latency it does not pay in explain's model."""
    seen, out = set(), []
    for c in collectives:
        key = (c.combine_key(), c.level)
        out.append(c.kind in COMBINED and key in seen)
        seen.add(key)
    return out


def _bytes(text: str) -> int:
    total = 0
    for m in _SHAPE.finditer(text):
        if m.group("dtype") in _ITEMSIZE:
            dims = [int(d) for d in m.group("dims").split(",") if d]
            total += math.prod(dims) * _ITEMSIZE[m.group("dtype")]
    return total


def _top_level(text: str) -> list:
    """The top-level elements of a tuple shape ``(a, (b, c), d)``; ``[text]`` for a non-tuple."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                parts.append(text[start:i])
                break
        elif ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts if p.strip()]


def group_size(attrs: str, num_devices: int = 1) -> int:
    """Devices per replica group of a collective's attribute text (see the module docstring)."""
    m = _MESH.search(attrs)
    if m:
        sizes = {a.group("name").strip("'\""): int(a.group("size")) for a in _MESH_AXIS.finditer(m.group("axes"))}
        n = 1
        for a in _GROUP_AXIS.finditer(m.group("group")):
            n *= int(a.group("size")) if a.group("size") else sizes[a.group("name").strip("'\"")]
        return n
    if re.search(r"replica_groups=maximal_mesh\[", attrs):
        return 1
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,\s]*)\}", attrs)
    if m:
        return len([d for d in m.group(1).split(",") if d.strip()])
    if re.search(r"source_target_pairs=", attrs):
        return 2
    return num_devices  # replica_groups={} or none printed: one group of every device


def _moves(attrs: str) -> bool:
    """Whether a collective-permute moves data between devices (not only {i,i} pairs)."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?\s*)*)\}", attrs)
    if not m:
        return True
    return any(a != b for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)))


def _computations(lines: list) -> tuple:
    """({computation: [instruction lines]}, entry name)."""
    comps, entry, current = {}, None, None
    for line in lines:
        if not line.strip():
            continue
        if not line[0].isspace():
            m = _HEADER.match(line)
            if line.startswith("HloModule"):
                continue
            if m and (current is None or "->" in line):
                current = m.group("name")
                comps[current] = []
                if m.group("entry"):
                    entry = current
                continue
            if line.startswith("}"):
                current = None
                continue
        if current is not None:
            comps[current].append(line)
    return comps, entry


def _multipliers(comps: dict, entry) -> tuple:
    """{computation: executions per call} and {computation: every enclosing trip count known}."""
    callers = {}  # callee -> [(caller, factor, known)]
    for caller, body in comps.items():
        for line in body:
            trip = _TRIP.search(line)
            is_while = re.search(r"\swhile\(", line) is not None
            names = [(m.group("key"), m.group("name")) for m in _CALLEE.finditer(line)]
            for m in _CALLEES.finditer(line):
                names += [("branch", n.strip().lstrip("%")) for n in m.group("names").split(",") if n.strip()]
            for key, name in names:
                if name not in comps:
                    continue
                factor, known = 1, True
                if is_while and key in ("body", "condition"):
                    factor, known = (int(trip.group(1)), True) if trip else (1, False)
                callers.setdefault(name, []).append((caller, factor, known))
    mult, known_all = {}, {}

    def visit(name, stack=()):
        if name in mult:
            return mult[name], known_all[name]
        if name == entry or name not in callers or name in stack:
            mult[name], known_all[name] = 1, True
            return 1, True
        total, known = 0, True
        for caller, factor, k in callers[name]:
            m, kc = visit(caller, stack + (name,))
            total += m * factor
            known = known and k and kc
        mult[name], known_all[name] = total, known
        return total, known

    for name in comps:
        visit(name)
    return mult, known_all


def collectives(hlo_text: str) -> list:
    """Every collective of the module, in text order, with its per-device bytes and trip count."""
    lines = hlo_text.splitlines()
    m = _NUM_DEVICES.search(hlo_text)
    num_devices = int(m.group(1)) if m else 1
    if num_devices == 1:
        m = _NUM_REPLICAS.search(hlo_text)
        num_devices = int(m.group(1)) if m else 1
    comps, entry = _computations(lines)
    if not comps:  # bare instruction lines
        comps = {"": lines}
    mult, known = _multipliers(comps, entry)
    out = []
    for comp, body in comps.items():
        below = {}  # instruction -> {combine key: the highest level it depends on}
        for line in body:
            instruction = _INSTRUCTION.match(line)
            seen = {}
            if instruction:
                for name in _NAME.findall(instruction.group("rest")):
                    for key, level in below.get(name, {}).items():
                        seen[key] = max(seen.get(key, 0), level)
                below[instruction.group("name")] = seen
            m = _OP.match(line)
            if not m:
                continue
            kind = _KINDS[m.group("op")]
            n = group_size(m.group("attrs"), num_devices)
            result_text = m.group("result")
            if m.group("start") and kind in ("all_gather", "ppermute"):
                parts = _top_level(result_text)  # async start: (operands, results[, contexts])
                result_text = parts[1] if len(parts) > 1 else parts[0]
            result = _bytes(result_text)  # operand shapes are not always printed: derive them
            first = _SHAPE.search(result_text)
            dtype = first.group("dtype") if first else ""
            operand = result * n if kind == "reduce_scatter" else result // n if kind == "all_gather" else result
            if kind == "all_reduce":
                sent = 2 * (n - 1) / n * result
            elif kind == "all_gather":
                sent = (n - 1) / n * result
            elif kind in ("reduce_scatter", "all_to_all"):
                sent = (n - 1) / n * operand
            else:  # ppermute: a device sends its operand, unless every pair is a self-pair
                sent = operand if _moves(m.group("attrs")) else 0
            out.append(
                HloCollective(
                    kind,
                    n,
                    result,
                    operand,
                    int(round(sent)),
                    mult.get(comp, 1),
                    comp,
                    known.get(comp, True),
                    m.group("attrs"),
                    dtype,
                )
            )
            key = out[-1].combine_key()
            out[-1] = dataclasses.replace(out[-1], level=seen.get(key, 0) + 1)
            if instruction:
                below[instruction.group("name")] = {**seen, key: out[-1].level}
    return out


def total_bytes(hlo_text: str, weighted: bool = False) -> int:
    """Per-device bytes of every collective: per static occurrence, or (``weighted``) per call of
    the module, each occurrence times the trip counts of its enclosing loops."""
    return sum(c.bytes * (c.count if weighted else 1) for c in collectives(hlo_text))


def summary(hlo_text: str, weighted: bool = True) -> dict:
    """{kind: (occurrences, bytes)} of the module."""
    out = {}
    for c in collectives(hlo_text):
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + 1, b + c.bytes * (c.count if weighted else 1))
    return out
