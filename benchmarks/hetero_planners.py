"""shardflow's heterogeneous planner (shardflow.hetero.search) against re-implementations of the
plan spaces and searches of AMP (NeurIPS'22), Metis (USENIX ATC'24) and FlashFlex / HexiScale,
all priced by the same simulator (shardflow.hetero.simulate) with the same Framework.

Each baseline enumerates the plans its own search would visit (its parallel degrees, device
placement, layer partition rule and micro-batch rule, re-implemented from the papers' repositories
in a compact form; what is simplified is said at each function and in
benchmarks/results/hetero_planners.md) and keeps the fastest that fits every device's memory by
the shared simulator. That is generous to the baselines: their own cost models would pick among
the same candidates less well, never better (under this simulator). Every baseline is also given
the recomputation switch that our search has.

    python benchmarks/hetero_planners.py [--framework round|small-gemm|both] [--metis-variance 1.0] \
        [--clusters NAME ...] [--models NAME ...] [--out benchmarks/results/hetero/2026-12-07_planners.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _checkout  # noqa: E402,F401  (the repository's shardflow, before any shardflow import)
import _results  # noqa: E402
from _hetero_baselines import (  # noqa: E402
    PRECISION,  # noqa: E402
    Keeper,
    amp,
    flashflex,
    metis,
)

from shardflow.hetero.cluster import Cluster, Node  # noqa: E402
from shardflow.hetero.devices import GB, TB, DeviceKind, device_kind  # noqa: E402
from shardflow.hetero.search import search  # noqa: E402
from shardflow.hetero.simulate import (  # noqa: E402
    Framework,
    Plan,
    Transformer,
    simulate,
)

DATA = Path(__file__).parent / "data" / "hetero" / "published.json"

# Not in shardflow's catalogue: FlashFlex's README mixes use it. Numbers from
# benchmarks/data/hetero/devices.json (memory and bandwidth from NVIDIA's specification page;
# tensor rate derived there from SM count x boost clock, fp16 with fp32 accumulate).
RTX_3080TI = DeviceKind(
    "RTX-3080Ti",
    12 * GB,
    912 * GB,
    dict(bf16=68.2 * TB, fp16=68.2 * TB, tf32=34.1 * TB, fp32=34.1 * TB),
    None,
    32 * GB,
    "GeForce RTX 3080 Ti specifications; tensor rate derived (benchmarks/data/hetero/devices.json)",
)
EXTRA = {"RTX-3080Ti": RTX_3080TI}

GPT2_MEDIUM = Transformer(24, 1024, 16, 64, 4096, 52256, 1024)  # AMP's model (its vocab)
OPT_350M = Transformer(24, 1024, 16, 64, 4096, 50272, 2048)  # as Sailor configures it
LLAMA2_7B = Transformer(32, 4096, 32, 128, 11008, 32000, 4096, gated=True)
MODELS = {"GPT-2-medium": (GPT2_MEDIUM, 32), "OPT-350M": (OPT_350M, 256), "Llama-2-7B": (LLAMA2_7B, 64)}

FRAMEWORKS = {
    # the round numbers of docs/how-to/heterogeneous.md
    "round": Framework(efficiency={"*": 0.5}),
    # the shape of the fits in benchmarks/results/hetero.md: small GEMMs lose efficiency (Sailor's
    # n_half 1517 tokens/device), collectives reach 78 % / 95 % of the links, 3.9 GB beside the
    # model; the per-kind peaks stay at 0.5 (the fits' per-kind e_max are for fp32 / one framework)
    "small-gemm": Framework(
        efficiency={"*": 0.5}, half_tokens=1517, network_efficiency=0.78, intra_efficiency=0.95, overhead=3.9e9
    ),
}
METIS_VARIANCE = 1.0  # its README's example run; its code's default is 0.5 (--metis-variance)


def _row(prefix: str) -> dict:
    return next(r for r in json.loads(DATA.read_text()) if r["id"].startswith(prefix))


def _published_cluster(prefix: str) -> Cluster:
    """The cluster of a published run as benchmarks/hetero_validate.py describes it (AMP's AWS
    links as AMP models them, Sailor's measured MIT links)."""
    import hetero_validate

    return hetero_validate._cluster(_row(prefix))


def _cluster(inventory: dict[str, int], per_node: int = 8, inter_GBps: float = 25.0) -> Cluster:
    """Cluster.from_inventory, plus kinds missing from the catalogue (EXTRA)."""
    nodes = []
    for name, count in inventory.items():
        kind = EXTRA.get(name) or device_kind(name)
        full, rest = divmod(count, per_node)
        node = Node(kind, per_node, kind.nvlink or kind.pcie, inter_GBps * GB)
        nodes += [node] * full + ([Node(kind, rest, node.intra, node.inter)] if rest else [])
    return Cluster(tuple(nodes))


CLUSTERS: dict[str, Callable[[], Cluster]] = {
    "AMP 12xV100-16GB + 4xT4": lambda: _published_cluster("amp-hetcluster-trial00"),
    "Sailor MIT 16x2080Ti + 8x3090 + 8xTitan": lambda: _published_cluster("sailor-mit-opt350-plan_config_N4_D1"),
    "FlashFlex 8x3080Ti + 8x3090 + 24x4090": lambda: _cluster({"RTX-3080Ti": 8, "RTX-3090": 8, "RTX-4090": 24}),
    "FlashFlex 8x3080Ti + 8x3090 + 8x4090 + 8xA100-80GB": lambda: _cluster(
        {"RTX-3080Ti": 8, "RTX-3090": 8, "RTX-4090": 8, "A100-80GB": 8}
    ),
    "8xH100 + 8xA100-40GB": lambda: _cluster({"H100": 8, "A100-40GB": 8}),
    "16xA100-80GB + 16xV100-32GB": lambda: _cluster({"A100-80GB": 16, "V100-32GB": 16}),
}


# ---------------------------------------------------------------------------------------------


def describe(plan: Plan) -> str:
    shapes = [" ".join(f"{s.kind}x{s.tp}" for s in p.stages) for p in plan.pipelines]
    grouped = "; ".join(f"{len(list(g))} x [{shape}]" for shape, g in itertools.groupby(shapes))
    layers = "/".join(str(s.layers) for s in plan.pipelines[0].stages)
    counts = ",".join(str(p.microbatches) for p in plan.pipelines)
    return f"{grouped} | layers {layers} | micro-batches {counts} of {plan.micro_batch} | remat {plan.remat}"


PLANNERS = {
    "AMP": lambda k, gb: amp(k, gb),
    "AMP-kind-aware": lambda k, gb: amp(k, gb, kind_aware=True),
    "Metis": lambda k, gb: metis(k, gb, variance=METIS_VARIANCE),
    "FlashFlex": flashflex,
}


def compare(cluster_name: str, model_name: str, framework_name: str) -> dict:
    cluster = CLUSTERS[cluster_name]()
    model, global_batch = MODELS[model_name]
    fw = FRAMEWORKS[framework_name]
    tokens = global_batch * model.seq_len
    row = dict(cluster=cluster_name, inventory=cluster.inventory(), model=model_name, global_batch=global_batch)
    row.update(framework=framework_name, seq_len=model.seq_len, metis_variance=METIS_VARIANCE, planners={})
    start = time.perf_counter()
    try:
        result = search(model, cluster, global_batch, fw, precision=PRECISION, top=1, max_seconds=60)
        best = result.best
        ours = dict(tokens_per_second=best.tokens_per_second, seconds=best.seconds, fits=True)
        ours.update(plan=describe(best.plan), complete=result.complete)
    except ValueError as e:
        ours = dict(tokens_per_second=None, seconds=None, fits=False, plan=str(e), complete=True)
    ours["search_seconds"] = time.perf_counter() - start
    row["planners"]["ours"] = ours
    for name, planner in PLANNERS.items():
        keeper = Keeper(model, cluster, fw)
        start = time.perf_counter()
        priced = planner(keeper, global_batch)
        elapsed = time.perf_counter() - start
        chosen = keeper.best or keeper.best_any
        entry = dict(priced=priced, search_seconds=elapsed, fits=keeper.best is not None)
        if chosen is None:
            entry.update(tokens_per_second=None, seconds=None, plan="no candidate")
        else:
            pred = simulate(model, cluster, chosen[1], fw)  # the kept plan, priced by simulate itself
            assert abs(pred.seconds / chosen[0] - 1) < 1e-9, (pred.seconds, chosen[0])
            peak = max(
                m / keeper.capacity[s.kind]
                for p, ms in zip(chosen[1].pipelines, pred.memory)
                for s, m in zip(p.stages, ms)
            )
            assert (peak <= 1) == entry["fits"]
            entry.update(tokens_per_second=tokens / pred.seconds, seconds=pred.seconds, plan=describe(chosen[1]))
            entry.update(peak_memory_fraction=peak)
        row["planners"][name] = entry
    fitting = [v["tokens_per_second"] for k, v in row["planners"].items() if k != "ours" and v["fits"]]
    best_baseline = max(fitting, default=None)
    row["ratio_to_best_baseline"] = (
        None
        if best_baseline is None or ours["tokens_per_second"] is None
        else ours["tokens_per_second"] / best_baseline
    )
    return row


def table(rows: list[dict]) -> str:
    names = list(PLANNERS)
    head = ["framework", "cluster", "model (gbs)", "ours tok/s", *[f"{n} tok/s" for n in names], "ours / best baseline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(names) + 2)]

    def cell(v):
        if v["tokens_per_second"] is None:
            return "no plan"
        return f"{v['tokens_per_second']:,.0f}" + ("" if v["fits"] else " (OOM)")

    for r in rows:
        ratio = r["ratio_to_best_baseline"]
        cells = [r["framework"], r["cluster"], f"{r['model']} ({r['global_batch']})", cell(r["planners"]["ours"])]
        cells += [cell(r["planners"][n]) for n in names]
        cells.append("-" if ratio is None else f"{ratio:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=[*FRAMEWORKS, "both"], default="both")
    ap.add_argument("--clusters", nargs="*", default=list(CLUSTERS))
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--metis-variance", type=float, default=1.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    global METIS_VARIANCE
    METIS_VARIANCE = args.metis_variance
    frameworks = list(FRAMEWORKS) if args.framework == "both" else [args.framework]
    rows = []
    for fw in frameworks:
        for c in args.clusters:
            for m in args.models:
                row = compare(c, m, fw)
                rows.append(row)
                times = ", ".join(f"{k} {v['search_seconds']:.1f}s" for k, v in row["planners"].items())
                print(f"{fw:10s} {c:48s} {m:13s} ratio {row['ratio_to_best_baseline']}  ({times})", flush=True)
    print()
    print(table(rows))
    if args.out:
        _results.write_json(
            args.out,
            rows,
            frameworks={k: repr(v) for k, v in FRAMEWORKS.items() if k in frameworks},
            precision=PRECISION,
        )


if __name__ == "__main__":
    sys.exit(main())
