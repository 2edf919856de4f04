"""The models and `shardflow train` with pipeline parallelism (sf.pipeline over the stacked
layers): the pipelined loss and its gradients equal the plain loss's, on one device and under
sf.parallelize composed with data and tensor parallelism; the trainer under every schedule
follows the un-pipelined loss curve; a checkpoint restores across pipeline sizes."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_models import SMALL_GPT2, SMALL_LLAMA, single_device_losses, small_config

import shardflow as sf
from shardflow import models, train
from shardflow.models import PipelineConfig, sharding
from shardflow.train import cli


def model_and_batch(fields, batch=16, seq=16, **overrides):
    fields = {**fields, **overrides}
    cfg = models.preset(fields.pop("preset"), **fields)
    graphdef, params = nnx.split(models.build(cfg))
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size)
    return cfg, graphdef, nnx.to_pure_dict(params), tokens[:, :-1], tokens[:, 1:]


def value_and_grad(graphdef, pipeline):
    def loss(params, inputs, targets):
        return nnx.merge(graphdef, params).loss(inputs, targets, pipeline=pipeline)

    return jax.value_and_grad(loss)


def assert_close(got, want, rtol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-7), got[1], want[1])


LLAMA4 = {**SMALL_LLAMA, "n_layers": 4}
GPT2_4 = {**SMALL_GPT2, "n_layers": 4}


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields,overrides,pipeline",
    [
        (LLAMA4, {"tie_embeddings": True, "remat": "full"}, PipelineConfig(2, 4, "zb-v")),
        (GPT2_4, {}, PipelineConfig(2, 2, "interleaved")),
    ],
    ids=["llama-tied-remat-zbv", "gpt2-interleaved"],
)
def test_pipelined_loss_equals_the_plain_loss_on_one_device(fields, overrides, pipeline):
    """Outside parallelize sf.pipeline runs the micro-batches in turn: the same numbers."""
    _, graphdef, params, inputs, targets = model_and_batch(fields, **overrides)
    want = jax.jit(value_and_grad(graphdef, None))(params, inputs, targets)
    got = jax.jit(value_and_grad(graphdef, pipeline))(params, inputs, targets)
    assert_close(got, want)


PARALLELIZED = {
    "llama-pp4-dp2": (LLAMA4, {"pipe": 4, "data": 2}, "dp", "1f1b"),
    "llama-pp2-tp4": (LLAMA4, {"pipe": 2, "model": 4}, "pp_tp", "zb-h1"),
    "gpt2-pp2-dp2-tp2": (GPT2_4, {"pipe": 2, "data": 2, "model": 2}, "tp", "gpipe"),
    "llama-remat-dots-pp4-dp2-zbh1": ({**LLAMA4, "remat": "dots"}, {"pipe": 4, "data": 2}, "dp", "zb-h1"),
}


def parallelized(case, passes=None):
    """(the pipelined step under sf.parallelize, its arguments, the plain step's result on one
    device): the layers on the pipe axis (the "layers" rule), the rest of the table as it
    shards any model."""
    fields, mesh, strategy, schedule = PARALLELIZED[case]
    cfg, graphdef, params, inputs, targets = model_and_batch(fields)
    want = jax.jit(value_and_grad(graphdef, None))(params, inputs, targets)
    mesh = sf.make_mesh(mesh)
    rules = sharding.with_pipeline(models.get_rules(strategy))
    specs = models.param_specs(nnx.eval_shape(lambda: models.build(cfg)), rules, mesh)
    assert all(spec[0] == "pipe" for spec in jax.tree.leaves(specs["layers"], is_leaf=lambda x: isinstance(x, P)))
    batch = sharding.spec_for(("batch", None), rules)
    grad = value_and_grad(graphdef, PipelineConfig(mesh.shape["pipe"], 2 * mesh.shape["pipe"], schedule))

    def step(params, inputs, targets):
        with sharding.activation_sharding(rules, sf.constrain):
            return grad(params, inputs, targets)

    kwargs = {} if passes is None else {"passes": passes}
    return (
        sf.parallelize(step, mesh=mesh, in_specs=(specs, batch, batch), out_specs=(P(), specs), **kwargs),
        (params, inputs, targets),
        want,
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PARALLELIZED))
def test_pipelined_loss_under_parallelize_equals_one_device(case):
    """The schedule's loss and every gradient equal the plain loss's on one device."""
    step, args, want = parallelized(case)
    assert_close(step(*args), want)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama-pp4-dp2", "llama-pp2-tp4"])
def test_the_solver_lays_out_the_stages_with_the_step(case):
    """passes.solve solves the pipeline's bodies with the rest of the step (greedy lays them
    out from their operands): the step equals one device, and its plan is the model's optimum
    and cheaper than greedy's (pp2 x tp4: 307 us modelled against 1,337)."""
    step, args, want = parallelized(case, sf.passes.SOLVER)
    plan = step.explain(*args)
    assert plan.planner.startswith("solver (optimal") and "greedy" not in plan.planner, plan.planner
    assert plan.modelled_seconds < parallelized(case)[0].explain(*args).modelled_seconds
    assert_close(step(*args), want)


def test_with_pipeline_puts_the_layers_on_the_pipe_axis():
    assert models.spec_for(("layers", "embed", "mlp"), sharding.with_pipeline(models.LOGICAL_AXIS_RULES["2d"])) == P(
        "pipe", "data", "model"
    )
    assert models.LOGICAL_AXIS_RULES["pp_dp"] == sharding.with_pipeline(models.LOGICAL_AXIS_RULES["dp"])
    with pytest.raises(ValueError, match=r"put the stacked layers \('layers'\) on 'data'"):
        sharding.with_pipeline({"layers": "data"})


# ------------------------------------------------------------------------------ the trainer


def _argv(data_dir, out, *extra):
    model = ", ".join(f"{k}: {v}" for k, v in {**SMALL_LLAMA, "n_layers": 8}.items())
    return [
        "train",
        "--steps",
        "3",
        "--out",
        str(out),
        "--no-progress",
        "--set",
        f"data.path={data_dir}",
        "--set",
        "data.seq_len=32",
        "--set",
        f"model={{{model}}}",
        "--set",
        "batch_size=8",
        "--set",
        "log_every=1",
        "--set",
        "compute_dtype=float32",
        "--set",
        "checkpoint.every=0",
        "--set",
        "eval_every=0",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,uneven",
    [(name, None) for name in ("gpipe", "1f1b", "1f1b-fused", "interleaved", "zb-h1", "zb-v", "zb-fused")]
    + [("1f1b-fused", "[3, 2, 2, 1]")],
    ids=lambda x: x and x.replace(", ", "-"),
)
def test_cli_trains_under_each_schedule_on_the_unpipelined_curve(schedule, uneven, data_dir, tmp_path):
    """`shardflow train` with mesh {data: 2, pipe: 4}: the first steps' losses are those of
    the same steps without a pipeline (on one device); also with stages of 3, 2, 2 and 1 layers."""
    out = tmp_path / "run"
    extra = ["--set", f"pipeline.layers_per_stage={uneven}"] if uneven else []
    assert (
        cli.main(
            _argv(
                data_dir,
                out,
                "--set",
                "mesh={data: 2, pipe: 4}",
                "--set",
                "pipeline.stages=4",
                "--set",
                "pipeline.microbatches=4",
                "--set",
                f"pipeline.schedule={schedule}",
                *extra,
            )
        )
        == 0
    )
    got = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = small_config(data_dir, tmp_path)
    cfg.model = {**SMALL_LLAMA, "n_layers": 8}
    want = single_device_losses(cfg)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want[2] < want[0]


@pytest.mark.slow
def test_cli_trains_with_the_solver_planning_the_stages(data_dir, tmp_path):
    """`planner: solver` with a pipeline under tensor parallelism ({pipe: 2, model: 4}): the
    solver lays out the stages with the step, and the first steps' losses are one device's."""
    out = tmp_path / "run"
    assert (
        cli.main(
            _argv(
                data_dir,
                out,
                "--set",
                "mesh={pipe: 2, model: 4}",
                "--set",
                "strategy=pp_tp",
                "--set",
                "planner=solver",
                "--set",
                "pipeline.stages=2",
                "--set",
                "pipeline.microbatches=4",
                "--set",
                "pipeline.schedule=zb-h1",
            )
        )
        == 0
    )
    got = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = small_config(data_dir, tmp_path)
    cfg.model = {**SMALL_LLAMA, "n_layers": 8}
    np.testing.assert_allclose(got, single_device_losses(cfg), rtol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_restores_across_pipeline_sizes(data_dir, tmp_path):
    """Parameters keep their global [layers, ...] shapes, so a step saved with 4 stages (and
    fsdp: the mesh {data: 2, pipe: 4} runs with the pipe axis outermost) loads into 2 stages
    and into no pipeline at all."""

    def cfg(mesh, stages, strategy):
        c = small_config(data_dir, tmp_path, steps=1, mesh=mesh, strategy=strategy)
        c.model = {**SMALL_LLAMA, "n_layers": 4}
        c.checkpoint.every, c.pipeline.stages, c.pipeline.microbatches = 1, stages, stages
        return c

    saved = train.train(cfg({"data": 2, "pipe": 4}, 4, "fsdp"), progress=False)
    assert np.isfinite(saved["losses"][1])
    saved = jax.device_get(saved["params"])
    for mesh, stages, strategy, spec in [
        ({"data": 4, "pipe": 2}, 2, "dp", P("pipe", None, None, None)),
        ({"data": 8}, None, "fsdp", P(None, "data", None, None)),
    ]:
        result = train.train(cfg(mesh, stages, strategy), progress=False)
        assert result["start_step"] == 1 and result["losses"] == {}
        assert result["params"]["layers"]["attn"]["wq"].sharding.spec == spec
        jax.tree.map(np.testing.assert_array_equal, saved, jax.device_get(result["params"]))


def test_an_uneven_split_reaches_sf_pipeline(data_dir, tmp_path):
    """pipeline.layers_per_stage goes from the config to the model's PipelineConfig and on to
    sf.pipeline (which checks it: a split of the wrong sum is refused there)."""
    cfg = small_config(data_dir, tmp_path, mesh={"data": 2, "pipe": 4})
    cfg.pipeline.stages, cfg.pipeline.layers_per_stage = 4, [3, 2, 2, 1]
    assert train.config.pipeline_config(cfg).layers_per_stage == (3, 2, 2, 1)
    _, graphdef, params, inputs, targets = model_and_batch(LLAMA4)
    with pytest.raises(ValueError, match=r"layers_per_stage \[3, 2, 2, 1\] must be 4 counts"):
        value_and_grad(graphdef, PipelineConfig(4, 4, "1f1b", layers_per_stage=(3, 2, 2, 1)))(params, inputs, targets)
