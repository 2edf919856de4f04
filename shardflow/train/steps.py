"""The training and evaluation steps: the optimizer, the loss, the single-device step
functions, and running them as one SPMD program (``parallelize_step``)."""

from __future__ import annotations


def build_optimizer(ocfg, total_steps: int, decay_mask):
    import optax

    warmup = min(ocfg.warmup_steps, total_steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=ocfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=ocfg.lr * ocfg.min_lr_ratio,
    )
    adamw = optax.adamw(
        schedule, b1=ocfg.beta1, b2=ocfg.beta2, eps=ocfg.eps, weight_decay=ocfg.weight_decay, mask=decay_mask
    )
    clip = optax.clip_by_global_norm(ocfg.clip_norm) if ocfg.clip_norm > 0 else optax.identity()
    return optax.chain(clip, adamw), schedule


def make_loss_fn(graphdef, compute_dtype, pipeline=None):
    """(params, inputs, targets, weights=None) -> (loss, stats): the model's ``losses`` (the mean
    next-token cross-entropy, fp32, or with ``weights`` [batch] the rows' weighted mean, plus an
    MoE model's balance terms; stats: its routing statistics, or {}), its stacked layers run by
    ``sf.pipeline`` where ``pipeline`` (a models.PipelineConfig) is given."""
    from shardflow import models

    def loss_fn(params, inputs, targets, weights=None):
        # fp32 master weights; the forward (and backward) run on a compute_dtype copy
        model = models.for_compute(graphdef, params, compute_dtype)
        return model.losses(inputs, targets, pipeline=pipeline, weights=weights)

    return loss_fn


def make_train_step(graphdef, optimizer, compute_dtype, grad_accum: int, pipeline=None):
    """(params, opt_state, batch) -> (params, opt_state, {"loss", "grad_norm"} and an MoE
    model's routing statistics).

    batch["inputs"/"targets"] are [grad_accum, micro_batch, seq]; gradients of the
    micro-batches are summed in fp32 by a scan, then averaged (and so are the statistics). With
    ``pipeline``, each micro-batch's loss and gradients come from the pipeline's schedule. An
    MoE model balancing by bias has its router biases moved by the step's expert loads after the
    optimizer's update.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from shardflow.models import moe

    grad_fn = jax.value_and_grad(make_loss_fn(graphdef, compute_dtype, pipeline), has_aux=True)

    def train_step(params, opt_state, batch):
        if grad_accum == 1:
            (loss, stats), grads = grad_fn(params, batch["inputs"][0], batch["targets"][0])
        else:

            def accumulate(total, micro):
                return jax.tree.map(jnp.add, total, grad_fn(params, micro["inputs"], micro["targets"])), None

            first = jax.tree.map(lambda x: x[0], batch)
            zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, first["inputs"], first["targets"]))
            ((loss, stats), grads), _ = jax.lax.scan(accumulate, zeros, batch)
            loss, stats, grads = jax.tree.map(lambda x: x / grad_accum, (loss, stats, grads))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if "load" in stats:
            params = moe.rebalanced(graphdef, params, stats["load"])
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **stats}

    return train_step


def make_eval_step(graphdef, compute_dtype, pipeline=None):
    """(params, batch) -> mean cross-entropy over the batch's tokens (batch as in train_step).
    With ``pipeline``, the pipelined loss (its layers stay on their stages; the schedule's
    backward runs too, as sf.pipeline computes the loss with its gradient)."""
    loss_fn = make_loss_fn(graphdef, compute_dtype, pipeline)

    def eval_step(params, batch):
        loss, stats = loss_fn(params, batch["inputs"][0], batch["targets"][0])
        return stats.get("cross_entropy", loss)

    return eval_step


def parallelize_step(
    step_fn,
    engine: str,
    mesh,
    rules,
    in_specs,
    out_specs,
    donate: tuple = (0, 1),
    planner: str = "greedy",
    stationary_weights: bool = False,
):
    """Run step_fn as one SPMD program on mesh with the engine (and shardflow's planner) the
    config names; ``stationary_weights``: the weights stay on the rules' tensor-parallel axes."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from shardflow.models import activation_sharding
    from shardflow.models import sharding as model_sharding

    if engine == "shardflow":
        import shardflow as sf

        pin = sf.constrain
    else:
        pin = model_sharding.jit_pin(mesh)

    def step_with_activation_rules(*args):
        with activation_sharding(rules, pin):
            return step_fn(*args)

    if engine == "shardflow":
        return sf.parallelize(
            step_with_activation_rules,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            donate_argnums=donate,
            passes=sf.passes.SOLVER if planner == "solver" else None,
            stationary=[a for a in model_sharding.tensor_parallel_axes(rules) if a in mesh.axis_names]
            if stationary_weights
            else (),
        )
    to_sharding = lambda tree: jax.tree.map(  # noqa: E731
        lambda s: NamedSharding(mesh, s if s is not None else PartitionSpec()),
        tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
    )
    return jax.jit(
        step_with_activation_rules,
        in_shardings=to_sharding(in_specs),
        out_shardings=to_sharding(out_specs),
        donate_argnums=donate,
    )
