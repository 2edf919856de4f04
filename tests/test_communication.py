"""Optimal communication: explain's bytes equal the analytical optimum of each strategy, and
the compiled HLO runs those collectives (bytes within 1 %)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import programs as pg
import pytest
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow import hlo

# the user's line, with the library line that made the value beside it when a library did
USER_LINE = r"[\w.]+\.py:\d+( \([\w./]+\.py:\d+\))?"


def nbytes(tree):
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def hlo_bytes(f, *args):
    return hlo.total_bytes(f.lower(*args).compile().as_text())


def check(f, *args):
    """The plan, after checking it against the compiled HLO."""
    plan = f.explain(*args)
    static = sum(c.bytes for c in plan.collectives)  # per occurrence, as HLO lists them
    assert hlo_bytes(f, *args) == pytest.approx(static, rel=0.01)
    assert not plan.fallbacks
    return plan


def tensor_collectives(plan):
    return [c for c in plan.collectives if c.shape]


def scalar_bytes(plan):
    return sum(c.bytes * c.count for c in plan.collectives if not c.shape)


def ring(n):
    return (n - 1) / n


def llama_step_plan(strategy, shape):
    """(plan checked against HLO, params, device count) of the Llama train step."""
    mesh = sf.make_mesh(shape)
    step, args, in_specs, out_specs = pg.case_llama_step(strategy, mesh)
    plan = check(sf.parallelize(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs), *args)
    return plan, args[0], math.prod(shape.values())


# ------------------------------------------------------------------------------ data parallel


@pytest.mark.slow
@pytest.mark.parametrize("shape", [{"data": 8}, {"data": 2, "model": 4}])
def test_dp_gradient_all_reduce(shape):
    plan, params, n = llama_step_plan("dp", shape)
    tensors = tensor_collectives(plan)
    assert {c.kind for c in tensors} == {"all_reduce"}
    assert sum(c.bytes for c in tensors) == pytest.approx(2 * ring(n) * nbytes(params), abs=len(tensors))
    assert len(tensors) == len(jax.tree.leaves(params))  # each gradient reduced once
    assert scalar_bytes(plan) <= 2 * 2 * ring(n) * 4  # the loss, at most one more scalar


@pytest.mark.slow
@pytest.mark.parametrize("shape", [{"data": 8}, {"data": 4, "model": 2}])
def test_fsdp_gathers_params_and_scatters_grads(shape):
    plan, params, n = llama_step_plan("fsdp", shape)
    by_kind = {}
    for c in tensor_collectives(plan):
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.bytes
    assert set(by_kind) == {"all_gather", "reduce_scatter"}
    p = nbytes(params)
    assert by_kind["all_gather"] == pytest.approx(ring(n) * p, abs=16)
    assert by_kind["reduce_scatter"] == pytest.approx(ring(n) * p, abs=16)


# ------------------------------------------------------------------------------ Megatron

MEGATRON = pg.Cfg(batch=2, seq=8, dim=64, heads=8, kv_heads=4, ffn=256)  # weights >> activations


def megatron_mesh():
    return sf.make_mesh({"data": 2, "model": 4})


def test_tp_mlp_one_all_reduce_per_block():
    mesh, cfg = megatron_mesh(), MEGATRON
    params = pg.layer_params(cfg, pg.rng(0))
    params = {k: params[k] for k in ("w1", "w2", "w3")}
    x = pg.rng(1).standard_normal((cfg.batch, cfg.seq, cfg.dim)).astype(np.float32)
    f = sf.parallelize(
        lambda p, x: x + pg.swiglu(x, p),
        mesh=mesh,
        in_specs=(pg.param_specs(params, "2d", mesh), PS("data")),
        out_specs=PS("data"),
    )
    plan = check(f, params, x)
    (c,) = plan.collectives
    assert (c.kind, c.axes) == ("all_reduce", ("model",))
    assert c.bytes == 2 * ring(4) * x.nbytes / 2  # the block output, per data shard
    np.testing.assert_allclose(np.asarray(f(params, x)), x + pg.swiglu(x, params), rtol=1e-5, atol=1e-5)


def test_tp_attention_one_all_reduce_per_block():
    mesh, cfg = megatron_mesh(), MEGATRON
    params = pg.layer_params(cfg, pg.rng(0))
    params = {k: params[k] for k in ("wq", "wk", "wv", "wo")}
    x = pg.rng(1).standard_normal((cfg.batch, cfg.seq, cfg.dim)).astype(np.float32)
    fn = lambda p, x: x + pg.gqa_attention(x, p, cfg)
    f = sf.parallelize(fn, mesh=mesh, in_specs=(pg.param_specs(params, "2d", mesh), PS("data")), out_specs=PS("data"))
    plan = check(f, params, x)
    (c,) = plan.collectives
    assert (c.kind, c.axes) == ("all_reduce", ("model",))
    assert c.bytes == 2 * ring(4) * x.nbytes / 2
    np.testing.assert_allclose(np.asarray(f(params, x)), fn(params, x), rtol=1e-5, atol=1e-5)


def test_sequence_parallel_gathers_and_scatters_without_all_reduce():
    mesh, cfg = megatron_mesh(), MEGATRON
    params = pg.layer_params(cfg, pg.rng(0))
    x = pg.rng(1).standard_normal((cfg.batch, cfg.seq, cfg.dim)).astype(np.float32)
    pin = pg.pin_for("sp", mesh)
    fn = lambda p, x: pg.decoder_layer(pin(x), p, cfg, pin)
    act = pg.activation_spec("sp", mesh)
    f = sf.parallelize(fn, mesh=mesh, in_specs=(pg.param_specs(params, "sp", mesh), act), out_specs=act)
    plan = check(f, params, x)
    kinds = sorted(c.kind for c in plan.collectives)
    assert kinds == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
    assert all(c.axes == ("model",) for c in plan.collectives)
    assert plan.total_bytes == pytest.approx(4 * ring(4) * x.nbytes / 2)  # x per data shard, 4 times
    np.testing.assert_allclose(np.asarray(f(params, x)), fn(params, x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ vocab parallel

VOCAB = pg.Cfg(batch=2, seq=8, dim=32, vocab=4096)


def test_vocab_parallel_cross_entropy_never_gathers_logits():
    mesh, cfg = megatron_mesh(), VOCAB
    r = pg.rng(0)
    x = r.standard_normal((cfg.batch, cfg.seq, cfg.dim)).astype(np.float32)
    w = (r.standard_normal((cfg.dim, cfg.vocab)) / 6).astype(np.float32)
    targets = r.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
    fn = lambda x, w, t: pg.cross_entropy(x @ w, t)
    f = sf.parallelize(fn, mesh=mesh, in_specs=(PS("data"), PS(None, "model"), PS("data")), out_specs=PS())
    plan = check(f, x, w, targets)
    logits_shape = (cfg.batch, cfg.seq, cfg.vocab)
    assert all(c.shape != logits_shape for c in plan.collectives)
    tokens_per_shard = cfg.batch * cfg.seq // 2
    # at most: the row max, the row sum of exp and the picked logit all-reduced (one float per
    # token each), then the mean; the planner may do better by splitting the row statistics
    assert plan.total_bytes <= 3 * 2 * ring(4) * tokens_per_shard * 4 + 8
    np.testing.assert_allclose(float(f(x, w, targets)), float(fn(x, w, targets)), rtol=1e-5)


def test_vocab_sharded_embedding_never_gathers_the_table():
    mesh, cfg = megatron_mesh(), VOCAB
    r = pg.rng(0)
    table = r.standard_normal((cfg.vocab, cfg.dim)).astype(np.float32)
    toks = r.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
    fn = lambda table, toks: jnp.tanh(table[toks])
    f = sf.parallelize(fn, mesh=mesh, in_specs=(PS("model", None), PS("data")), out_specs=PS("data"))
    plan = check(f, table, toks)
    (c,) = plan.collectives
    assert (c.kind, c.axes) == ("all_reduce", ("model",))
    assert c.bytes == 2 * ring(4) * cfg.batch * cfg.seq * cfg.dim * 4 / 2
    np.testing.assert_allclose(np.asarray(f(table, toks)), fn(table, toks), rtol=1e-6)


def test_explain_names_the_user_line_for_every_collective():
    mesh = sf.make_mesh({"data": 8})
    step, args, in_specs, out_specs = pg.case_llama_step("dp", mesh)
    plan = sf.parallelize(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs).explain(*args)
    assert plan.collectives
    for c in plan.collectives:  # made by the user's code; used there or in a library (optax)
        assert c.source.startswith("programs.py:") or c.source.startswith("args["), c
        assert c.used_at == "output" or re.fullmatch(USER_LINE, c.used_at), c
    assert "programs.py:" in str(plan)


def test_a_partial_sum_is_reduced_before_a_widening_cast():
    """A bf16 matmul's partial sum cast to f32 is reduced in bf16 (half the bytes of f32), as
    Megatron and GSPMD reduce it (RMSNorm's backward in the Llama step under tp was
    reduce-scattered in f32)."""
    mesh = sf.make_mesh({"data": 2, "model": 4})
    r = np.random.default_rng(0)
    x, w = (jnp.asarray(r.standard_normal(s), jnp.bfloat16) for s in ((16, 64), (64, 32)))

    def fn(x, w):
        y = (x @ w).astype(jnp.float32)
        return jnp.sum(y * y, -1)

    step = sf.parallelize(fn, mesh=mesh, in_specs=(PS("data", "model"), PS("model")), out_specs=PS("data"))
    plan = step.explain(x, w)
    reduced = [c for c in plan.collectives if c.shape == (16, 32)]
    assert reduced and all(c.dtype == "bfloat16" for c in reduced), str(plan)
    np.testing.assert_allclose(np.asarray(step(x, w)), np.asarray(jax.jit(fn)(x, w)), rtol=2e-2)


def test_a_partial_sum_is_reduced_before_a_narrowing_cast():
    """An f32 matmul's partial sum cast to bf16 is reduced in f32, as the program sums it:
    parts rounded to bf16 before the sum were 20 % off one device where they cancel."""
    mesh = sf.make_mesh({"data": 2, "model": 4})
    r = np.random.default_rng(0)
    x, w = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((16, 64), (64, 32)))

    def fn(x, w):
        return jnp.tanh((x @ w).astype(jnp.bfloat16))

    step = sf.parallelize(fn, mesh=mesh, in_specs=(PS("data", "model"), PS("model")), out_specs=PS("data"))
    (c,) = step.explain(x, w).collectives
    assert c.kind == "all_reduce" and c.dtype == "float32", c
    np.testing.assert_allclose(np.asarray(step(x, w), np.float32), np.asarray(jax.jit(fn)(x, w), np.float32), atol=4e-3)


@pytest.mark.parametrize("spec,share", [(PS("data"), 2), (PS(None, "model"), 4), (PS("data", "model"), 8), (PS(), 1)])
def test_explain_counts_each_devices_matmul_flops(spec, share):
    """Plan.flops: a matmul's 2·m·k·n over the devices that divide it (a scan's body per trip),
    and the elementwise work none."""
    mesh = sf.make_mesh({"data": 2, "model": 4})

    def fn(x, w):
        y, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)
        return y

    x, w = jnp.ones((16, 32)), jnp.ones((32, 32))
    plan = sf.parallelize(fn, mesh=mesh, in_specs=(spec, PS()), out_specs=spec).explain(x, w)
    assert plan.flops == 3 * 2 * 16 * 32 * 32 / share
    assert f"{plan.flops:,.0f} flops" in str(plan)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,mesh", [("dp", {"data": 8}), ("tp_sp", {"data": 2, "model": 4})])
def test_explain_names_a_user_line_inside_library_code_too(strategy, mesh):
    """The shipped model's train step: JAX's own bodies (the transposed gather of the embedding,
    jnp helpers) carry no user frame; their collectives are named by the user's call."""
    from shardflow import train
    from shardflow.train import config

    cfg = config.Config()
    cfg.model = {"preset": "tiny", "n_layers": 2}
    cfg.strategy, cfg.mesh, cfg.batch_size, cfg.data.seq_len = strategy, mesh, 8, 64
    run = train.setup(cfg)
    params, opt_state = train.init_state(run)
    step = run.train_step()
    tokens = np.zeros((1, 8, 64), np.int32)
    plan = step.explain(params, opt_state, {"inputs": tokens, "targets": tokens})
    assert plan.collectives
    for c in plan.collectives:
        assert re.fullmatch(USER_LINE + r"|args\[.*|loop/branch input", c.source), c
        assert c.used_at == "output" or re.fullmatch(USER_LINE, c.used_at), c
    assert any(c.source.startswith("llama.py:") for c in plan.collectives)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_with_no_batch_dims_saveable])
def test_remat_bodies_are_partitioned_not_run_whole(policy):
    """jax.checkpoint (its primitive is remat2 in jax 0.10, printed "checkpoint") runs on the
    operands' shardings: data-parallel gradients stay one all-reduce of the weights."""
    mesh = sf.make_mesh({"data": 8})
    layer = jax.checkpoint(lambda w, x: jnp.tanh(x @ w) @ w.T, policy=policy)
    f = lambda w, x: jax.grad(lambda w: jnp.sum(layer(w, x) ** 2))(w)
    w = jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)) / 4, jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 16)), jnp.float32)
    g = sf.parallelize(f, mesh=mesh, in_specs=(PS(), PS("data")), out_specs=PS())
    plan = check(g, w, x)
    [c] = plan.collectives
    assert (c.kind, c.bytes) == ("all_reduce", 2 * ring(8) * w.size * 4)
    np.testing.assert_allclose(np.asarray(g(w, x)), np.asarray(f(w, x)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_reduces_once_after_the_loop():
    """A scan over micro-batches carries partial gradients (the carry's fixed point is P) and
    all-reduces them once, not once per micro-batch."""
    mesh, cfg = sf.make_mesh({"data": 8}), pg.Cfg()
    params = pg.llama_params(cfg)
    toks, tgts = (np.stack([t] * 4) for t in pg.tokens(cfg))

    def accumulate(params, toks, tgts):
        def body(g, mb):
            loss, gi = jax.value_and_grad(pg.llama_loss)(params, mb[0], mb[1], cfg)
            return jax.tree.map(jnp.add, g, gi), loss

        g, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (toks, tgts))
        return g, losses.mean()

    ps = pg.param_specs(params, "dp", mesh)
    f = sf.parallelize(accumulate, mesh=mesh, in_specs=(ps, PS(None, "data"), PS(None, "data")), out_specs=(ps, PS()))
    plan = check(f, params, toks, tgts)
    tensors = tensor_collectives(plan)
    assert all(c.count == 1 and c.kind == "all_reduce" for c in tensors)
    assert sum(c.bytes for c in tensors) == pytest.approx(2 * ring(8) * nbytes(params), abs=len(tensors))
    expected = jax.jit(accumulate)(params, toks, tgts)
    for a, e in zip(jax.tree.leaves(f(params, toks, tgts)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ combined all-reduces


def _all_reduces(f, *args) -> int:
    return sum(c.kind == "all_reduce" for c in hlo.collectives(f.lower(*args).compile().as_text()))


def test_independent_all_reduces_are_priced_as_the_one_collective_xla_runs():
    """A data-parallel step's gradient all-reduces depend on none of each other: XLA's
    all-reduce combiner runs them as one collective, and explain prices them so, one latency
    for them all (the rest marked ``combined``), each still with its own bytes."""
    links = sf.LinkModel()

    def step(params, x):
        def loss(params):
            h = x
            for w in params:
                h = jnp.tanh(h @ w)
            return jnp.sum(h**2)

        return jax.grad(loss)(params)

    r = np.random.default_rng(0)
    params = [r.standard_normal((16, 16)).astype(np.float32) / 4 for _ in range(4)]
    x = r.standard_normal((32, 16)).astype(np.float32)
    specs = [PS()] * 4
    f = sf.parallelize(step, mesh=sf.make_mesh({"data": 8}), in_specs=(specs, PS("data")), out_specs=specs)
    plan = check(f, params, x)
    assert [c.kind for c in plan.collectives] == ["all_reduce"] * 4
    assert [c.combined for c in plan.collectives] == [False, True, True, True]
    assert plan.total_seconds == pytest.approx(links.alpha + plan.total_bytes / links.beta)
    assert _all_reduces(f, params, x) == 1
    assert "3 of them run with others" in str(plan)
    for a, e in zip(f(params, x), jax.jit(step)(params, x)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)


def test_an_all_reduce_of_a_value_made_from_another_pays_its_own_latency():
    """Two row-parallel matmuls in a row, the first's result pinned whole: the second
    all-reduce's operand is made from the first's result, so no combiner can merge them; each
    pays its latency."""

    def fn(x, w1, w2):
        return jnp.tanh(sf.constrain(x @ w1, PS())) @ w2

    r = np.random.default_rng(0)
    args = [r.standard_normal(s).astype(np.float32) / 4 for s in ((4, 16), (16, 16), (16, 64))]
    f = sf.parallelize(
        fn, mesh=sf.make_mesh({"model": 8}), in_specs=(PS(None, "model"), PS("model"), PS("model")), out_specs=PS()
    )
    plan = check(f, *args)
    reduced = [c for c in plan.collectives if c.kind == "all_reduce"]
    assert len(reduced) == 2 and not any(c.combined for c in reduced), str(plan)
    assert _all_reduces(f, *args) == 2
