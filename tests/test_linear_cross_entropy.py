"""`linear_cross_entropy`: the fused, vocab-tiled linear + cross-entropy equals the plain loss
(logits materialised) on one device and sharded, lays out vocab-parallel without moving logits
or w, and holds no [tokens, vocab] buffer."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fast_tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as PS
from test_communication import check

import shardflow as sf
from shardflow.cross_entropy import linear_cross_entropy

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def plain_cross_entropy(h, w, targets):
    logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def problem(tokens: tuple, d: int, vocab: int, seed: int = 0):
    r = np.random.default_rng(seed)
    h = r.standard_normal((*tokens, d)).astype(np.float32)
    w = (r.standard_normal((d, vocab)) / np.sqrt(d)).astype(np.float32)
    return h, w, r.integers(0, vocab, tokens).astype(np.int32)


def loss_and_grads(cross_entropy, h, w, targets):
    """Each token's loss and the gradients of a weighted sum of them (every cotangent distinct)."""
    g = jnp.linspace(0.5, 1.5, targets.size).reshape(targets.shape)
    per_token = cross_entropy(h, w, targets)
    grads = jax.grad(lambda h, w: jnp.sum(g * cross_entropy(h, w, targets)), (0, 1))(h, w)
    return per_token, *grads


def assert_equal_to_plain(h, w, targets, chunk):
    fused = jax.jit(lambda h, w, t: loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk=chunk), h, w, t))
    plain = jax.jit(lambda h, w, t: loss_and_grads(plain_cross_entropy, h, w, t))
    for ours, theirs in zip(fused(h, w, targets), plain(h, w, targets)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), **TOLERANCE)


@pytest.mark.parametrize("vocab, chunk", [(512, 128), (512, 512), (500, 128), (500, 7), (500, 1000), (3, 1)])
def test_equals_the_plain_loss_and_gradients(vocab, chunk):
    """Vocab a multiple of the tile, not (the last tile shifted back, its repeated columns
    masked), one tile wider than the vocab, one column a tile."""
    assert_equal_to_plain(*problem((4, 16), 32, vocab), chunk)


@settings(max_examples=examples(40), deadline=None)
@given(
    tokens=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    d=st.integers(1, 24),
    vocab=st.integers(1, 80),
    chunk=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_equals_the_plain_loss_at_any_shape(tokens, d, vocab, chunk, seed):
    assert_equal_to_plain(*problem(tokens, d, vocab, seed), chunk)


def test_a_target_outside_the_vocab_counts_the_log_sum_exp_alone():
    h, w, targets = problem((2, 8), 16, 40)
    targets[0, :3] = (-1, 40, -100)
    lse = jax.nn.logsumexp(h @ w, axis=-1)
    np.testing.assert_allclose(linear_cross_entropy(h, w, targets, chunk=16)[0, :3], lse[0, :3], **TOLERANCE)


def test_shapes_are_checked():
    h, w, targets = problem((2, 8), 16, 40)
    with pytest.raises(ValueError, match="want h"):
        linear_cross_entropy(h, w.T, targets)
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(h, w, targets, chunk=0)


# --- sharded: w [64, 32768] (8 MiB) is worth more than the per-token statistics that replace it
SHARDED = ((8, 8), 64, 32768)


def _mean_loss(h, w, targets):
    return jnp.mean(linear_cross_entropy(h, w, targets, chunk=4096))


def _step(h, w, targets):
    return jax.value_and_grad(_mean_loss, (0, 1))(h, w, targets)


@pytest.mark.parametrize("planner", ["greedy", "solver"])
@pytest.mark.parametrize(
    "axes, w_spec", [({"data": 8}, PS()), ({"data": 2, "model": 4}, PS(None, "model"))], ids=["dp", "vocab-tp"]
)
def test_sharded_equals_one_device(axes, w_spec, planner):
    h, w, targets = problem(*SHARDED)
    passes = sf.passes.SOLVER if planner == "solver" else None
    step = sf.parallelize(
        _step,
        mesh=sf.make_mesh(axes),
        in_specs=(PS("data"), w_spec, PS("data")),
        out_specs=(PS(), (PS("data"), w_spec)),
        passes=passes,
    )
    for ours, theirs in zip(jax.tree.leaves(step(h, w, targets)), jax.tree.leaves(jax.jit(_step)(h, w, targets))):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), **TOLERANCE)
    if "model" not in axes:
        return
    plan = check(step, h, w, targets)
    d, vocab = w.shape
    # over "data" the gradients' data-parallel reduction: dw's [d, vocab] partial sums
    assert not [c for c in plan.collectives if c.kind == "all_gather" or c.shape == (*h.shape[:2], vocab)], str(plan)
    over_vocab = [c for c in plan.collectives if c.axes == ("model",)]
    local_tokens, ring = h.shape[0] // 2 * h.shape[1], 3 / 4
    # the statistics (a max, then the rescaled sum and the target logit: 4-byte floats per
    # token) and h's gradient, a partial sum over the vocab shards (as Megatron's)
    expected = [
        ("all_reduce", (local_tokens,), 2 * ring * local_tokens * 4),
        ("all_reduce", (2, local_tokens), 2 * ring * 2 * local_tokens * 4),
        ("all_reduce", h.shape, 2 * ring * local_tokens * d * 4),
    ]
    assert sorted((c.kind, c.shape, c.bytes) for c in over_vocab) == sorted(expected), str(plan)
    assert all("sf_linear_ce_fwd combines" in c.reason for c in over_vocab if c.shape != h.shape)


@pytest.mark.parametrize("planner", ["greedy", "solver"])
def test_vocab_parallel_loss_moves_only_the_statistics(planner):
    h, w, targets = problem(*SHARDED)
    loss = sf.parallelize(
        _mean_loss,
        mesh=sf.make_mesh({"data": 2, "model": 4}),
        in_specs=(PS("data"), PS(None, "model"), PS("data")),
        out_specs=PS(),
        passes=sf.passes.SOLVER if planner == "solver" else None,
    )
    plan = check(loss, h, w, targets)
    statistics = [(c.kind, c.axes, c.shape) for c in plan.collectives if c.axes == ("model",)]
    assert statistics == [("all_reduce", ("model",), (32,)), ("all_reduce", ("model",), (2, 32))], str(plan)
    assert all(c.shape == () for c in plan.collectives if c.axes != ("model",)), str(plan)  # the mean
    np.testing.assert_allclose(float(loss(h, w, targets)), float(_mean_loss(h, w, targets)), **TOLERANCE)


# --- memory: XLA's temporaries of the loss and its gradients
def temp_bytes(mean_loss, tokens: int, d: int, vocab: int) -> int:
    args = (
        jax.ShapeDtypeStruct((tokens, d), jnp.float32),
        jax.ShapeDtypeStruct((d, vocab), jnp.float32),
        jax.ShapeDtypeStruct((tokens,), jnp.int32),
    )
    step = jax.jit(jax.value_and_grad(mean_loss, (0, 1))).lower(*args).compile()
    return step.memory_analysis().temp_size_in_bytes


def test_temporaries_grow_with_the_tile_not_the_vocab():
    """At 1024 tokens, d 64 and tiles of 1024 columns (measured on CPU: 8.4 MB of temporaries at
    vocab 8k and at 32k, where materialised logits take 67 MB and 268 MB)."""
    tokens, d, chunk = 1024, 64, 1024

    def fused(h, w, t):
        return jnp.mean(linear_cross_entropy(h, w, t, chunk=chunk))

    def plain(h, w, t):
        return jnp.mean(plain_cross_entropy(h, w, t))

    small, large = (temp_bytes(fused, tokens, d, vocab) for vocab in (8192, 32768))
    w_and_dw_growth = 2 * d * (32768 - 8192) * 4
    assert abs(large - small) < w_and_dw_growth + (1 << 20), (small, large)
    assert large < 3 * tokens * chunk * 4 + (1 << 20), large  # a few [tokens, tile] float32 tiles
    assert large < temp_bytes(plain, tokens, d, 32768) / 10


# --- the whole train step: `shardflow train`'s loss curve with the plain, materialised loss
def train_losses(data_dir, out, strategy: str, mesh: str) -> list:
    from test_models import ENGINE

    from shardflow.train import cli

    overrides = {
        "data.path": data_dir,
        "engine": ENGINE,
        "model": "{preset: tiny, d_model: 64, n_layers: 1, head_dim: 8}",
        "batch_size": 8,
        "data.seq_len": 32,
        "log_every": 1,
        "compute_dtype": "float32",
        "strategy": strategy,
        "mesh": mesh,
    }
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    assert cli.main(["train", "--steps", "3", "--out", str(out), "--no-progress", *sets]) == 0
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, mesh", [("dp", "{data: 8}"), ("tp", "{data: 2, model: 4}")])
def test_train_loss_curve_equals_the_plain_loss(data_dir, tmp_path, monkeypatch, strategy, mesh):
    """The tiny preset's 256-entry vocab in tiles of 96 (the last shifted back) against logits
    materialised and optax's cross-entropy."""
    from shardflow.models import pipeline

    monkeypatch.setattr(pipeline, "linear_cross_entropy", functools.partial(linear_cross_entropy, chunk=96))
    fused = train_losses(data_dir, tmp_path / "fused", strategy, mesh)
    monkeypatch.setattr(pipeline, "linear_cross_entropy", plain_cross_entropy)
    plain = train_losses(data_dir, tmp_path / "plain", strategy, mesh)
    assert len(fused) == 3
    np.testing.assert_allclose(fused, plain, rtol=1e-5)
