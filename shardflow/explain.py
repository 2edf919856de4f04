"""``explain``: the report of a boxed program's plan (``Plan``, ``make_plan``): every collective,
its bytes and the user line behind it, the values' layouts, the modelled time and memory per
device, as ``costs`` computes them, and the matmuls that take FP8 operands."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from shardflow.costs import Totals, gathered_inputs, modelled
from shardflow.primitives import box_p
from shardflow.program import Program, all_eqns, source_line
from shardflow.specs import describe, format_sbp


@dataclasses.dataclass
class Plan(Totals):
    collectives: list
    inputs: list  # (argument name, shape, NdSbp)
    outputs: list  # (index, shape, NdSbp)
    values: list  # (primitive, source, shape, NdSbp) of every intermediate
    fallbacks: list  # (primitive, source) run whole for want of a rule
    planner: str = "greedy"  # which pass chose the shardings (passes.propagate or passes.solve)
    work_seconds: float = 0.0  # modelled local work of every equation (conversion.local_seconds)
    hidden_seconds: float = 0.0  # collectives a loop overlaps with its matmuls (``costs.overlap``)
    flops: float = 0.0  # per device: the local flops of every equation whose rule counts them
    input_bytes: int = 0  # per device: the arguments' blocks
    loop_bytes: int = 0  # per device: what the loops hold across the step (``costs.held_bytes``)
    gathered: list = dataclasses.field(
        default_factory=list
    )  # (argument, NdSbp, to, where, bytes): ``costs.gathered_inputs``
    fp8_gemms: list = dataclasses.field(default_factory=list)  # (operands, result, source) of FP8 dot_generals

    def __str__(self):
        rows = [("kind", "axes", "value", "bytes", "µs", "×", "source", "reason")]
        for c in self.collectives:
            rows.append(
                (
                    c.kind + "+" * c.combined,
                    ",".join(c.axes),
                    f"{c.dtype}{list(c.shape)}",
                    f"{c.bytes:,}",
                    f"{c.seconds * 1e6:.1f}",
                    str(c.count),
                    c.source,
                    c.reason,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        runs = sum(c.count for c in self.collectives)  # a row runs × times a call (a loop's trips)
        distinct = f" ({len(self.collectives)} distinct)" if runs != len(self.collectives) else ""
        combined = sum(c.count for c in self.collectives if c.combined)
        merged = f", {combined:,} of them run with others" if combined else ""
        lines.append(
            f"total: {self.total_bytes:,} bytes sent per device in {runs:,} collectives{distinct}{merged}, "
            f"{self.total_seconds * 1e6:.1f} µs modelled; planner: {self.planner}"
        )
        if combined:
            lines.append(
                "+: runs with a collective of its kind above over the same axes, independent of it, as one "
                "(XLA's combiners): no latency of its own"
            )
        if self.fallbacks:
            lines.append(
                "run whole for want of a rule (operands gathered to B): "
                + ", ".join(f"{p} at {s}" for p, s in self.fallbacks)
            )
        lines.append(
            f"memory per device, modelled: {self.input_bytes:,} bytes of inputs + {self.loop_bytes:,} "
            f"held by loops = {self.memory_bytes:,}"
        )
        lines.append(
            f"local work per device, modelled: {self.flops:,.0f} flops of matmuls and convolutions, "
            f"{self.work_seconds * 1e6:.1f} µs with the rest"
        )
        for name, src, dst, where, nbytes in self.gathered:
            lines.append(
                f"gathered whole over an axis its spec splits: {name} {src} -> {dst} at {where}, "
                f"{nbytes:,} bytes sent per device (the {self.planner.split()[0]} planner's choice)"
            )
        if self.fp8_gemms:
            lines.append(f"FP8 GEMMs ({len(self.fp8_gemms)}, a loop's body once):")
            lines += [f"  {operands} -> {result} at {source}" for operands, result, source in self.fp8_gemms]
        lines.append("inputs:  " + "; ".join(f"{n} {format_sbp(s)}" for n, _, s in self.inputs))
        lines.append("outputs: " + "; ".join(f"{i} {format_sbp(s)}" for i, _, s in self.outputs))
        return "\n".join(lines)


def make_plan(program: Program) -> Plan:
    jaxpr, arg_names = program.jaxpr.jaxpr, program.arg_names
    costs = modelled(program)
    inputs = [(n, tuple(v.aval.shape), program.sbp[v]) for n, v in zip(arg_names, jaxpr.invars)]
    outputs = [(i, tuple(v.aval.shape), s) for i, (v, s) in enumerate(zip(jaxpr.outvars, program.out_sbp))]
    values = [
        (
            e.primitive.name,
            e.params["source"] if e.primitive is box_p else source_line(e),
            describe(v.aval),
            program.sbp.get(v),
        )
        for e in all_eqns(jaxpr)
        for v in e.outvars
        if v in program.sbp
    ]
    fp8_gemms = [
        (" x ".join(describe(v.aval) for v in e.invars), describe(e.outvars[0].aval), source_line(e))
        for e in all_eqns(jaxpr)
        if e.primitive.name == "dot_general" and any(_is_fp8(v.aval.dtype) for v in e.invars)
    ]
    return Plan(
        costs.collectives,
        inputs,
        outputs,
        values,
        list(program.fallbacks),
        program.planner,
        costs.work_seconds,
        costs.hidden_seconds,
        costs.flops,
        costs.input_bytes,
        costs.loop_bytes,
        gathered_inputs(program),
        fp8_gemms,
    )


def _is_fp8(dtype) -> bool:
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)
