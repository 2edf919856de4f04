"""A run: everything training needs (``Run``), built and checked from a config before any step
compiles (``setup``), and its fresh state (``init_state``)."""

from __future__ import annotations

import dataclasses
import math

from shardflow.train import steps, uneven


@dataclasses.dataclass
class Run:
    """Everything a training run needs, built (and checked) before any step compiles."""

    cfg: object
    model_cfg: object
    mesh: object
    rules: dict
    graphdef: object
    param_specs: dict
    opt_specs: object
    batch_spec: object
    optimizer: object
    schedule: object
    n_params: int
    data: object
    val_data: object
    pipeline: object = None  # models.PipelineConfig, or None
    cluster_plan: object = None  # cluster_plan.ClusterPlan where the config has a cluster block

    def shardings(self, specs):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    def step_batch_specs(self):
        """The training step's batch specs: one for every leaf, or per leaf with uneven
        micro-batches (their weights [slots, rows])."""
        from jax.sharding import PartitionSpec

        if not self.cfg.replica_microbatches:
            return self.batch_spec
        return {"inputs": self.batch_spec, "targets": self.batch_spec, "weights": PartitionSpec(*self.batch_spec[:2])}

    @property
    def replica_slots(self) -> int:
        """The micro-batch slots every data replica runs under ``replica_microbatches``: the
        pipeline's micro-batches, else the largest count."""
        return self.pipeline.microbatches if self.pipeline else max(self.cfg.replica_microbatches)

    def step_batch(self, tokens, index: int, accum: int | None = None):
        """Batch ``index`` of ``tokens`` (a data.TokenFile) as the steps take it, in their
        shardings: [accum (default grad_accum), micro-batch, seq], or the replicas' slots under
        ``replica_microbatches``; in a context-parallel layout's token order where it has one."""
        from shardflow.train import data as data_lib

        cfg, layout = self.cfg, self.model_cfg.layout
        order = None if layout is None else layout.positions(cfg.data.seq_len)
        counts, seed = cfg.replica_microbatches, cfg.data.seed
        if counts:
            shardings = self.shardings(self.step_batch_specs())
            rows = cfg.batch_size // sum(counts)
            return uneven.global_batch(
                tokens, index, counts, rows, self.replica_slots, cfg.data.seq_len, seed, shardings, order
            )
        shape = (accum or cfg.grad_accum, cfg.batch_size // cfg.grad_accum)
        return data_lib.global_batch(
            tokens, index, shape, cfg.data.seq_len, seed, self.shardings(self.batch_spec), order
        )

    def train_step(self, engine: str | None = None):
        """The config's training step, (params, opt_state, batch) -> (params, opt_state,
        metrics), run by ``engine`` (default: the config's) with the run's specs."""
        if self.cfg.replica_microbatches:
            step = uneven.make_train_step(self.graphdef, self.optimizer, self.cfg.compute_dtype, self.pipeline)
        else:
            step = steps.make_train_step(
                self.graphdef, self.optimizer, self.cfg.compute_dtype, self.cfg.grad_accum, self.pipeline
            )
        return steps.parallelize_step(
            step,
            engine or self.cfg.engine,
            self.mesh,
            self.rules,
            in_specs=(self.param_specs, self.opt_specs, self.step_batch_specs()),
            out_specs=(self.param_specs, self.opt_specs, None),
            planner=self.cfg.planner,
            stationary_weights=self.cfg.stationary_weights,
        )

    def eval_step(self):
        """(params, batch) -> the mean cross-entropy of a validation batch, laid out as the
        training step's (in slots under ``replica_microbatches``)."""
        make = uneven.make_eval_step if self.cfg.replica_microbatches else steps.make_eval_step
        return steps.parallelize_step(
            make(self.graphdef, self.cfg.compute_dtype, self.pipeline),
            self.cfg.engine,
            self.mesh,
            self.rules,
            in_specs=(self.param_specs, self.step_batch_specs()),
            out_specs=None,
            donate=(),
            planner=self.cfg.planner,
            stationary_weights=self.cfg.stationary_weights,
        )


def setup(cfg) -> Run:
    """The run ``cfg`` describes; with a ``cluster:`` block, its plan's (``Run.cfg`` holds the
    plan's settings)."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec

    from shardflow import models
    from shardflow.models import sharding as model_sharding
    from shardflow.train import config as config_lib
    from shardflow.train import data as data_lib
    from shardflow.train.cluster_plan import planned

    cfg, cluster_plan = planned(cfg, jax.devices())
    mesh_shape = config_lib.validate(cfg, jax.device_count())
    model_cfg = config_lib.model_config(cfg)
    data_dir = cfg.data.path or data_lib.default_corpus_dir()
    data = data_lib.TokenFile(data_dir)
    val_data = data_lib.TokenFile(data_dir, "val") if cfg.eval_every else None
    for tokens in (data, val_data):
        if tokens is not None:
            tokens.check_fits(cfg.data.seq_len)
    if data.vocab_size > model_cfg.vocab_size:
        raise config_lib.ConfigError(
            f"the data's vocabulary ({data.vocab_size}, {data_dir}) is larger than "
            f"model.vocab_size ({model_cfg.vocab_size}); --set model.vocab_size=N with N >= "
            f"{data.vocab_size} (a multiple of 128 keeps the matmuls aligned)"
        )
    if cfg.pipeline.stages is not None and cfg.pipeline.axis in mesh_shape:
        # The pipeline's axis outermost: each stage a block of consecutive devices (Megatron's
        # order), so a stage's data / model groups sit on neighbouring devices.
        mesh_shape = {
            cfg.pipeline.axis: mesh_shape[cfg.pipeline.axis],
            **{a: n for a, n in mesh_shape.items() if a != cfg.pipeline.axis},
        }
    devices = jax.devices() if cluster_plan is None else cluster_plan.device_grid(jax.devices())
    mesh = Mesh(np.asarray(devices).reshape(tuple(mesh_shape.values())), tuple(mesh_shape))
    rules = config_lib.rules_for(cfg)
    if model_cfg.layout is not None:  # a ring of as many blocks as the sequence is split into
        seq_axes = model_sharding.mesh_axes_of(rules.get("seq"))
        model_cfg = dataclasses.replace(model_cfg, context_blocks=math.prod(mesh_shape[a] for a in seq_axes))

    abstract_model = nnx.eval_shape(lambda: models.build(model_cfg, cfg.seed))
    graphdef, abstract_params = nnx.split(abstract_model)
    if isinstance(cfg.strategy, dict):
        try:
            model_sharding.check_logical_names(cfg.strategy, model_sharding.model_logical_axes(abstract_model))
        except ValueError as e:
            raise config_lib.ConfigError(f"strategy {cfg.strategy}: {e}") from None
    try:
        param_specs = models.param_specs(abstract_model, rules, mesh)
    except ValueError as e:
        raise config_lib.ConfigError(f"strategy {cfg.strategy!r} on mesh {mesh_shape}: {e}") from None
    axes_tree, unannotated = models.param_logical_axes(abstract_model)
    if unannotated and jax.process_index() == 0:
        print(f"note: parameters without logical axes (replicated): {unannotated}")
    # Weight decay on matrices only: dims other than the stacked-layers one, at least two.
    decay_mask = jax.tree.map(
        lambda axes: sum(a != model_sharding.STACKED_AXIS for a in axes) >= 2,
        axes_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    optimizer, schedule = steps.build_optimizer(cfg.optimizer, cfg.steps, decay_mask)
    params_shape = nnx.to_pure_dict(abstract_params)
    opt_shape = jax.eval_shape(optimizer.init, params_shape)
    opt_specs = optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        opt_shape,
        param_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    batch_spec = model_sharding.spec_for((None, "batch", None), rules)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params_shape))
    return Run(
        cfg,
        model_cfg,
        mesh,
        rules,
        graphdef,
        param_specs,
        opt_specs,
        batch_spec,
        optimizer,
        schedule,
        n_params,
        data,
        val_data,
        config_lib.pipeline_config(cfg),
        cluster_plan,
    )


def init_state(run: Run):
    """Fresh fp32 parameters and optimizer state, created directly in their shardings."""
    import jax
    from flax import nnx

    from shardflow import models

    def init():
        model = models.build(run.model_cfg, run.cfg.seed)
        params = nnx.to_pure_dict(nnx.state(model))  # parameters, and state such as a router bias
        return params, run.optimizer.init(params)

    out = (run.shardings(run.param_specs), run.shardings(run.opt_specs))
    return jax.jit(init, out_shardings=out)()
