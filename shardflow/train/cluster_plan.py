"""`shardflow plan --cluster FILE`: the best plans for a config's model and batch on a cluster
of mixed device kinds, each with its predicted step time and memory (``shardflow.hetero``)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from shardflow.train import config as config_lib

# Fitted to shardflow's own runs on H100 / H200 (benchmarks/results/hetero.md, `--ours`: the
# constants fitted on every modelled row; held-out error 7.2 % on step time over 25 runs, 6.3 % on
# compiled peak memory over 18); other kinds are assumed to reach the same fraction of their peak,
# unmeasured. Pipelines are the SPMD executor under the fused 1F1B (the runs' schedule; the
# settings below ask for it).
FRAMEWORK = dict(
    efficiency={"*": 0.740},
    half_tokens=395.4,
    elementwise=15.88,
    fused_attention=True,
    overhead=9.52e9,
    state_bytes=14.85,
    activation=0.789,
    spmd_pipeline=True,
)
# Plans asked of hetero.search, best first: the trainer takes the best of them on every device of
# the inventory, and names the best it can express where that one is not (search has no filter).
PLANS_SEARCHED = 100


def transformer_of(model_cfg, seq_len: int):
    """The simulator's shape of a shipped model (Llama: SwiGLU and grouped-query attention)."""
    from shardflow import hetero

    if model_cfg.n_experts:
        raise config_lib.ConfigError(
            f"shardflow plan: model.n_experts {model_cfg.n_experts}: the cluster simulator models dense "
            "transformers only"
        )
    llama = model_cfg.family == "llama"
    return hetero.Transformer(
        n_layers=model_cfg.n_layers,
        d_model=model_cfg.d_model,
        n_heads=model_cfg.n_heads,
        head_dim=model_cfg.head_dim,
        ffn_dim=model_cfg.ffn_dim,
        vocab_size=model_cfg.vocab_size,
        seq_len=seq_len,
        kv_heads=model_cfg.n_kv_heads if llama else None,
        gated=llama,
        dropout=False,
        fp32_norms=llama,
    )


def cluster_block(path: str) -> dict:
    """The ``cluster:`` block of a YAML file (or the whole file, if it is the block)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise config_lib.ConfigError(f"--cluster {path}: {e.strerror}") from None
    loaded = yaml.safe_load(text) or {}
    block = loaded.get("cluster", loaded) if isinstance(loaded, dict) else None
    if not isinstance(block, dict):
        raise config_lib.ConfigError(f"--cluster {path}: expected a mapping with an inventory, got {loaded!r}")
    return block


def trainer_settings(plan) -> list[str] | None:
    """The ``--set`` keys with which `shardflow train` runs ``plan``, where it can: one
    tensor-parallel width throughout (None for plans that mix widths). Pipelines of one stage
    with uneven micro-batch counts take them as ``replica_microbatches``; pipelines of several
    stages as ``pipeline.*`` under the fused 1F1B the simulator prices, their layers as
    ``pipeline.layers_per_stage`` and uneven counts as ``replica_microbatches`` too (the
    padding micro-batches computed, exact: shardflow/train/uneven.py)."""
    stages = [p.stages for p in plan.pipelines]
    widths, counts = {s.tp for p in stages for s in p}, [p.microbatches for p in plan.pipelines]
    depth = len(stages[0])
    if len(widths) != 1:
        return None
    (tp,) = widths
    mesh = ([f"pipe: {depth}"] if depth > 1 else []) + [f"data: {len(counts)}"] + ([f"model: {tp}"] if tp > 1 else [])
    keys = [f"mesh={{{', '.join(mesh)}}}", f"strategy={'tp' if tp > 1 else 'dp'}", f"batch_size={plan.global_batch}"]
    if depth > 1:
        keys += [f"pipeline.stages={depth}", f"pipeline.microbatches={max(counts)}", "pipeline.schedule=1f1b-fused"]
        keys.append(f"pipeline.layers_per_stage={[s.layers for s in stages[0]]}")
    if len(set(counts)) > 1:
        keys.append(f"replica_microbatches={counts}")
    elif depth == 1 and counts[0] > 1:
        keys.append(f"grad_accum={counts[0]}")
    if plan.remat:
        keys.append(f"model.remat={'dots' if plan.remat == 'dots' else 'full'}")
    return keys


def devices_used(plan) -> int:
    return sum(s.tp for p in plan.pipelines for s in p.stages)


def inventory_text(inventory: dict[str, int]) -> str:
    return ", ".join(f"{n} x {k}" for k, n in inventory.items())


def widths_text(plan) -> str:
    """The tensor-parallel widths a plan gives each kind: "H100 x1, A100-40GB x2"."""
    widths = {(s.kind, s.tp): None for p in plan.pipelines for s in p.stages}
    return ", ".join(f"{kind} x{tp}" for kind, tp in widths)


def search_cluster(cfg, block: dict, top: int):
    """(the cluster, hetero.search's ``top`` best plans) for the config's model, batch, sequence
    and precision on the cluster ``block`` describes."""
    from shardflow import hetero

    try:
        cluster = hetero.Cluster.from_config(block)
    except (TypeError, ValueError) as e:
        raise config_lib.ConfigError(str(e)) from None
    model = transformer_of(config_lib.model_config(cfg), cfg.data.seq_len)
    framework = hetero.Framework(**FRAMEWORK)
    try:
        result = hetero.search(
            model, cluster, cfg.batch_size, framework, precision=precision_of(cfg), remat_options=(False, True), top=top
        )
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from None
    return cluster, result


def precision_of(cfg) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}[cfg.compute_dtype]


def unrunnable(plan, cfg) -> str | None:
    """Why `shardflow train` cannot run ``plan`` for ``cfg``, or None where it can. One mesh has
    one tensor-parallel width; the plan's settings must pass the config's checks (the stacked
    layers are stored split over the pipeline's stages, so their number must divide the layers)
    and split every parameter evenly (a 256-entry vocabulary over 3 stages does not)."""
    import jax

    from shardflow import models

    keys = trainer_settings(plan)
    if keys is None:
        return f"gives the kinds different tensor-parallel widths ({widths_text(plan)})"
    run_cfg = config_lib.with_values(cfg, plan_values(keys))
    try:
        shape = config_lib.validate(run_cfg, devices_used(plan))
        mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
        models.param_specs(_abstract_model(config_lib.model_config(run_cfg)), config_lib.rules_for(run_cfg), mesh)
    except ValueError as e:  # a ConfigError, or a parameter split unevenly
        return f"is refused by the trainer ({e})"
    return None


@functools.lru_cache(maxsize=4)
def _abstract_model(model_cfg):
    """The model's parameters as shapes (the same for every plan of one model: built once)."""
    from flax import nnx

    from shardflow import models

    return nnx.eval_shape(lambda: models.build(model_cfg))


def plan_values(keys: list[str]) -> dict:
    """The config values a plan's settings ``keys`` give, with those they leave at their default."""
    return PLAN_DEFAULTS | dict(map(config_lib.parse_override, keys))


def expressible(candidates, cfg):
    """The first of ``candidates`` `shardflow train` runs for ``cfg``, with its settings, or
    (None, None)."""
    return next(((c, trainer_settings(c.plan)) for c in candidates if unrunnable(c.plan, cfg) is None), (None, None))


def run_line(keys: list[str]) -> str:
    return "shardflow train " + " ".join(f'--set "{k}"' for k in keys)


def plan_text(cfg, block: dict, shown: int = 5) -> str:
    cluster, result = search_cluster(cfg, block, PLANS_SEARCHED)
    batch = f"{cfg.batch_size}x{cfg.data.seq_len} {precision_of(cfg)}"
    head = (
        f"model {dict(cfg.model)} | batch {batch} | cluster {inventory_text(cluster.inventory())}\n"
        "predicted with shardflow's constants fitted on H100 / H200 (other kinds: the same fraction of peak)\n"
    )
    best = result.best
    why = unrunnable(best.plan, cfg)
    if why is None:
        keys = trainer_settings(best.plan)
        run = f"run the best plan on the {devices_used(best.plan)} devices it uses: {run_line(keys)}"
    else:
        alternative, alt_keys = expressible(result.candidates, cfg)
        run = f"the best plan {why}: shardflow train does not run it"
        if alternative:
            run += (
                f"; the best it runs ({alternative.seconds:.4g} s/step, on {devices_used(alternative.plan)} devices): "
                + run_line(alt_keys)
            )
    table = dataclasses.replace(result, candidates=result.candidates[:shown])
    return head + str(table) + "\n" + run


# The keys a plan decides, with their values where its settings leave them out.
PLAN_DEFAULTS = {"grad_accum": 1, "replica_microbatches": None, "pipeline.stages": None, "model.remat": "none"}


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """The plan a run with a ``cluster:`` block trains: hetero.search's best on every device of
    the inventory, the settings that run it, and what those devices are (``simulated``: CPU
    devices standing in for the kinds)."""

    result: object  # hetero's search Result, whose ``candidate`` is one
    candidate: object
    settings: list[str]
    inventory: dict[str, int]
    simulated: bool

    def describe(self) -> str:
        """The log lines: the cluster, the plan's row with its prediction, the settings."""
        devices = sum(self.inventory.values())
        kinds = inventory_text(self.inventory)
        where = f"; {devices} simulated CPU devices stand in for the kinds" if self.simulated else ""
        row = dataclasses.replace(self.result, candidates=(self.candidate,))
        lines = [f"cluster plan for {kinds} ({devices} devices{where}):", *str(row).splitlines()[:2]]
        lines.append(f"runs as: {run_line(self.settings)}")
        plan = self.candidate.plan
        counts = [p.microbatches for p in plan.pipelines]
        if len(plan.pipelines[0].stages) > 1 and len(set(counts)) > 1:
            lines.append(
                f"uneven micro-batches {counts} under a pipeline: every replica runs {max(counts)} slots, the "
                "padding ones computed (weighted zero, exact), not skipped"
            )
        best = self.result.best
        if devices_used(best.plan) < devices:
            lines.append(
                f"(the search's best plan uses {devices_used(best.plan)} of the {devices} devices, "
                f"{best.seconds:.4g} s/step: an inventory of those runs it)"
            )
        return "\n".join(lines)

    def device_grid(self, devices) -> list:
        """``devices`` in the mesh's order (pipe, data, model; flat), each stage of each
        pipeline on devices of its kind: the simulated devices as given."""
        return list(devices) if self.simulated else place_by_kind(self.candidate.plan, devices)

    def metadata(self) -> dict:
        """The plan and its prediction, as the run directory's cluster_plan.json holds them."""
        c = self.candidate
        return {
            "inventory": self.inventory,
            "simulated_on_cpu": self.simulated,
            "plan": dataclasses.asdict(c.plan),
            "predicted": {
                "seconds_per_step": c.seconds,
                "tokens_per_second": c.tokens_per_second,
                "peak_memory_bytes": c.peak_memory,
            },
            "settings": self.settings,
        }


def planned(cfg, devices):
    """(``cfg`` with its cluster plan's settings, the ClusterPlan), or (``cfg``, None) without a
    ``cluster:`` block. A ConfigError where the devices are not the inventory's, no plan the
    trainer runs uses them all, or the config gives a key the plan sets a different value."""
    if cfg.cluster is None:
        return cfg, None
    cluster, result = search_cluster(cfg, cfg.cluster, PLANS_SEARCHED)
    inventory = cluster.inventory()
    kinds = inventory_text(inventory)
    if len(devices) != cluster.size:
        raise config_lib.ConfigError(
            f"cluster: the inventory ({kinds}) has {cluster.size} devices, but this run has {len(devices)}"
        )
    on_every_device = [c for c in result.candidates if devices_used(c.plan) == cluster.size]
    if not on_every_device:
        raise config_lib.ConfigError(
            f"cluster: none of the search's {len(result.candidates)} best plans for {kinds} uses all "
            f"{cluster.size} devices; the best uses {devices_used(result.best.plan)} "
            f"(`shardflow plan --cluster` lists them): give an inventory of those"
        )
    chosen = on_every_device[0]
    why = unrunnable(chosen.plan, cfg)
    if why is not None:
        alternative, alt_keys = expressible(on_every_device, cfg)
        nearest = (
            f"the best plan it runs on all {cluster.size} is predicted {alternative.seconds:.4g} s/step against "
            f"{chosen.seconds:.4g}: {run_line(alt_keys)} (without the cluster block)"
            if alternative
            else f"none of the {len(on_every_device)} plans on all {cluster.size} devices among the search's "
            f"{len(result.candidates)} best can run"
        )
        raise config_lib.ConfigError(
            f"cluster: the best plan for {kinds} {why}: shardflow train cannot run it; {nearest}"
        )
    keys = trainer_settings(chosen.plan)
    values = plan_values(keys)
    _check_given(cfg, values)
    simulated = devices[0].platform == "cpu"
    return config_lib.with_values(cfg, values), ClusterPlan(result, chosen, keys, inventory, simulated)


def _check_given(cfg, values: dict) -> None:
    """A ConfigError naming each key the config gives that the plan sets otherwise."""
    clashes = []
    for key, value in values.items():
        given = [k for k in cfg.given if k == key or k.startswith(key + ".")]
        mine = config_lib.value_at(cfg, key)
        if given and mine != value:
            clashes.append(f"{key}: the config gives {_yaml(mine)}, the plan {_yaml(value)}")
    if clashes:
        raise config_lib.ConfigError(
            "cluster: the plan sets keys the config also gives, differently ("
            + "; ".join(clashes)
            + "): drop them from the config to run the plan, or drop the cluster block to run them"
        )


def _yaml(value) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1_000).strip().removesuffix("\n...")


def place_by_kind(plan, devices) -> list:
    """``devices`` ordered for the mesh (pipe, data, model) of ``plan``'s settings, stage i of
    pipeline r on devices of its kind, a stage's tensor-parallel group on one host where its
    kind has that many there. A ConfigError where the devices are not the plan's kinds."""
    from shardflow.hetero import device_kind
    from shardflow.hetero.devices import catalogue_kind

    wanted = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            name = device_kind(stage.kind).name
            wanted[name] = wanted.get(name, 0) + stage.tp
    pools = {k: [] for k in wanted}
    unknown = []
    for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
        kind = catalogue_kind(d.device_kind, wanted)
        (pools[kind] if kind is not None else unknown).append(d)
    have = {k: len(v) for k, v in pools.items()}
    if unknown or have != wanted:
        found = sorted({d.device_kind for d in devices})
        raise config_lib.ConfigError(
            f"cluster: the plan places {inventory_text(wanted)} but this run's devices are "
            f"{inventory_text(have)}{f' and {len(unknown)} of no planned kind' if unknown else ''} "
            f"(jax device kinds: {', '.join(found)})"
        )
    depth, replicas = len(plan.pipelines[0].stages), len(plan.pipelines)
    grid = [[None] * replicas for _ in range(depth)]
    for r, pipeline in enumerate(plan.pipelines):
        for i, stage in enumerate(pipeline.stages):
            pool = pools[device_kind(stage.kind).name]
            hosts = list(dict.fromkeys(d.process_index for d in pool))
            host = next((h for h in hosts if sum(d.process_index == h for d in pool) >= stage.tp), hosts[0])
            group = [d for d in pool if d.process_index == host][: stage.tp]
            group += [d for d in pool if d not in group][: stage.tp - len(group)]
            for d in group:
                pool.remove(d)
            grid[i][r] = group
    return [d for row in grid for group in row for d in group]
