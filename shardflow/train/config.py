"""Training configuration: defaults < YAML file < ``--set key=value`` overrides.

Every key is a dataclass field, so a misspelt key is an error that lists the valid ones, and
:func:`validate` checks the mesh against the devices and the batch against the data axes —
all before anything is traced or compiled.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path
from typing import Any, ClassVar

import yaml


class ConfigError(ValueError):
    """A configuration that cannot run; raised before anything compiles."""


@dataclasses.dataclass
class DataSection:
    path: str | None = None  # a `shardflow prepare` output dir; None = embedded stdlib corpus
    seq_len: int = 128
    seed: int = 0


@dataclasses.dataclass
class OptimizerSection:
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1  # not applied to norms, biases or other 1-D parameters
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # global-norm gradient clipping; 0 disables


@dataclasses.dataclass
class CheckpointSection:
    every: int = 100  # steps between saves; 0 disables checkpointing
    keep: int = 3  # keep the last N
    async_save: bool = True
    resume: bool = True  # from out/'s latest checkpoint; false: refused if out/ has any


@dataclasses.dataclass
class PipelineSection:
    """Pipeline parallelism: the model's stacked layers split over mesh axis ``axis`` in
    ``stages`` stages, the batch (of each grad_accum step) in ``microbatches``, run by
    ``sf.pipeline`` in ``schedule``. ``stages: null`` (the default) pipelines nothing."""

    stages: int | None = None  # the size of mesh axis `axis`; null = no pipeline
    microbatches: int | None = None  # null = 2 * stages
    schedule: str = "1f1b"  # gpipe, 1f1b, 1f1b-fused, interleaved, zb-h1, zb-v, zb-fused
    chunks: int | None = None  # layer chunks per stage, interleaved only (null = 2)
    layers_per_stage: list | None = None  # e.g. [5, 4, 4, 3] (one per virtual stage with chunks); null = even
    axis: str = "pipe"


@dataclasses.dataclass
class Config:
    model: dict = dataclasses.field(default_factory=lambda: {"preset": "tiny"})
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    pipeline: PipelineSection = dataclasses.field(default_factory=PipelineSection)
    # Mesh axis name -> size; None puts every device on one "data" axis.
    mesh: dict | None = None
    # A preset name (dp, fsdp, tp, tp_sp, 2d, pp, pp_dp, pp_tp) or an explicit {logical axis:
    # mesh axis} table. With a pipeline, the stacked layers go on its axis whatever the table.
    strategy: Any = "dp"
    engine: str = "shardflow"  # "shardflow" (sf.parallelize) or "jit" (the jax.jit baseline)
    planner: str = "greedy"  # shardflow's: "greedy" (passes.propagate) or "solver" (passes.solve)
    # Keep the weights where a tensor-parallel strategy splits them (Megatron's layout: only
    # activations move); false lets the planner gather a weight where it models that cheaper.
    stationary_weights: bool = False
    batch_size: int = 16  # sequences per optimizer step, all devices together
    grad_accum: int = 1  # micro-batches per optimizer step
    # Micro-batches per data replica, uneven (a slower replica takes fewer): [4, 4, 3, 1]; null:
    # every replica takes batch_size / data ways rows at once (see shardflow/train/uneven.py).
    replica_microbatches: list | None = None
    compute_dtype: str = "bfloat16"  # parameters stay float32; this is the forward/backward dtype
    steps: int = 200
    seed: int = 0
    out: str = "runs/default"
    log_every: int = 10
    eval_every: int = 100  # steps between val.bin losses (on logged steps); 0 = never
    eval_batches: int = 4  # micro-batches of val.bin per evaluation
    peak_flops: float | None = None  # per device; None = known accelerators, else MFU is n/a
    # A heterogeneous cluster (`shardflow plan --cluster`'s block: inventory, per_node, ...): the
    # trainer runs hetero.search's best plan for it (shardflow/train/cluster_plan.py).
    cluster: dict | None = None

    # The dotted keys the YAML file and the overrides gave (set by `load`; not a config key): a
    # cluster plan may set any key but these.
    given: ClassVar[frozenset[str]] = frozenset()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _merge(obj, updates: dict, where: str):
    """Set fields of a dataclass from a mapping, recursing into nested config sections."""
    if not isinstance(updates, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {updates!r}")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in updates.items():
        if key not in fields:
            raise ConfigError(f"unknown config key {where + key!r}; valid keys here: {', '.join(sorted(fields))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _merge(current, value, f"{where}{key}.")
        elif key == "model" and isinstance(value, str):
            setattr(obj, key, {"preset": value})
        elif key == "model":
            if not isinstance(value, dict):
                raise ConfigError(f"model must be a preset name or a mapping of model keys, got {value!r}")
            setattr(obj, key, {**current, **value})
        else:
            setattr(obj, key, _as_float(value) if isinstance(current, float) else value)


def _as_float(value):
    """YAML 1.1 reads 3e-4 (no dot) as a string: a float key takes it as the number it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _parse_yaml(text: str, where: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{where} is not valid YAML: {getattr(e, 'problem', None) or e}{at}") from None


def _set_path(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def load(path: str | None = None, overrides: list[str] = (), **direct) -> Config:
    """Build a Config from an optional YAML file and ``key.sub=value`` strings (YAML values)."""
    cfg = Config()
    trees = []
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"--config {path}: {e.strerror}") from None
        trees.append(_parse_yaml(text, f"--config {path}") or {})
    trees += [override_tree(overrides), {k: v for k, v in direct.items() if v is not None}]
    for tree in trees:
        _merge(cfg, tree, "")
    cfg.given = frozenset().union(*(_dotted_keys(tree) for tree in trees))
    return cfg


def override_tree(overrides) -> dict:
    """``["a.b=1", "c=[2, 3]"]`` as the nested mapping a YAML file would give."""
    tree: dict = {}
    for item in overrides:
        _set_path(tree, *parse_override(item))
    return tree


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=[1, 2]"`` -> ``("a.b", [1, 2])``: the dotted key and its YAML value."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    return key.strip(), _parse_yaml(raw, f"--set {item!r}")


def with_values(cfg: Config, values: dict[str, Any]) -> Config:
    """A copy of ``cfg`` with each dotted key of ``values`` set to its value."""
    tree: dict = {}
    for key, value in values.items():
        _set_path(tree, key, value)
    updated = copy.deepcopy(cfg)
    _merge(updated, tree, "")
    return updated


def value_at(cfg: Config, dotted: str):
    """The value of a dotted key: ``value_at(cfg, "pipeline.stages")``, ``"model.remat"`` (None
    where the model mapping does not name it)."""
    value = cfg
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part)
    return value


def _dotted_keys(tree, prefix: str = "") -> set[str]:
    if not isinstance(tree, dict) or not tree:
        return {prefix[:-1]} if prefix else set()
    return set().union(*(_dotted_keys(v, f"{prefix}{k}.") for k, v in tree.items()))


def model_config(cfg: Config):
    from shardflow.models import ModelConfig, preset

    fields = dict(cfg.model)
    name = fields.pop("preset", None)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for key, value in fields.items():
        if key not in defaults:
            raise ConfigError(f"unknown config key 'model.{key}'; valid keys: preset, {', '.join(sorted(defaults))}")
        if isinstance(defaults[key], float):
            fields[key] = value = _as_float(value)
        ok, what = _MODEL_FIELD_CHECKS[type(defaults[key])]
        if not ok(value):
            raise ConfigError(f"model.{key} must be {what}, got {value!r}")
    try:
        return preset(name, **fields) if name else ModelConfig(**fields)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def pipeline_config(cfg: Config):
    """The models' PipelineConfig of the run, or None where no pipeline is configured."""
    from shardflow.models import PipelineConfig

    pl, counts = cfg.pipeline, cfg.replica_microbatches
    if pl.stages is None:
        return None
    return PipelineConfig(
        stages=pl.stages,
        microbatches=pl.microbatches or (max(counts) if counts else 2 * pl.stages),
        schedule=pl.schedule,
        chunks=pl.chunks,
        axis=pl.axis,
        layers_per_stage=None if pl.layers_per_stage is None else tuple(pl.layers_per_stage),
    )


def rules_for(cfg: Config) -> dict:
    """The strategy's rules table; with a pipeline of stages, the stacked layers on its axis."""
    from shardflow.models import get_rules, with_pipeline

    rules = get_rules(cfg.strategy)
    stages = cfg.pipeline.stages
    return with_pipeline(rules, cfg.pipeline.axis) if stages is not None and stages > 1 else rules


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_positive_int = (lambda x: _is_int(x) and x >= 1, "a positive integer")
_boolean = (lambda x: isinstance(x, bool), "true or false")

# A model key is checked by the type of its ModelConfig default (every int there is a size).
_MODEL_FIELD_CHECKS = {
    int: _positive_int,
    float: (lambda x: _is_real(x) and x > 0, "a number > 0"),
    bool: _boolean,
    str: (lambda x: isinstance(x, str), "a string"),
    type(None): (lambda x: x is None or (_is_int(x) and x >= 1), "a positive integer or null"),
}

# key -> (test, what it must be), for every numeric and boolean key.
_CHECKS = {
    "steps": _positive_int,
    "batch_size": _positive_int,
    "grad_accum": _positive_int,
    "log_every": _positive_int,
    "eval_every": (lambda x: _is_int(x) and x >= 0, "an integer >= 0"),
    "data.seq_len": _positive_int,
    "data.seed": (_is_int, "an integer"),
    "seed": (_is_int, "an integer"),
    "optimizer.lr": (lambda x: _is_real(x) and x > 0, "a number > 0"),
    "optimizer.min_lr_ratio": (lambda x: _is_real(x) and 0 <= x <= 1, "a number in [0, 1]"),
    "optimizer.warmup_steps": (lambda x: _is_int(x) and x >= 0, "an integer >= 0"),
    "optimizer.weight_decay": (lambda x: _is_real(x) and x >= 0, "a number >= 0"),
    "optimizer.beta1": (lambda x: _is_real(x) and 0 <= x < 1, "a number in [0, 1)"),
    "optimizer.beta2": (lambda x: _is_real(x) and 0 <= x < 1, "a number in [0, 1)"),
    "optimizer.eps": (lambda x: _is_real(x) and x > 0, "a number > 0"),
    "optimizer.clip_norm": (lambda x: _is_real(x) and x >= 0, "a number >= 0 (0 disables)"),
    "out": (lambda x: isinstance(x, str) and x != "", "a directory path (a string)"),
    "data.path": (
        lambda x: x is None or (isinstance(x, str) and x != ""),
        "a `shardflow prepare` directory's path (a string), or null",
    ),
    "checkpoint.every": (lambda x: _is_int(x) and x >= 0, "an integer >= 0 (0 disables)"),
    "checkpoint.keep": _positive_int,
    "checkpoint.async_save": _boolean,
    "checkpoint.resume": _boolean,
    "peak_flops": (lambda x: x is None or (_is_real(x) and x > 0), "a number > 0 (or null)"),
    "pipeline.stages": (lambda x: x is None or (_is_int(x) and x >= 1), "a positive integer (or null: no pipeline)"),
    "pipeline.microbatches": (
        lambda x: x is None or (_is_int(x) and x >= 1),
        "a positive integer (or null: 2 * stages)",
    ),
    "pipeline.chunks": (lambda x: x is None or (_is_int(x) and x >= 1), "a positive integer (or null)"),
    "pipeline.layers_per_stage": (
        lambda x: x is None or (isinstance(x, (list, tuple)) and len(x) > 0 and all(_is_int(n) and n >= 1 for n in x)),
        "a list of positive integers (or null: an even split)",
    ),
    "pipeline.schedule": (lambda x: isinstance(x, str), "a schedule's name"),
    "pipeline.axis": (lambda x: isinstance(x, str), "a mesh axis name"),
}


def _check_values(cfg: Config) -> None:
    for key, (ok, what) in _CHECKS.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if not ok(value):
            raise ConfigError(f"{key} must be {what}, got {value!r}")


def check_writable(cfg: Config) -> None:
    """That the run can write out/ and its checkpoints: checked before training starts, without
    creating anything, rather than found when the first save fails."""
    _check_writable_dir(Path(cfg.out), "out")
    if cfg.checkpoint.every:
        _check_writable_dir(Path(cfg.out) / "checkpoints", "the checkpoint directory")


def check_not_overwriting(cfg: Config) -> None:
    """That a run told not to resume has no checkpoints in its way. orbax saves no step at or
    below the newest one already in the directory, so a fresh run there would keep the old
    steps and add only later ones: a mix of two runs. Refused rather than deleted."""
    if not cfg.checkpoint.every or cfg.checkpoint.resume:
        return
    directory = Path(cfg.out) / "checkpoints"
    steps = checkpoint_steps(directory)
    if steps:
        shown = (
            ", ".join(map(str, steps))
            if len(steps) <= 6
            else f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]}; {len(steps)} in all"
        )
        raise ConfigError(
            f"checkpoint.resume is false but {directory} holds checkpoints (step"
            f"{'s' * (len(steps) > 1)} {shown}), which this run could not replace: orbax saves "
            f"no step at or below {steps[-1]} there. Resume from them (checkpoint.resume=true), "
            f"train into a fresh --out directory, or delete {directory} yourself"
        )


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the checkpoints in ``directory`` as orbax names them (one folder per step,
    named by its number), read without creating anything."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isascii() and p.name.isdigit() and p.is_dir())


def _check_writable_dir(path: Path, what: str) -> None:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        problem = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise ConfigError(f"{what} {str(path)!r} {problem}, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing} cannot be written)"
        raise ConfigError(f"{what} {str(path)!r} is not writable{where}")


def _sized(mesh: dict, n_devices: int) -> dict:
    """``mesh`` with its one ``auto`` axis (if any) sized to the devices the others leave: the
    run takes the devices it finds, as after a preemption (8 devices, {data: auto, model: 2} ->
    data 4; 6 devices -> data 3)."""
    auto = [axis for axis, size in mesh.items() if size == "auto"]
    if not auto:
        return mesh
    if len(auto) > 1:
        raise ConfigError(f"mesh {mesh}: at most one axis may be auto")
    fixed = math.prod(size for size in mesh.values() if size != "auto")
    if n_devices % fixed:
        raise ConfigError(
            f"mesh {mesh}: the {n_devices} devices do not divide by the other axes' {fixed} to size {auto[0]!r}"
        )
    return {axis: n_devices // fixed if size == "auto" else size for axis, size in mesh.items()}


def validate(cfg: Config, n_devices: int) -> dict:
    """Check what can be checked without compiling; returns the mesh shape to build."""
    if cfg.engine not in ("shardflow", "jit"):
        raise ConfigError(f"engine must be 'shardflow' or 'jit', got {cfg.engine!r}")
    if cfg.planner not in ("greedy", "solver"):
        raise ConfigError(f"planner must be 'greedy' or 'solver', got {cfg.planner!r}")
    if not isinstance(cfg.stationary_weights, bool):
        raise ConfigError(f"stationary_weights must be true or false, got {cfg.stationary_weights!r}")
    if cfg.compute_dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"compute_dtype must be 'bfloat16' or 'float32', got {cfg.compute_dtype!r}")
    _check_values(cfg)
    if cfg.eval_every and not (_is_int(cfg.eval_batches) and cfg.eval_batches >= 1):
        raise ConfigError(f"eval_batches must be a positive integer, got {cfg.eval_batches!r}")
    if cfg.data.path is not None and not (Path(cfg.data.path) / "meta.json").exists():
        raise ConfigError(
            f"data.path {cfg.data.path!r} is not a prepared data dir (no meta.json); "
            "create one with `shardflow prepare --input FILES --out DIR`"
        )
    if cfg.mesh is not None and not isinstance(cfg.mesh, dict):
        raise ConfigError(f"mesh must map axis names to sizes, e.g. {{data: 2, model: 4}}; got {cfg.mesh!r}")
    for axis, size in (cfg.mesh or {}).items():
        if not (_is_int(size) and size >= 1) and size != "auto":
            raise ConfigError(f"mesh axis {axis!r} must have a positive integer size or auto, got {size!r}")
    mesh = _sized(dict(cfg.mesh), n_devices) if cfg.mesh else {"data": n_devices}
    if math.prod(mesh.values()) != n_devices:
        raise ConfigError(f"mesh {mesh} has {math.prod(mesh.values())} devices but {n_devices} are available")
    pl = cfg.pipeline
    if pl.stages is not None:
        if cfg.engine != "shardflow":
            raise ConfigError(
                f"pipeline runs under engine 'shardflow' (sf.parallelize runs its schedule), not {cfg.engine!r}"
            )
        if pl.axis not in mesh and pl.stages > 1:
            raise ConfigError(
                f"pipeline.stages {pl.stages} runs on mesh axis {pl.axis!r}, which "
                f"the mesh {mesh} lacks; give it one, e.g. mesh={{data: 2, "
                f"{pl.axis}: {pl.stages}}}"
            )
        if pl.axis in mesh and mesh[pl.axis] != pl.stages:
            raise ConfigError(
                f"pipeline.stages {pl.stages} must equal the size of mesh axis "
                f"{pl.axis!r} ({mesh[pl.axis]}, mesh {mesh})"
            )
    from shardflow.models import STACKED_AXIS, check_rules

    try:
        rules = rules_for(cfg)
        check_rules(rules, list(mesh))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if pl.stages is None and rules.get(STACKED_AXIS) is not None:
        raise ConfigError(
            f"strategy {cfg.strategy!r} puts the stacked layers on mesh axis "
            f"{rules[STACKED_AXIS]!r}, which only a pipeline runs them on: set "
            f"pipeline.stages to its size"
        )
    if pl.stages is None and mesh.get(pl.axis, 1) > 1:
        raise ConfigError(
            f"mesh axis {pl.axis!r} has {mesh[pl.axis]} devices but no pipeline runs on "
            f"it (every one would compute the same): set pipeline.stages="
            f"{mesh[pl.axis]}, or drop the axis from the mesh"
        )
    if cfg.batch_size % cfg.grad_accum:
        raise ConfigError(f"batch_size {cfg.batch_size} is not divisible by grad_accum {cfg.grad_accum}")
    micro = cfg.batch_size // cfg.grad_accum
    batch_rule = rules.get("batch")
    batch_axes = () if batch_rule is None else (batch_rule,) if isinstance(batch_rule, str) else tuple(batch_rule)
    ways = math.prod(mesh[a] for a in batch_axes)
    if micro % ways:
        raise ConfigError(
            f"micro-batch {micro} (batch_size {cfg.batch_size} / grad_accum "
            f"{cfg.grad_accum}) is not divisible by the data axes "
            f"{batch_axes} of the mesh ({ways} ways)"
        )
    mc = model_config(cfg)
    if cfg.replica_microbatches is not None:
        _check_replicas(cfg, ways, mc)
    if cfg.data.seq_len > mc.max_seq_len and mc.family == "gpt2":
        raise ConfigError(f"data.seq_len {cfg.data.seq_len} exceeds gpt2 max_seq_len {mc.max_seq_len}")
    if mc.sliding_window is not None and cfg.data.seq_len > mc.sliding_window:
        raise ConfigError(
            f"data.seq_len {cfg.data.seq_len} exceeds model.sliding_window "
            f"{mc.sliding_window} (the attention has no window: a sequence must "
            "fit in it)"
        )
    _check_context(cfg, mesh, rules, mc)
    if pl.stages is not None:
        _check_pipeline(cfg, micro, batch_axes, ways, mc)
    return mesh


def _check_replicas(cfg, ways: int, model_cfg) -> int:
    """The rows each data replica takes per micro-batch slot (``replica_microbatches``,
    shardflow/train/uneven.py), or a ConfigError naming the key."""
    counts = cfg.replica_microbatches
    what = f"replica_microbatches {counts}"
    if not (isinstance(counts, list) and counts and all(isinstance(c, int) and c >= 1 for c in counts)):
        raise ConfigError(f"{what}: a list of positive integers, one per data replica")
    if len(counts) != ways:
        raise ConfigError(f"{what}: one count per data replica; the mesh's data axes make {ways}")
    if cfg.batch_size % sum(counts):
        raise ConfigError(f"{what}: batch_size {cfg.batch_size} is not divisible by their sum {sum(counts)}")
    if cfg.grad_accum != 1 or cfg.engine != "shardflow":
        raise ConfigError(f"{what}: runs under engine shardflow, without grad_accum (it sets the micro-batches)")
    slots = cfg.pipeline.microbatches
    if cfg.pipeline.stages is not None and slots is not None and slots < max(counts):
        raise ConfigError(
            f"{what}: each replica runs its micro-batches as the pipeline's, so pipeline.microbatches "
            f"{slots} must be at least the largest count, {max(counts)} (or null: that count)"
        )
    if model_cfg.n_experts:
        raise ConfigError(f"{what}: an MoE model routes each micro-batch's rows together; dense models only")
    return cfg.batch_size // sum(counts)


def _check_context(cfg: Config, mesh: dict, rules: dict, mc) -> None:
    """The sequence against the mesh axes that split it, and Ulysses' heads against the axes it
    moves that split onto."""
    from shardflow.models.sharding import mesh_axes_of

    seq_axes = mesh_axes_of(rules.get("seq"))
    if not seq_axes:
        return
    ways = math.prod(mesh[a] for a in seq_axes)
    chunks = 2 * ways if mc.context.partition("-")[0] == "zigzag" else ways
    if cfg.data.seq_len % chunks:
        how = f" (model.context {mc.context!r}: 2 chunks per device)" if chunks != ways else ""
        raise ConfigError(
            f"data.seq_len {cfg.data.seq_len} is not divisible by {chunks}: strategy "
            f"{cfg.strategy!r} splits the sequence over mesh axes {seq_axes} "
            f"({ways} ways){how}"
        )
    if mc.attention_context not in ("ulysses", "hybrid"):
        return
    # Ulysses re-splits q, k and v from the sequence to the heads: over every sequence axis, or
    # (hybrid) the innermost one, on top of the axes that split the heads already.
    moved = seq_axes if mc.attention_context == "ulysses" else seq_axes[-1:]
    axes = tuple(dict.fromkeys(mesh_axes_of(rules.get("kv_heads")) + moved))
    heads_ways = math.prod(mesh[a] for a in axes)
    key = "n_kv_heads" if mc.family == "llama" else "n_heads"  # gpt2: as many kv heads as heads
    if getattr(mc, key) % heads_ways:
        raise ConfigError(
            f"model.context {mc.context!r} splits the attention heads over mesh axes "
            f"{axes} ({heads_ways} ways), so the kv heads must divide by "
            f"{heads_ways}: model.{key} is {getattr(mc, key)}"
        )


def _check_pipeline(cfg: Config, micro: int, batch_axes, ways: int, mc) -> None:
    """The schedule, and the layers and the batch against the stages and micro-batches."""
    from shardflow import schedules

    pl, pipeline = cfg.pipeline, pipeline_config(cfg)
    p, m = pipeline.stages, pipeline.microbatches
    try:
        table = schedules.by_name(pl.schedule, p, m, pl.chunks)
    except ValueError as e:
        slots = cfg.replica_microbatches and (
            f"replica_microbatches {cfg.replica_microbatches}: every replica runs {m} micro-batch slots "
            "(pipeline.microbatches, else the largest count), which pipeline.schedule cannot: "
        )
        raise ConfigError(f"{slots or ''}{e}") from None
    chunks = f" x {table.chunks} chunks ({table.name})" if table.chunks > 1 else ""
    counts = pl.layers_per_stage
    if counts is not None and (len(counts) != p * table.chunks or sum(counts) != mc.n_layers):
        raise ConfigError(
            f"pipeline.layers_per_stage {list(counts)} must give {p * table.chunks} counts "
            f"(pipeline.stages {p}{chunks}) summing to model.n_layers {mc.n_layers}"
        )
    if counts is not None and mc.n_layers % p:  # the stacked layers are stored split over the axis
        raise ConfigError(
            f"model.n_layers {mc.n_layers} is stored split over pipeline.stages {p}: "
            f"with layers_per_stage too it must divide by {p}"
        )
    if counts is None and mc.n_layers % (p * table.chunks):
        raise ConfigError(
            f"model.n_layers {mc.n_layers} does not split into pipeline.stages "
            f"{p}{chunks}; pipeline.layers_per_stage gives an uneven split"
        )
    if not cfg.replica_microbatches and micro % (m * ways):  # uneven: laid out in m slots already
        data = f" x the data axes {batch_axes} ({ways} ways)" if ways > 1 else ""
        raise ConfigError(
            f"micro-batch {micro} (batch_size {cfg.batch_size} / grad_accum "
            f"{cfg.grad_accum}) does not split into pipeline.microbatches {m}{data}"
        )
