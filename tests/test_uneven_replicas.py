"""Uneven micro-batch counts per data replica (`replica_microbatches`): replica r runs its own
number of micro-batch slots, the rest padding of weight zero (skipped by its devices under
sf.predicated without a pipeline; the pipeline's own micro-batches with one), and the step's
loss and gradients equal the homogeneous step's over the same global batch."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_models import SMALL_LLAMA, small_config

from shardflow import train
from shardflow.train import config, run_setup, uneven


def test_slots_place_each_replicas_rows_and_weigh_the_padding_zero():
    index, weight = uneven.slots([3, 1], rows=2)
    assert index.shape == weight.shape == (3, 4)
    np.testing.assert_array_equal(weight, [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]])
    real = index[weight > 0]
    assert sorted(real) == list(range(8))  # every row of the global batch once
    np.testing.assert_array_equal(index[:, :2].ravel(), [0, 1, 2, 3, 4, 5])  # replica 0: rows 0-5
    np.testing.assert_array_equal(index[0, 2:], [6, 7])  # replica 1: rows 6-7, in its first slot


@pytest.mark.slow
def test_uneven_replicas_follow_the_homogeneous_loss(data_dir, tmp_path):
    """{data: 4, model: 2}, the replicas taking 3, 3, 1 and 1 micro-batches of 2 rows (16 rows a
    step): three steps' losses equal the homogeneous step's on the same 16 rows."""
    base = dict(strategy="tp", mesh={"data": 4, "model": 2}, compute_dtype="float32", batch_size=16)
    want = train.train(small_config(data_dir, tmp_path / "even", **base), progress=False)["losses"]
    cfg = small_config(data_dir, tmp_path / "uneven", **base, replica_microbatches=[3, 3, 1, 1])
    got = train.train(cfg, progress=False)["losses"]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)], rtol=1e-5)


def pipelined(data_dir, out, counts=None, schedule="1f1b", microbatches=None, layers_per_stage=None, **overrides):
    """A 4-layer Llama on {pipe: 2, data: 4}, 16 rows a step, fp32."""
    cfg = small_config(
        data_dir,
        out,
        strategy="dp",
        mesh={"pipe": 2, "data": 4},
        compute_dtype="float32",
        batch_size=16,
        replica_microbatches=counts,
        **overrides,
    )
    cfg.model = {**SMALL_LLAMA, "n_layers": 4}
    pl = cfg.pipeline
    pl.stages, pl.schedule, pl.microbatches, pl.layers_per_stage = 2, schedule, microbatches, layers_per_stage
    return cfg


def keep_gradients():
    """An optimizer whose state is the step's gradients and which moves nothing."""
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
    return optax.GradientTransformation(zeros, lambda grads, state, params=None: (zeros(grads), grads))


def first_step(cfg):
    """(loss, every gradient) of the config's first step, through the trainer's own Run, batch
    and train_step, its optimizer swapped for keep_gradients."""
    run = run_setup.setup(cfg)
    run = dataclasses.replace(run, optimizer=keep_gradients(), opt_specs=run.param_specs)
    params, opt_state = run_setup.init_state(run)
    _, grads, metrics = run.train_step()(params, opt_state, run.step_batch(run.data, 0))
    return float(metrics["loss"]), jax.device_get(grads)


_even_first_step = {}


def even_first_step(data_dir, tmp_path):
    if data_dir not in _even_first_step:
        _even_first_step[data_dir] = first_step(pipelined(data_dir, tmp_path / "even", microbatches=2))
    return _even_first_step[data_dir]


def assert_equal_steps(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got[1], want[1])


PIPELINED = {
    "1f1b-layers-3-1": dict(schedule="1f1b", layers_per_stage=[3, 1]),
    "gpipe": dict(schedule="gpipe"),
    "1f1b-fused-layers-1-3": dict(schedule="1f1b-fused", layers_per_stage=[1, 3]),
    "interleaved-4-slots": dict(schedule="interleaved", microbatches=4),
    "zb-h1": dict(schedule="zb-h1"),
    "zb-v": dict(schedule="zb-v"),
    "zb-fused-5-slots": dict(schedule="zb-fused", microbatches=5),
}


@pytest.mark.parametrize(
    "case",
    [pytest.param(name, marks=() if name == "1f1b-layers-3-1" else pytest.mark.slow) for name in PIPELINED],
)
def test_uneven_replicas_under_a_pipeline_give_the_homogeneous_gradients(case, data_dir, tmp_path):
    """{pipe: 2, data: 4}, replicas of 3, 3, 1 and 1 micro-batches of 2 rows as the pipeline's
    micro-batches (padded to 3 slots, or pipeline.microbatches): the first step's loss and
    every gradient equal the even pipelined step's (2 micro-batches of all 16 rows)."""
    got = first_step(pipelined(data_dir, tmp_path / "uneven", [3, 3, 1, 1], **PIPELINED[case]))
    assert_equal_steps(got, even_first_step(data_dir, tmp_path))


@pytest.mark.slow
def test_uneven_replicas_under_a_pipeline_train_on_the_homogeneous_curve(data_dir, tmp_path):
    """`shardflow train`'s loop, three AdamW steps with stages of 3 and 1 layers: the losses, the
    validation loss and the parameters after the last step equal the even run's."""
    runs = {
        name: train.train(
            pipelined(data_dir, tmp_path / name, counts, layers_per_stage=[3, 1], eval_every=3, eval_batches=1),
            progress=False,
        )
        for name, counts in (("even", None), ("uneven", [3, 3, 1, 1]))
    }
    got, want = runs["uneven"], runs["even"]
    np.testing.assert_allclose([got["losses"][s] for s in (1, 2, 3)], [want["losses"][s] for s in (1, 2, 3)], rtol=1e-5)
    val = {
        name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"] for name in runs
    }
    np.testing.assert_allclose(val["uneven"], val["even"], rtol=1e-5)
    # AdamW divides by each gradient's root mean square, so a near-zero gradient's rounding moves
    # its parameter by up to ~1e-7 (as much as the even run on 2 against 4 micro-batches differs)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        jax.device_get(got["params"]),
        jax.device_get(want["params"]),
    )


@pytest.mark.parametrize(
    "counts, message",
    [
        ([3, 3, 1], r"one count per data replica; the mesh's data axes make 4"),
        ([3, 3, 1, 0], r"a list of positive integers"),
        ([3, 3, 2, 1], r"batch_size 16 is not divisible by their sum 9"),
    ],
)
def test_bad_counts_are_one_config_error_naming_them(counts, message, data_dir, tmp_path):
    cfg = small_config(
        data_dir, tmp_path, strategy="tp", mesh={"data": 4, "model": 2}, batch_size=16, replica_microbatches=counts
    )
    with pytest.raises(config.ConfigError, match=rf"replica_microbatches \[.*\]: {message}"):
        config.validate(cfg, 8)


@pytest.mark.parametrize(
    "pipeline, message",
    [
        (
            dict(microbatches=2),
            r"each replica runs its micro-batches as the pipeline's, so pipeline.microbatches 2 must be at least "
            r"the largest count, 3",
        ),
        (
            dict(schedule="interleaved"),
            r"every replica runs 3 micro-batch slots .* which pipeline.schedule cannot: interleaved: .*multiple",
        ),
    ],
)
def test_slots_that_do_not_fit_the_pipeline_are_one_config_error(pipeline, message, data_dir, tmp_path):
    cfg = pipelined(data_dir, tmp_path, [3, 3, 1, 1], **pipeline)
    with pytest.raises(config.ConfigError, match=rf"replica_microbatches \[3, 3, 1, 1\]: {message}"):
        config.validate(cfg, 8)


def test_moe_models_are_refused(data_dir, tmp_path):
    cfg = pipelined(data_dir, tmp_path, [3, 3, 1, 1])
    cfg.model = {"preset": "moe-tiny", "n_layers": 4}
    with pytest.raises(config.ConfigError, match=r"replica_microbatches \[3, 3, 1, 1\]: an MoE model"):
        config.validate(cfg, 8)
