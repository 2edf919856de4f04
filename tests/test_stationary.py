"""``stationary`` mesh axes: the planners move no input split over them (nor its casts, nor a
loop's slices of it), as tensor parallelism keeps its weights and moves activations instead."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow.models import sharding as model_sharding


def sequence_parallel_layer(x, ws):
    """Two layers over sequence-split activations; each weight smaller than the activations, so
    gathering a weight is the cheaper move."""
    x = sf.constrain(x, PS("data", "model"))
    h = jax.lax.scan(lambda h, w: (jnp.tanh(jnp.einsum("bsd,df->bsf", h, w)), None), x, ws)[0]
    return sf.constrain(h, PS("data", "model"))


ARGS = (
    np.random.default_rng(0).standard_normal((8, 64, 32)).astype(np.float32),
    np.random.default_rng(1).standard_normal((2, 32, 32)).astype(np.float32) / 6,
)
SPECS = dict(in_specs=(PS("data", "model"), PS(None, None, "model")), out_specs=PS("data", "model"))


@pytest.mark.parametrize("planner", ["greedy", "solver"])
def test_a_stationary_weight_is_never_gathered_and_the_result_is_the_same(planner):
    mesh = sf.make_mesh({"data": 2, "model": 4})
    passes = sf.passes.SOLVER if planner == "solver" else None
    free = sf.parallelize(sequence_parallel_layer, mesh=mesh, passes=passes, **SPECS)
    kept = sf.parallelize(sequence_parallel_layer, mesh=mesh, passes=passes, stationary="model", **SPECS)
    assert free.explain(*ARGS).gathered  # the weights are the cheaper move, and move
    plan = kept.explain(*ARGS)
    assert plan.gathered == [] and plan.collectives, plan
    assert all(c.shape[0] == 8 for c in plan.collectives if "model" in c.axes), plan  # activations move
    one_device = ARGS[0]
    for w in ARGS[1]:
        one_device = np.tanh(np.einsum("bsd,df->bsf", one_device, w))
    np.testing.assert_allclose(kept(*ARGS), one_device, rtol=1e-5, atol=1e-5)


def test_a_stationary_axis_not_of_the_mesh_is_a_sharding_error():
    mesh = sf.make_mesh({"data": 2, "model": 4})
    with pytest.raises(sf.ShardingError, match=r"stationary=\('tensor',\).*\['tensor'\] not axes of the mesh"):
        sf.parallelize(sequence_parallel_layer, mesh=mesh, stationary=("tensor",), **SPECS)


def test_the_trainers_stationary_axes_are_its_tensor_parallel_ones():
    """The axes a strategy splits the heads and MLP over, and not the batch or the embedding."""
    rules = model_sharding.LOGICAL_AXIS_RULES
    axes = {name: model_sharding.tensor_parallel_axes(table) for name, table in rules.items()}
    assert axes["tp"] == axes["tp_sp"] == axes["2d"] == axes["ep_tp"] == ("model",)
    assert axes["dp"] == axes["fsdp"] == axes["ep"] == axes["ep_fsdp"] == axes["pp"] == ()


def test_the_trainer_keeps_tensor_parallel_weights_where_asked(data_dir):
    """``stationary_weights: true`` under tp: no weight of the Llama step is gathered over model."""
    from shardflow import train
    from shardflow.train import config

    cfg = config.load(
        None,
        [
            "model={preset: tiny, n_layers: 2}",
            "strategy=tp",
            "mesh={data: 2, model: 4}",
            "batch_size=8",
            f"data.path={data_dir}",
            "data.seq_len=64",
            "stationary_weights=true",
        ],
    )
    run = train.setup(cfg)
    tokens = np.zeros((1, 8, 64), np.int32)
    plan = run.train_step().explain(*jax.device_get(train.init_state(run)), {"inputs": tokens, "targets": tokens})
    assert plan.gathered == [], plan.gathered
    with pytest.raises(config.ConfigError, match="stationary_weights must be true or false, got 'sometimes'"):
        train.setup(config.load(None, ["model={preset: tiny}", "stationary_weights=sometimes"]))
