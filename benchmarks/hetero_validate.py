"""The heterogeneous-cluster simulator (shardflow.hetero.simulate) against published
measurements (benchmarks/data/hetero/published.json: Sailor's and AMP's measured runs, on
homogeneous and mixed clusters).

Each framework's few constants (its matmuls' sustained fraction of peak per device kind and
how it falls for small GEMMs, the bytes its element-wise ops and unfused attention move, the
fraction of its links its collectives reach, what it holds beside the model state) are fitted
to its rows (Sailor's GPT-Neo runs, of unknown precision, as a group of their own; Sailor's
MIT runs' memory too); the error reported is that of held-out rows (k-fold), so a constant
never predicts the row it was fitted on. Prints one line per row and the MAPE per group.

    python benchmarks/hetero_validate.py [--folds 5] [--out benchmarks/results/hetero/<date>_validate.json]

``--ours``: instead, shardflow's own GPU runs (benchmarks/results/{train_mfu,scaling,pipeline}),
held out one configuration at a time (see ``validate_ours``).

    python benchmarks/hetero_validate.py --ours --out benchmarks/results/hetero/<date>_validate_shardflow.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from shardflow.hetero.cluster import Cluster
from shardflow.hetero.simulate import Framework, Pipeline, Plan, Stage, Transformer, simulate, uniform_plan

DATA = Path(__file__).parent / "data" / "hetero" / "published.json"
KIND = {"RTX-2080": "RTX-2080Ti"}  # Sailor's "RTX-2080" nodes have 11 GiB: a 2080 Ti


@dataclasses.dataclass
class Case:
    id: str
    source: str
    framework: str
    memory_group: str
    model: Transformer
    cluster: Cluster
    plan: Plan
    seconds: float | None
    memory: float | None  # bytes, the busiest device
    version: dict = dataclasses.field(default_factory=dict)  # Framework fields this row's code version sets


def _simulate(c: Case, fw: Framework):
    """``c`` simulated under ``fw`` as its code version runs (``Case.version``)."""
    return simulate(c.model, c.cluster, c.plan, dataclasses.replace(fw, **c.version) if c.version else fw)


def _source_of(row) -> str:
    return row["id"].split("-")[0] if not row["id"].startswith("sailor-aceso") else "aceso"


def _framework_of(row) -> str:
    """The group whose constants are fitted together: a source, with Sailor's GPT-Neo runs
    apart (their precision is unknown: they run well above the fp32 peak, so not the OPT
    runs' fp32 setup)."""
    return "sailor-neo" if "gptneo" in row["id"] else _source_of(row)


def _memory_group_of(row) -> str:
    """The group whose memory constants are fitted together: the time group, with Sailor's MIT
    runs apart (their launch scripts are not published, and their memory does not follow the
    Clariden runs': a tp=2 run reports less than the same model on tp=8, and less than the
    activations Megatron keeps, so the reading or the setup differs)."""
    return "sailor-mit" if row["id"].startswith("sailor-mit") else _framework_of(row)


def _cluster(row) -> Cluster:
    inventory, per_node, inter, intra = {}, {}, {}, {}
    for c in row["cluster"]:
        kind = KIND.get(c["kind"], c["kind"])
        inventory[kind] = inventory.get(kind, 0) + c["count"]
        per_node[kind] = c["per_node"]
        measured = c.get("sailor_measured_p2p_GBps")
        if measured:
            n = str(c["per_node"])
            inter[kind] = measured["inter_by_ngpus"].get(n, max(measured["inter_by_ngpus"].values()))
            intra[kind] = measured["intra_by_ngpus"].get(n, max(measured["intra_by_ngpus"].values()))
        else:  # AMP's AWS instances, as AMP models them
            inter[kind] = {"V100-16GB": 10, "T4": 50}[kind] / 8
            intra[kind] = {"V100-16GB": 170, "T4": 50}[kind] / 8
    return Cluster.from_inventory(inventory, per_node=per_node, inter_node_GBps=inter, intra_GBps=intra)


def _aceso_layers(ops, model) -> list:
    """Aceso cuts by operator (ops per stage): the transformer layers each stage holds, in
    proportion, summing to the model's."""
    bounds = np.round(np.cumsum([0] + list(ops)) / sum(ops) * model["n_layers"]).astype(int)
    return [max(1, int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


def _plan(row) -> Plan:
    pl = row["plan"]
    layers = pl.get("transformer_layers_per_stage") or _aceso_layers(pl["aceso_ops_per_stage"], row["model"])
    (only,) = {c["kind"] for c in row["cluster"]} if not pl.get("per_stage_kinds") else (None,)
    kinds = pl.get("per_stage_replica_kinds") or [
        k * pl["dp"] for k in pl.get("per_stage_kinds") or [[only]] * len(layers)
    ]
    dp = len(kinds[0])
    precision = {"fp16": "fp16", "bf16": "bf16"}.get(row["precision"], "fp32")
    pipelines = tuple(
        Pipeline(
            tuple(Stage(KIND.get(kinds[s][r], kinds[s][r]), pl["tp"], layers[s]) for s in range(len(layers))),
            int(pl["microbatches"]),
        )
        for r in range(dp)
    )
    return Plan(pipelines, row["micro_batch"], precision=precision, remat=bool(pl.get("activation_checkpointing")))


def cases() -> list[Case]:
    out = []
    for row in json.loads(DATA.read_text()):
        m, measured = row["model"], row["measured"]
        cut = "transformer_layers_per_stage" in row["plan"] or "aceso_ops_per_stage" in row["plan"]
        usable = cut and not row.get("suspect") and row["micro_batch"]
        if not usable or (measured.get("iteration_time_s") is None and measured.get("peak_memory_gb") is None):
            continue
        model = Transformer(
            m["n_layers"], m["d_model"], m["n_heads"], m["head_dim"], m["ffn_dim"], m["vocab_size"], m["seq_len"]
        )
        memory = measured.get("peak_memory_gb")
        out.append(
            Case(
                row["id"],
                _source_of(row),
                _framework_of(row),
                _memory_group_of(row),
                model,
                _cluster(row),
                _plan(row),
                measured.get("iteration_time_s"),
                None if memory is None else memory * 1e9,
            )
        )
    return out


# name: (start, low, high), fitted in log space
TIME_KNOBS = {
    "half_tokens": (2000.0, 1.0, 1e6),
    "elementwise": (40.0, 1.0, 2000.0),
    "unfused_attention": (2.0, 1e-3, 100.0),
    "network_efficiency": (0.5, 0.02, 1.0),
    "intra_efficiency": (0.5, 0.02, 1.0),
}
MEMORY_KNOBS = {"overhead": (2e9, 1e8, 2e10), "activation": (1.0, 0.05, 10.0), "state_bytes": (16.0, 8.0, 40.0)}


def _framework(kinds, x_time, x_memory, time_knobs=TIME_KNOBS, memory_knobs=MEMORY_KNOBS, fixed=None) -> Framework:
    efficiency = {"*": 0.5, **dict(zip(kinds, np.exp(x_time[: len(kinds)])))}
    knobs = dict(zip(time_knobs, np.exp(x_time[len(kinds) :])))
    memory = dict(zip(memory_knobs, np.exp(x_memory)))
    return Framework(efficiency=efficiency, **(fixed or {}), **knobs, **memory)


def fit(train: list[Case], time_knobs=TIME_KNOBS, memory_knobs=MEMORY_KNOBS, fixed=None, shared_kinds=False):
    """Constants of one framework fitted to ``train`` (log-space least squares on the
    relative errors): (kinds, x_time, x_memory). ``time_knobs`` / ``memory_knobs``: the
    Framework fields fitted (name: (start, low, high)); ``fixed``: fields set, not fitted;
    ``shared_kinds``: one sustained fraction of peak for every kind (kinds is then ["*"])."""
    kinds = ["*"] if shared_kinds else sorted({s.kind for c in train for p in c.plan.pipelines for s in p.stages})
    timed, sized = [c for c in train if c.seconds], [c for c in train if c.memory]
    x_memory = np.log([v[0] for v in memory_knobs.values()])

    def make(x_time, x_memory):
        return _framework(kinds, x_time, x_memory, time_knobs, memory_knobs, fixed)

    def time_residuals(x):
        fw = make(x, x_memory)
        return [np.log(_simulate(c, fw).seconds / c.seconds) for c in timed]

    def memory_residuals(x):
        fw = make(x_time, x)
        return [np.log(max(max(s) for s in _simulate(c, fw).memory) / c.memory) for c in sized]

    x_time = np.log([0.4] * len(kinds) + [v[0] for v in time_knobs.values()])
    if timed:
        low = np.log([0.02] * len(kinds) + [v[1] for v in time_knobs.values()])
        high = np.log([1.0] * len(kinds) + [v[2] for v in time_knobs.values()])
        x_time = least_squares(time_residuals, x_time, bounds=(low, high), loss="soft_l1", f_scale=0.1).x
    if sized:
        low, high = (np.log([v[i] for v in memory_knobs.values()]) for i in (1, 2))
        x_memory = least_squares(memory_residuals, x_memory, bounds=(low, high)).x
    return kinds, x_time, x_memory


def _cross_validate(all_cases: list[Case], group_of, folds: int) -> dict:
    """Each case's prediction by constants fitted on the other folds of its group."""
    out = {}
    for name in sorted({group_of(c) for c in all_cases}):
        group = [c for c in all_cases if group_of(c) == name]
        order = np.random.default_rng(0).permutation(len(group))
        for fold in range(folds):
            held = [group[i] for i in order[fold::folds]]
            fw = _framework(*fit([c for c in group if c not in held]))
            out.update({c.id: _simulate(c, fw) for c in held})
    return out


# ---------------------------------------------------------------------------------------------
# Our own GPU measurements (benchmarks/results/{train_mfu,scaling,pipeline}/*.json) as the
# "shardflow" group: only the rows the simulator expresses (data parallel = pipelines of one
# stage, tensor parallel = a stage's tp, 1F1B-fused pipelines = stages); FSDP (and 2d, FSDP
# over data) predicted as data parallel in a set of its own, never fitted on.

RESULTS = Path(__file__).parent / "results"
OUR_SOURCES = ("train_mfu", "scaling", "pipeline")
OUR_ENGINES = ("shardflow", "shardflow-solver")  # scaling.py's and train_mfu.py's engine names; pipeline.py: shardflow
OUR_KINDS = {"NVIDIA H200": "H200", "NVIDIA H100 80GB HBM3": "H100"}
NVLINK_GBPS = 450  # a pipeline's sends stay inside the one host: price them on NVLink, not a network
# Fitted for shardflow: one sustained fraction for both Hopper kinds (the same GH100 tensor cores
# and peak; H200's faster memory is in the catalogue), the small-GEMM knee and the element-wise
# bytes. Fixed: attention is our fused (flash) kernel, so no [heads, s, s] traffic or memory; no network
# (one host); the tensor-parallel all-reduces at NVLink's datasheet rate (NCCL's bus bandwidth
# on NVSwitch Hoppers reaches it for large messages): our modelled rows hold one tensor-parallel
# configuration, so leaving it out would leave that fraction with nothing to fit it.
OUR_FIT = dict(
    time_knobs={k: TIME_KNOBS[k] for k in ("half_tokens", "elementwise")},
    memory_knobs=MEMORY_KNOBS,
    fixed=dict(
        fused_attention=True, unfused_attention=0.0, network_efficiency=1.0, intra_efficiency=1.0, spmd_pipeline=True
    ),
    shared_kinds=True,
)


@dataclasses.dataclass
class Ours:
    case: Case
    modelled: bool  # False: FSDP approximated as data parallel
    pointer: str
    describe: dict
    holdout: str  # rows with the same simulator inputs are held out together


def _our_rows():
    """(source path, JSON pointer, meta, row) of every row of our measurement files."""
    for name in OUR_SOURCES:
        for path in sorted((RESULTS / name).glob("*.json")):
            data = json.loads(path.read_text())
            runs = [("", data)] if "rows" in data else [(f"/runs/{i}", r) for i, r in enumerate(data["runs"])]
            for prefix, run in runs:
                for j, row in enumerate(run["rows"]):
                    yield f"benchmarks/results/{name}/{path.name}", f"{prefix}/rows/{j}", run["meta"], row


def _our_model(preset: str, seq: int) -> Transformer:
    from shardflow.models.config import PRESETS

    m = PRESETS[preset]
    return Transformer(
        m["n_layers"], m["d_model"], m["n_heads"], m["head_dim"], m["ffn_dim"], m["vocab_size"], seq,
        kv_heads=m["n_kv_heads"], gated=True, dropout=False, fp32_norms=True,
    )  # fmt: skip


def _our_case(source, pointer, meta, row):
    """An ``Ours`` for a row the simulator can express, else the reason it is left out."""
    kind = OUR_KINDS.get(meta["device_kind"])
    engine = row.get("engine", "shardflow")
    schedule = (row.get("pipeline") or {}).get("schedule")
    name = row.get("config") or row.get("strategy") or "1-device"
    if kind is None:
        return f"{meta['device_kind']}: not a GPU timing (a loaded 2-core CPU)"
    if engine not in OUR_ENGINES:
        return f"engine {engine}: not shardflow's engine"
    if row.get("status", "ok") != "ok":
        return f"status {row['status'][:60]}"
    if schedule not in (None, "1f1b-fused"):
        return (
            f"schedule {schedule}: the simulator models 1F1B with a fused backward only (the split-backward "
            "schedules run lockstep, every step as long as its slowest stage's action; zb-fused holds W's)"
        )
    mesh = row.get("mesh") or {"data": 1}  # train_mfu.py: one device
    data, tp, pp = mesh.get("data", 1), mesh.get("model", 1), mesh.get("pipe", 1)
    fsdp = name in ("fsdp", "2d") or "fsdp" in name  # FSDP over data: weights gathered, state split
    if "batch_per_replica" in row or "batch" in row:  # scaling.py, train_mfu.py: batch per data replica
        micro_batch, microbatches = row.get("batch_per_replica") or row["batch"], 1
    else:  # pipeline.py: a global batch in m micro-batches, each split over data
        microbatches = row["pipeline"]["microbatches"] if schedule else 1
        micro_batch = row["global_batch"] // (microbatches * data)
    model = _our_model(row["preset"], row["seq"])
    plan = uniform_plan(
        kind, dp=data, tp=tp, pp=pp, layers=model.n_layers, microbatches=microbatches, micro_batch=micro_batch,
        precision="bf16", remat=row["remat"],
    )  # fmt: skip
    cluster = Cluster.from_inventory(
        {kind: data * tp * pp}, per_node=data * tp * pp, inter_node_GBps=NVLINK_GBPS
    )  # fmt: skip
    # Memory where the simulator's activations mean what the run keeps: not under FSDP (state split
    # over data), not with the sequence split over the model axis (tp_sp; the solver's tp plan, whose
    # 20.9 GB is tp_sp's).
    sequence_split = name == "tp_sp" or (name == "tp" and engine == "shardflow-solver")
    memory = row.get("compiled_gb_per_device")
    if fsdp or sequence_split or memory is None:
        memory = None
    case = Case(
        f"{source}#{pointer}", "shardflow", "shardflow", "shardflow", model, cluster, plan, row["step_s"],
        None if memory is None else memory * 1e9, dict(rolled_loop=_rolled(meta["date"][:10], tp, pp, fsdp)),
    )  # fmt: skip
    describe = dict(
        date=meta["date"][:10], kind=kind, preset=row["preset"], engine=engine, config=name, mesh=mesh,
        remat=row["remat"], micro_batch=micro_batch, microbatches=microbatches, seq=row["seq"],
        layer_loop="rolled" if case.version["rolled_loop"] else "unrolled",
    )  # fmt: skip
    return Ours(case, not fsdp, pointer, describe, repr((model, plan, cluster.inventory())))


def ours() -> tuple[list[Ours], list[dict]]:
    """Our rows the simulator takes (modelled or FSDP-approximated) and those left out, with why."""
    taken, left = [], []
    for source, pointer, meta, row in _our_rows():
        got = _our_case(source, pointer, meta, row)
        if isinstance(got, Ours):
            taken.append(got)
        else:
            what = row.get("config") or row.get("strategy") or row.get("engine")
            left.append(dict(source=source, pointer=pointer, preset=row.get("preset"), row=what, why=got))
    return taken, left


def _fit_ours(train: list[Ours]) -> Framework:
    """Our constants fitted with each configuration once (the geometric mean of its rows' times
    and memory): repeated measurements, or plans the simulator cannot tell apart (tp, tp_sp and the
    solver's tp are six rows of one configuration), do not outweigh a configuration measured once."""
    merged = []
    for key in sorted({(o.holdout, repr(o.case.version)) for o in train}):
        rows = [o.case for o in train if (o.holdout, repr(o.case.version)) == key]
        seconds = [c.seconds for c in rows if c.seconds]
        memory = [c.memory for c in rows if c.memory]
        gmean = lambda v: float(np.exp(np.mean(np.log(v)))) if v else None  # noqa: E731
        merged.append(dataclasses.replace(rows[0], seconds=gmean(seconds), memory=gmean(memory)))
    return _framework(*fit(merged, **OUR_FIT), **{k: OUR_FIT[k] for k in ("time_knobs", "memory_knobs", "fixed")})


LOWERING = "2026-12-01"  # the layer-loop lowering (2191cdc, 63d0409, f943485): 1b on one GPU 0.406 s -> 0.340 s


def _rolled(date: str, tp: int, pp: int, fsdp: bool) -> bool:
    """Whether the row's layer loop ran rolled (``Framework.rolled_loop``): every row measured
    before the lowering, and after it a loop whose body runs a collective (tp, FSDP, a pipeline's
    stages); it unrolled the loops of one device and of dp (gradients reduced after the loop)."""
    return date < LOWERING or tp > 1 or pp > 1 or fsdp


def _leave_one_configuration_out(modelled: list[Ours]) -> dict:
    """Each row's prediction by constants fitted on the rows of every other configuration (all
    rows with the held-out row's simulator inputs are held out with it: repeated measurements of
    one configuration, or plans the simulator cannot tell apart, never predict each other)."""
    predicted = {}
    for key in sorted({o.holdout for o in modelled}):
        fw = _fit_ours([o for o in modelled if o.holdout != key])
        held = [o.case for o in modelled if o.holdout == key]
        predicted.update({c.id: _simulate(c, fw) for c in held})
    return predicted


def _summary(rows, groups) -> dict:
    out = {}
    for name, pick in groups:
        mine = [r for r in rows if pick(r)]
        t = [r["time_error"] for r in mine if r["time_error"] is not None]
        m = [r["memory_error"] for r in mine if r["memory_error"] is not None]
        out[name] = dict(
            time_rows=len(t), time_mape=float(np.mean(t)) if t else None,
            time_max=float(np.max(t)) if t else None, memory_rows=len(m),
            memory_mape=float(np.mean(m)) if m else None, memory_max=float(np.max(m)) if m else None,
        )  # fmt: skip
    return out


def _errors(o: Ours, pr) -> dict:
    c, memory = o.case, max(max(s) for s in pr.memory)
    return dict(
        predicted_s=pr.seconds, time_error=abs(pr.seconds / c.seconds - 1), predicted_memory_gb=memory / 1e9,
        memory_error=None if c.memory is None else abs(memory / c.memory - 1),
    )  # fmt: skip


def validate_ours(out: str | None = None) -> dict:
    """Our rows: the modelled ones by leave-one-configuration-out, the FSDP-approximated ones by
    constants fitted on every modelled row (never on themselves). Then again with only the rows
    measured before the layer-loop lowering (one code version: every multi-GPU row is from then)."""
    taken, left = ours()
    modelled = [o for o in taken if o.modelled]
    predicted = _leave_one_configuration_out(modelled)
    fw_all = _fit_ours(modelled)
    approximated = [o.case for o in taken if not o.modelled]
    predicted.update({c.id: _simulate(c, fw_all) for c in approximated})
    before = [o for o in modelled if o.describe["date"] < LOWERING]
    one_version = _leave_one_configuration_out(before)
    rows = []
    for o in taken:
        c = o.case
        row = dict(
            id=c.id, source=c.id.split("#")[0], pointer=o.pointer,
            set="modelled" if o.modelled else "fsdp-as-dp", **o.describe,
            measured_s=c.seconds, measured_memory_gb=None if c.memory is None else c.memory / 1e9,
            **_errors(o, predicted[c.id]),
        )  # fmt: skip
        if c.id in one_version:
            row["before_lowering"] = _errors(o, one_version[c.id])
        rows.append(row)
    modelled_rows = [r for r in rows if r["set"] == "modelled"]
    summary = _summary(
        rows,
        [
            ("modelled", lambda r: r["set"] == "modelled"),
            ("modelled, 1 GPU", lambda r: r["set"] == "modelled" and _devices(r) == 1),
            ("modelled, 2 GPUs", lambda r: r["set"] == "modelled" and _devices(r) == 2),
            ("modelled, 4 GPUs", lambda r: r["set"] == "modelled" and _devices(r) == 4),
            ("modelled, without tensor parallelism", lambda r: r["set"] == "modelled" and "model" not in r["mesh"]),
            ("fsdp-as-dp (not fitted on)", lambda r: r["set"] == "fsdp-as-dp"),
        ],
    )
    early = [dict(r, **r["before_lowering"]) for r in modelled_rows if "before_lowering" in r]
    summary.update(
        _summary(
            early,
            [
                (f"measured before {LOWERING}, fitted apart", lambda r: True),
                (f"measured before {LOWERING}, without tensor parallelism", lambda r: "model" not in r["mesh"]),
            ],
        )
    )
    constants = dict(
        sustained=fw_all.efficiency["*"], half_tokens=fw_all.half_tokens, elementwise=fw_all.elementwise,
        intra_efficiency=fw_all.intra_efficiency, overhead_gb=fw_all.overhead / 1e9,
        state_bytes=fw_all.state_bytes, activation=fw_all.activation, fixed=OUR_FIT["fixed"],
    )  # fmt: skip
    fmt = lambda v: "-" if v is None else f"{100 * v:.1f} %"  # noqa: E731
    print(
        "| row (benchmarks/results/) | GPUs | preset | config | remat | b × m | measured s | predicted s | error | "
        "measured GB | predicted GB | error |\n|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        gb = "-" if r["measured_memory_gb"] is None else f"{r['measured_memory_gb']:.1f}"
        print(
            f"| {r['id'].removeprefix('benchmarks/results/')} | {_devices(r)} × {r['kind']} | {r['preset']} | "
            f"{r['config']}{' (solver)' if r['engine'] == 'shardflow-solver' else ''}"
            f"{' ≈ dp' if r['set'] == 'fsdp-as-dp' else ''} | {r['remat']} | "
            f"{r['micro_batch']} × {r['microbatches']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
            f"{fmt(r['time_error'])} | {gb} | {r['predicted_memory_gb']:.1f} | {fmt(r['memory_error'])} |"
        )
    print(
        "\n| rows | time rows | MAPE time | max | memory rows | MAPE memory | max |"
        "\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, v in summary.items():
        print(
            f"| {name} | {v['time_rows']} | {fmt(v['time_mape'])} | {fmt(v['time_max'])} | {v['memory_rows']} | "
            f"{fmt(v['memory_mape'])} | {fmt(v['memory_max'])} |"
        )
    print(f"\nconstants fitted on every modelled row: {constants}")
    print(f"left out: {len(left)} rows")
    for r in left:
        print(
            f"  {r['source'].removeprefix('benchmarks/results/')}#{r['pointer']} {r['preset']} {r['row']}: {r['why']}"
        )
    result = dict(
        summary=summary, rows=rows, left_out=left, constants=constants,
        holdout="leave one configuration out: every row with the held-out row's simulator inputs held out with it",
        configurations=len({o.holdout for o in modelled}),
        configurations_before_lowering=len({o.holdout for o in before}),
    )  # fmt: skip
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
    return result


def _devices(r) -> int:
    return int(np.prod(list(r["mesh"].values())))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--ours", action="store_true", help="our GPU measurements (benchmarks/results/) instead")
    args = ap.parse_args(argv)
    if args.ours:
        validate_ours(args.out)
        return 0
    all_cases = cases()
    time_of = _cross_validate(all_cases, lambda c: c.framework, args.folds)
    memory_of = _cross_validate(all_cases, lambda c: c.memory_group, args.folds)
    rows = []
    for c in all_cases:
        rows.append(
            dict(
                id=c.id,
                source=c.source,
                framework=c.framework,
                memory_group=c.memory_group,
                kinds=sorted(c.cluster.inventory()),
                measured_s=c.seconds,
                predicted_s=time_of[c.id].seconds,
                measured_memory_gb=None if c.memory is None else c.memory / 1e9,
                predicted_memory_gb=max(max(s) for s in memory_of[c.id].memory) / 1e9,
            )
        )
    for r in rows:
        r["time_error"] = None if r["measured_s"] is None else abs(r["predicted_s"] / r["measured_s"] - 1)
        r["memory_error"] = (
            None if r["measured_memory_gb"] is None else abs(r["predicted_memory_gb"] / r["measured_memory_gb"] - 1)
        )
        print(
            f"{r['id']:58s} time {r['measured_s'] or float('nan'):9.3f} -> {r['predicted_s']:9.3f}  "
            f"memory {r['measured_memory_gb'] or float('nan'):6.2f} -> {r['predicted_memory_gb']:6.2f} GB"
        )
    summary = {}
    groups = sorted({r[k] for r in rows for k in ("source", "framework", "memory_group")}) + ["all"]
    for name in groups:
        mine = [r for r in rows if name in ("all", r["source"], r["framework"], r["memory_group"])]
        t = [r["time_error"] for r in mine if r["time_error"] is not None]
        m = [r["memory_error"] for r in mine if r["memory_error"] is not None]
        summary[name] = dict(
            time_rows=len(t),
            time_mape=float(np.mean(t)) if t else None,
            memory_rows=len(m),
            memory_mape=float(np.mean(m)) if m else None,
        )
    print("\n| source | rows (time) | MAPE time | rows (memory) | MAPE memory |\n|---|---|---|---|---|")
    for name, s in summary.items():
        fmt = lambda v: "-" if v is None else f"{100 * v:.1f} %"  # noqa: E731
        print(f"| {name} | {s['time_rows']} | {fmt(s['time_mape'])} | {s['memory_rows']} | {fmt(s['memory_mape'])} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(summary=summary, rows=rows, folds=args.folds), indent=1))


if __name__ == "__main__":
    sys.exit(main())
