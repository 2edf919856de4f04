"""``explain``: every collective of a boxed program, its bytes, and the user line behind it."""
from __future__ import annotations

import dataclasses

from jax import lax

from shardflow.primitives import box_p
from shardflow.program import Program, all_eqns, is_literal, open_jaxpr, source_line, subjaxprs
from shardflow.specs import as_dtype, describe, format_sbp


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str          # all_reduce | all_gather | reduce_scatter | all_to_all | ppermute
    axes: tuple        # mesh axis names
    shape: tuple       # global shape of the value converted
    dtype: str
    bytes: int         # per-device bytes sent, per execution
    count: int         # executions per call (trip counts of enclosing scans)
    source: str        # file.py:LINE of the user code that made the value
    used_at: str       # file.py:LINE of the use that needed the conversion
    reason: str
    src: str           # NdSbp before / after the whole conversion
    dst: str


@dataclasses.dataclass
class Plan:
    collectives: list
    inputs: list       # (argument name, shape, NdSbp)
    outputs: list      # (index, shape, NdSbp)
    values: list       # (primitive, source, shape, NdSbp) of every intermediate
    fallbacks: list    # (primitive, source) run whole for want of a rule

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes * c.count for c in self.collectives)

    def bytes_by_kind(self) -> dict:
        out = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + c.bytes * c.count
        return out

    def __str__(self):
        rows = [("kind", "axes", "value", "bytes", "×", "source", "reason")]
        for c in self.collectives:
            rows.append((c.kind, ",".join(c.axes), f"{c.dtype}{list(c.shape)}", f"{c.bytes:,}", str(c.count),
                         c.source, c.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"total: {self.total_bytes:,} bytes sent per device in {len(self.collectives)} collectives")
        if self.fallbacks:
            lines.append("run whole for want of a rule (operands gathered to B): "
                         + ", ".join(f"{p} at {s}" for p, s in self.fallbacks))
        lines.append("inputs:  " + "; ".join(f"{n} {format_sbp(s)}" for n, _, s in self.inputs))
        lines.append("outputs: " + "; ".join(f"{i} {format_sbp(s)}" for i, _, s in self.outputs))
        return "\n".join(lines)


def _collectives(program: Program, jaxpr, count: int, out: list):
    for eqn in jaxpr.eqns:
        if eqn.primitive is box_p:
            x = eqn.invars[0]
            for st in eqn.params["steps"]:
                if st.is_collective:
                    out.append(Collective(st.kind, st.axes, tuple(x.aval.shape), as_dtype(x.aval.dtype).name,
                                          st.bytes, count, eqn.params["source"], eqn.params["used_at"],
                                          eqn.params["reason"], format_sbp(eqn.params["src"]),
                                          format_sbp(eqn.params["dst"])))
        trips = eqn.params.get("length", 1) if eqn.primitive is lax.scan_p else 1
        for _, value in subjaxprs(eqn.params):
            for j in value if isinstance(value, tuple) else (value,):
                _collectives(program, open_jaxpr(j), count * trips, out)


def make_plan(program: Program, arg_names) -> Plan:
    jaxpr = program.jaxpr.jaxpr
    collectives = []
    _collectives(program, jaxpr, 1, collectives)
    inputs = [(n, tuple(v.aval.shape), program.sbp[v]) for n, v in zip(arg_names, jaxpr.invars)]
    outputs = [(i, tuple(v.aval.shape), program.sbp[v] if not is_literal(v) else None)
               for i, v in enumerate(jaxpr.outvars)]
    values = [(e.primitive.name, source_line(e), describe(v.aval), program.sbp.get(v))
              for e in all_eqns(jaxpr) for v in e.outvars if v in program.sbp]
    return Plan(collectives, inputs, outputs, values, list(program.fallbacks))
