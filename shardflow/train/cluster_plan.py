"""`shardflow plan --cluster FILE`: the best plans for a config's model and batch on a cluster
of mixed device kinds, each with its predicted step time and memory (``shardflow.hetero``)."""

from __future__ import annotations

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
    tensor-parallel width throughout; pipelines of one stage with uneven micro-batch counts as
    ``replica_microbatches``, or pipelines of several stages (uneven layers as
    ``pipeline.layers_per_stage``) with equal counts, under the fused 1F1B the simulator prices.
    None for plans it does not run yet (mixed widths; several stages with uneven counts, which
    sf.pipeline does not predicate)."""
    stages = [p.stages for p in plan.pipelines]
    widths, counts = {s.tp for p in stages for s in p}, [p.microbatches for p in plan.pipelines]
    depth = len(stages[0])
    if len(widths) != 1 or (depth > 1 and len(set(counts)) > 1):
        return None
    (tp,) = widths
    mesh = ([f"pipe: {depth}"] if depth > 1 else []) + [f"data: {len(counts)}"] + ([f"model: {tp}"] if tp > 1 else [])
    keys = [f"mesh={{{', '.join(mesh)}}}", f"strategy={'tp' if tp > 1 else 'dp'}", f"batch_size={plan.global_batch}"]
    if depth > 1:
        layers = [s.layers for s in stages[0]]
        keys += [f"pipeline.stages={depth}", f"pipeline.microbatches={counts[0]}", "pipeline.schedule=1f1b-fused"]
        if len(set(layers)) > 1:
            keys.append(f"pipeline.layers_per_stage={layers}")
    elif len(set(counts)) > 1:
        keys.append(f"replica_microbatches={counts}")
    elif counts[0] > 1:
        keys.append(f"grad_accum={counts[0]}")
    if plan.remat:
        keys.append(f"model.remat={'dots' if plan.remat == 'dots' else 'full'}")
    return keys


def plan_text(cfg, block: dict) -> str:
    from shardflow import hetero

    try:
        cluster = hetero.Cluster.from_config(block)
    except (TypeError, ValueError) as e:
        raise config_lib.ConfigError(str(e)) from None
    model_cfg = config_lib.model_config(cfg)
    model = transformer_of(model_cfg, cfg.data.seq_len)
    precision = {"bfloat16": "bf16", "float32": "fp32"}[cfg.compute_dtype]
    framework = hetero.Framework(**FRAMEWORK)
    try:
        result = hetero.search(
            model, cluster, cfg.batch_size, framework, precision=precision, remat_options=(False, True)
        )
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from None
    inventory = ", ".join(f"{n} x {k}" for k, n in cluster.inventory().items())
    head = (
        f"model {dict(cfg.model)} | batch {cfg.batch_size}x{cfg.data.seq_len} {precision} | cluster {inventory}\n"
        "predicted with shardflow's constants fitted on H100 / H200 (other kinds: the same fraction of peak)\n"
    )
    keys = trainer_settings(result.best.plan)
    run = (
        f"run the best plan on the {sum(s.tp for p in result.best.plan.pipelines for s in p.stages)} devices it uses: "
        "shardflow train " + " ".join(f'--set "{k}"' for k in keys)
        if keys
        else "the best plan mixes tensor-parallel widths, or gives pipelines of several stages uneven micro-batch "
        "counts: shardflow train does not run it yet"
    )
    return head + str(result) + "\n" + run
