"""Collective bytes of shardflow's plan vs XLA GSPMD's, for the same programs, specs and mesh.

    python benchmarks/bytes_vs_gspmd.py [--only REGEX] [--no-train] [--out results.md]

Rows: the programs of benchmarks/gspmd_programs.py (flax NNX/Linen models, optax optimizers and
losses, an MoE layer, single ops in the manner of JAX's pjit tests) under each strategy, then
the `shardflow train` step (Llama tiny) under the trainer's five strategies. Per row:

  error      max relative error of shardflow's result vs the same function on one device
             (jax.jit without shardings); "FAIL ..." when shardflow raised. The train rows
             compare with the GSPMD engine's step instead (bf16 compute)
  fallbacks  equations shardflow ran whole for want of a rule (len(plan.fallbacks)), by primitive
  sf B       collective bytes per device of shardflow's compiled HLO
  GSPMD B    the same for jax.jit(fn, in_shardings=..., out_shardings=...) of the same specs
  ratio      sf B / GSPMD B
  flops      shardflow's per-device flops / GSPMD's, by XLA's cost analysis of each compiled
             program (a loop body counted once in both)

Both byte counts come from the compiled HLO, read by the same parser (shardflow.hlo): per
device, ring-priced, and collectives inside while loops weighted by XLA's known_trip_count
(loops weighted by trip count in both engines). Runs on 8 simulated CPU devices, mesh
{data: 2, model: 4}; deterministic (fixed seeds, fixed shapes). XLA:CPU compiles at LLVM -O0
(--xla_backend_optimization_level=0: the HLO passes, SPMD partitioning included, are unchanged,
so are the bytes; --full-opt for the default).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

if "jax" not in sys.modules:  # run as a script: 8 simulated CPU devices; LLVM at -O0 unless --full-opt
    # (XLA's HLO passes, the SPMD partitioner among them, run the same at every backend level:
    # the collectives do not change, the compile takes about half the time)
    flags = ["--xla_force_host_platform_device_count=8"]
    if "--full-opt" not in sys.argv:
        flags.append("--xla_backend_optimization_level=0")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + flags).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _checkout  # noqa: E402,F401  (the repository's shardflow, before any shardflow import)
import _results  # noqa: E402

TRAIN_STRATEGIES = ("dp", "fsdp", "tp", "tp_sp", "2d")


@dataclasses.dataclass
class Row:
    program: str
    strategy: str
    error: float | None = None  # None: shardflow failed (see failure)
    fallbacks: tuple = ()  # primitive names, one per fallback
    sf_bytes: int | None = None
    gspmd_bytes: int | None = None
    sf_flops: float | None = None
    gspmd_flops: float | None = None
    failure: str | None = None
    expected_failure: str | None = None
    sf_kinds: dict = dataclasses.field(default_factory=dict)  # {kind: (occurrences, bytes)}
    gspmd_kinds: dict = dataclasses.field(default_factory=dict)
    plan: object = None  # shardflow's Plan (for the analysis)
    seconds: float = 0.0

    @property
    def ratio(self):
        if self.sf_bytes is None or self.gspmd_bytes is None:
            return None
        if self.gspmd_bytes == 0:
            return 1.0 if self.sf_bytes == 0 else float("inf")
        return self.sf_bytes / self.gspmd_bytes

    @property
    def flops_ratio(self):
        if self.sf_flops is None or not self.gspmd_flops:
            return None
        return self.sf_flops / self.gspmd_flops


def _failure(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:160]


def measure(case, references: dict, planner: str = "greedy") -> Row:
    """One row: shardflow's result vs one device, its plan and HLO bytes, GSPMD's HLO bytes."""

    import gspmd_programs as gp

    from shardflow import hlo

    t0 = time.perf_counter()
    row = Row(case.program, case.strategy, expected_failure=case.xfail)
    fn, args, in_specs, out_specs = case.build()
    if case.program not in references:  # the same function and arguments under every strategy
        references[case.program] = gp.reference(fn, args)
    want = references[case.program]
    compiled = gp.gspmd(fn, in_specs, out_specs).lower(*args).compile()
    text, row.gspmd_flops = compiled.as_text(), gp.flops(compiled)
    row.gspmd_bytes, row.gspmd_kinds = hlo.total_bytes(text, weighted=True), hlo.summary(text)
    try:
        row.plan, compiled, got = gp.run_shardflow(fn, args, in_specs, out_specs, planner)
        text, row.sf_flops = compiled.as_text(), gp.flops(compiled)
        row.fallbacks = tuple(p for p, _ in row.plan.fallbacks)
        row.sf_bytes, row.sf_kinds = hlo.total_bytes(text, weighted=True), hlo.summary(text)
        row.error = gp.max_rel_error(got, want)
    except Exception as e:  # noqa: BLE001  (a row records shardflow's failure; the suite goes on)
        row.failure = _failure(e)
    row.seconds = time.perf_counter() - t0
    return row


# ------------------------------------------------------------------------------ the trainer's rows


def _trainer():
    """(config module, trainer): the shardflow.train package and its config module, or the
    older single-module layout (shardflow.config, shardflow.train)."""
    try:
        from shardflow import train
        from shardflow.train import config

        return config, train
    except ImportError:
        from shardflow import config, train

        return config, train


def _call(compiled, args):
    """Run an executable of ``lower(*args).compile()``: jax.jit's takes the argument trees,
    shardflow's the flat leaves; the outputs' leaves either way."""
    import jax

    try:
        out = compiled(*args)
    except TypeError:
        out = compiled(*jax.tree.leaves(args))
    return jax.tree.leaves(jax.device_get(out))


def train_row(strategy, preset="tiny", batch=16, seq=128, planner="greedy") -> Row:
    """The `shardflow train` step built twice — engine "shardflow" (sf.parallelize) and engine
    "jit" (GSPMD) — with the same specs and the same initial state, each compiled once; bytes
    from both HLOs. The error column compares shardflow's new parameters and metrics with
    GSPMD's: the step computes in bf16, so a one-device fp32 run is no yardstick. ``planner``
    other than "greedy": the trainer's `planner: solver` (its objective is the modelled time
    with the default link model; the trainer has no bytes objective)."""
    import gspmd_programs as gp
    import jax
    import numpy as np

    from shardflow import hlo

    config_lib, train_lib = _trainer()
    t0 = time.perf_counter()
    row = Row("llama_train", strategy)
    state, outputs = None, {}
    for engine in ("jit", "shardflow"):
        try:
            cfg = config_lib.Config()
            cfg.model = {"preset": preset}
            cfg.engine, cfg.strategy, cfg.mesh = engine, strategy, dict(gp.MESH_SHAPE)
            cfg.planner = "greedy" if planner == "greedy" else "solver"
            cfg.batch_size, cfg.data.seq_len = batch, seq
            run = train_lib.setup(cfg)
            if state is None:  # one initial state for both (the steps donate theirs)
                vocab = min(256, run.model_cfg.vocab_size)
                tokens = np.random.default_rng(0).integers(0, vocab, (1, batch, seq)).astype(np.int32)
                data = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=2)}
                state = jax.device_get(train_lib.init_state(run))
            step = run.train_step()
            args = (*state, data)
            compiled = step.lower(*args).compile()
            text = compiled.as_text()
            kinds, total = hlo.summary(text), hlo.total_bytes(text, weighted=True)
            if engine == "shardflow":
                row.sf_bytes, row.sf_kinds, row.sf_flops = total, kinds, gp.flops(compiled)
                row.plan = step.explain(*args)
                row.fallbacks = tuple(p for p, _ in row.plan.fallbacks)
            else:
                row.gspmd_bytes, row.gspmd_kinds, row.gspmd_flops = total, kinds, gp.flops(compiled)
            outputs[engine] = _call(compiled, args)
        except Exception as e:  # noqa: BLE001
            if engine == "shardflow":
                row.failure = _failure(e)
            else:
                raise
    if "shardflow" in outputs:  # new parameters and metrics (the moments of near-zero bf16 gradients are noise)
        n_params, n_opt = len(jax.tree.leaves(state[0])), len(jax.tree.leaves(state[1]))
        pick = lambda out: out[:n_params] + out[n_params + n_opt :]  # noqa: E731
        row.error = gp.max_rel_error(pick(outputs["shardflow"]), pick(outputs["jit"]))
    row.seconds = time.perf_counter() - t0
    return row


# ------------------------------------------------------------------------------ the table

COLUMNS = ("program", "strategy", "error", "fallbacks", "shardflow B", "GSPMD B", "ratio", "flops", "planner")


def _fallbacks(row: Row) -> str:
    if not row.fallbacks:
        return "0"
    counts = {}
    for p in row.fallbacks:
        counts[p] = counts.get(p, 0) + 1
    return f"{len(row.fallbacks)} (" + ", ".join(f"{p}×{n}" if n > 1 else p for p, n in counts.items()) + ")"


def cells(row: Row) -> tuple:
    fmt = lambda b: "—" if b is None else f"{b:,}"  # noqa: E731
    if row.failure:
        error = "FAIL " + row.failure + (" (expected)" if row.expected_failure else "")
    else:
        error = f"{row.error:.1e}"
    ratio = "—" if row.ratio is None else f"{row.ratio:.2f}"
    flops = "—" if row.flops_ratio is None else f"{row.flops_ratio:.2f}"
    planner = "—" if row.plan is None else row.plan.planner.split()[0]
    return (
        row.program,
        row.strategy,
        error,
        _fallbacks(row),
        fmt(row.sf_bytes),
        fmt(row.gspmd_bytes),
        ratio,
        flops,
        planner,
    )


def text_table(rows) -> str:
    table = [COLUMNS] + [cells(r) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(COLUMNS))]
    right = {4, 5, 6, 7}
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(t, widths))).rstrip()
        for t in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * 4 + ["---:"] * 4 + ["---"]) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |")
    return "\n".join(lines)


def kinds_line(kinds: dict) -> str:
    return ", ".join(f"{k} {n}× {b:,} B" for k, (n, b) in sorted(kinds.items(), key=lambda kv: -kv[1][1])) or "none"


def plan_line(plan, top=4) -> str:
    """shardflow's costliest collectives by (kind, source, reason)."""
    if plan is None:
        return "—"
    groups = {}
    for c in plan.collectives:
        key = (c.kind, c.source, c.reason)
        groups[key] = groups.get(key, 0) + c.bytes * c.count
    best = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    return "; ".join(f"{k} {b:,} B at {s} ({r})" for (k, s, r), b in best)


def json_row(row: Row) -> dict:
    """One row of the raw JSON: every figure of the table's row, unformatted. A ratio over zero
    GSPMD bytes is null where shardflow's are not zero too."""
    finite = lambda x: None if x is None or x == float("inf") else x  # noqa: E731
    return {
        "program": row.program,
        "strategy": row.strategy,
        "error": row.error,
        "failure": row.failure,
        "expected_failure": row.expected_failure,
        "fallbacks": list(row.fallbacks),
        "sf_bytes": row.sf_bytes,
        "gspmd_bytes": row.gspmd_bytes,
        "ratio": finite(row.ratio),
        "sf_flops": row.sf_flops,
        "gspmd_flops": row.gspmd_flops,
        "flops_ratio": finite(row.flops_ratio),
        "planner": None if row.plan is None else row.plan.planner.split()[0],
        "sf_kinds": row.sf_kinds,
        "gspmd_kinds": row.gspmd_kinds,
        "seconds": row.seconds,
    }


def worst(rows, n=6):
    ok = [r for r in rows if r.ratio is not None and r.gspmd_bytes]
    return sorted(ok, key=lambda r: -r.ratio)[:n]


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        return out + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    """The table, its loops lowered rolled as GSPMD's program has them: XLA's cost analysis
    counts a loop's body once whatever its trip count, so an unrolled layer loop (the lowering's
    choice) read as 7x GSPMD's flops on the scan rows. The table compares plans."""
    from unittest import mock

    from shardflow.passes import unroll

    with mock.patch.object(unroll, "UNROLLED_TRIPS", 0):
        return _table(argv)


def _table(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=None, help="regex over 'program-strategy' of the rows to run")
    parser.add_argument("--no-train", action="store_true", help="skip the `shardflow train` rows")
    parser.add_argument("--preset", default="tiny", help="the train rows' model preset")
    parser.add_argument("--batch", type=int, default=16, help="the train rows' batch")
    parser.add_argument("--seq", type=int, default=128, help="the train rows' sequence length")
    parser.add_argument("--detail", action="store_true", help="per row: collectives of both engines by kind")
    parser.add_argument(
        "--full-opt", action="store_true", help="compile with XLA:CPU's default LLVM optimization (same bytes, slower)"
    )
    parser.add_argument("--out", default=None, help="write the table (and the worst rows' collectives) as markdown")
    parser.add_argument("--json", default=None, help="write the rows as JSON under this run's meta")
    parser.add_argument(
        "--planner",
        choices=("greedy", "solver", "solver-bytes"),
        default="greedy",
        help="shardflow's planner: passes.propagate, or the integer program (passes.solve) "
        "minimising modelled time (solver) or bytes (solver-bytes: no per-collective latency)",
    )
    args = parser.parse_args(argv)

    import gspmd_programs as gp
    import jax

    started = time.perf_counter()
    head = (
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, mesh {gp.MESH_SHAPE}, "
        f"{os.cpu_count()} CPU cores"
    )
    print(head, flush=True)
    rows, references = [], {}
    selected = [c for c in gp.CASES if not args.only or re.search(args.only, c.name)]
    for case in selected:
        rows.append(measure(case, references, args.planner))
        print("  " + " | ".join(cells(rows[-1])) + f"   [{rows[-1].seconds:.1f} s]", flush=True)
    if not args.no_train:
        for strategy in TRAIN_STRATEGIES:
            if args.only and not re.search(args.only, f"llama_train-{strategy}"):
                continue
            rows.append(train_row(strategy, args.preset, args.batch, args.seq, args.planner))
            print("  " + " | ".join(cells(rows[-1])) + f"   [{rows[-1].seconds:.1f} s]", flush=True)
    elapsed = time.perf_counter() - started
    print()
    print(text_table(rows))
    print(f"\n{len(rows)} rows in {elapsed:.0f} s")
    if args.detail:
        for r in rows:
            print(
                f"\n{r.program}-{r.strategy}\n  shardflow: {kinds_line(r.sf_kinds)}\n"
                f"  GSPMD:     {kinds_line(r.gspmd_kinds)}\n  plan:      {plan_line(r.plan)}"
            )
    if args.out:
        command = (
            "python benchmarks/bytes_vs_gspmd.py"
            + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
        )
        lines = [
            f"<!-- generated by {command} on {datetime.date.today()}, {platform.machine()}, "
            f"jax {jax.__version__}, commit {git_commit()}, {elapsed:.0f} s -->",
            "",
            head,
            "",
            markdown_table(rows),
            "",
            "Worst rows (highest ratio), collectives by kind:",
            "",
        ]
        for r in worst(rows):
            lines += [
                f"- **{r.program}-{r.strategy}** ({r.ratio:.2f}×)",
                f"  - shardflow: {kinds_line(r.sf_kinds)}",
                f"  - GSPMD: {kinds_line(r.gspmd_kinds)}",
                f"  - shardflow's costliest: {plan_line(r.plan)}",
            ]
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    if args.json:
        _results.write_json(
            args.json,
            [json_row(r) for r in rows],
            mesh=gp.MESH_SHAPE,
            planner=args.planner,
            cpu_cores=os.cpu_count(),
            seconds=elapsed,
        )
    return rows


if __name__ == "__main__":
    main()
