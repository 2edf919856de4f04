"""Models: annotations → specs, and every strategy preset computing the single-device loss."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardflow import models, train
from shardflow.models import sharding
from shardflow.train import config

ENGINE = "shardflow"  # the default engine; test_strategy_matches_single_device covers jit too

SMALL_LLAMA = dict(
    preset="tiny", d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, ffn_dim=128, max_seq_len=32
)
SMALL_GPT2 = dict(
    preset="gpt2-tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=128, max_seq_len=32
)


def small_config(data_dir, out, **overrides):
    cfg = config.Config()
    cfg.model = dict(SMALL_LLAMA)
    cfg.data.path, cfg.data.seq_len = str(data_dir), 32
    cfg.batch_size, cfg.steps, cfg.log_every = 8, 3, 1
    cfg.compute_dtype, cfg.engine, cfg.out = "float32", ENGINE, str(out)
    cfg.checkpoint.every, cfg.eval_every = 0, 0
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


_single_device_cache: dict = {}


def single_device_losses(cfg, pipelined=False):
    """The same steps with no mesh at all: everything on device 0, one batch of all rows; where
    ``pipelined``, through the configured pipeline's micro-batches in turn."""
    key = (json.dumps(cfg.model, sort_keys=True), cfg.data.path, cfg.batch_size, cfg.steps, pipelined)
    if key not in _single_device_cache:
        _single_device_cache[key] = _single_device_losses(cfg, pipelined)
    return _single_device_cache[key]


def _single_device_losses(cfg, pipelined):
    run = train.setup(cfg)
    params, opt_state = jax.device_get(train.init_state(run))
    pipeline = run.pipeline if pipelined else None
    step_fn = jax.jit(train.make_train_step(run.graphdef, run.optimizer, jnp.float32, 1, pipeline))
    losses = []
    for step in range(cfg.steps):
        windows = run.data.windows(
            run.data.window_starts(step, (1, cfg.batch_size), cfg.data.seq_len, cfg.data.seed), cfg.data.seq_len
        )
        batch = {"inputs": windows[..., :-1], "targets": windows[..., 1:]}
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return losses


def test_decorator_and_flax_metadata_both_name_axes():
    llama_axes, missing = models.param_logical_axes(
        nnx.eval_shape(
            lambda: models.build(models.ModelConfig(**{k: v for k, v in SMALL_LLAMA.items() if k != "preset"}))
        )
    )
    assert missing == []
    assert llama_axes["layers"]["attn"]["wk"] == ("layers", "embed", "kv_heads", "head_dim")
    assert llama_axes["embedding"] == ("vocab", "embed")
    gpt2_axes, missing = models.param_logical_axes(nnx.eval_shape(lambda: models.build(models.preset("gpt2-tiny"))))
    assert missing == []
    assert gpt2_axes["layers"]["fc"]["kernel"] == ("layers", "embed", "mlp")  # with_partitioning
    assert gpt2_axes["wte"]["embedding"] == ("vocab", "embed")


def test_decorator_paths_reach_into_submodules_and_unannotated_params_are_reported():
    @models.logical_axes(**{"proj.kernel": ("embed", "mlp")})
    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.proj = nnx.Linear(4, 8, rngs=rngs)

    axes, missing = models.param_logical_axes(Outer(nnx.Rngs(0)))
    assert axes["proj"]["kernel"] == ("embed", "mlp")
    assert missing == ["proj/bias"]
    assert axes["proj"]["bias"] == (None,)


def test_rules_map_logical_axes_to_mesh_axes():
    assert models.spec_for(("layers", "embed", "mlp"), models.LOGICAL_AXIS_RULES["2d"]) == P(None, "data", "model")
    # one mesh axis splits at most one dimension of a tensor
    assert models.spec_for(("batch", "embed"), models.LOGICAL_AXIS_RULES["fsdp"]) == P("data", None)
    assert models.spec_for(("batch", "seq", None), models.LOGICAL_AXIS_RULES["tp_sp"]) == P("data", "model", None)
    with pytest.raises(ValueError, match="names mesh axis 'model'"):
        models.check_rules(models.LOGICAL_AXIS_RULES["tp"], ["data"])


def test_constrain_is_identity_without_active_rules():
    x = jnp.ones((2, 4, 8))
    assert models.constrain(x, ("batch", "seq", None)) is x
    pinned = []
    with sharding.activation_sharding(models.LOGICAL_AXIS_RULES["tp_sp"], lambda x, s: pinned.append(s) or x):
        models.constrain(x, ("batch", "seq", None))
    assert pinned == [P("data", "model", None)]


def test_the_compute_copy_keeps_the_llama_norm_scales_in_float32():
    """models.for_compute casts every parameter to the compute dtype but those made with
    keep_dtype (the norms' scales, used in float32), so their gradients are not rounded to
    bfloat16 in each layer."""
    model = models.build(models.preset("tiny"))
    graphdef, state = nnx.split(model)
    copy = models.for_compute(graphdef, nnx.to_pure_dict(state), jnp.bfloat16)
    dtypes = {
        "/".join(map(str, path)): var.value.dtype for path, var in nnx.iter_graph(copy) if isinstance(var, nnx.Variable)
    }
    norms = {path for path in dtypes if path.endswith("norm/scale")}
    assert norms == {"layers/attn_norm/scale", "layers/mlp_norm/scale", "final_norm/scale"}, norms
    assert {dtypes[p] for p in norms} == {np.dtype(jnp.float32)}
    assert {dtypes[p] for p in dtypes if p not in norms} == {np.dtype(jnp.bfloat16)}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
def test_train_step_matmuls_run_in_compute_dtype(preset, compute_dtype):
    """Every matmul of the step (forward and backward) takes and gives compute_dtype: the
    models compute in the dtype of the parameters the trainer hands them."""
    from jax.extend.core import ClosedJaxpr

    cfg = config.Config()
    cfg.model = {"preset": preset, "n_layers": 2}
    cfg.batch_size, cfg.data.seq_len, cfg.compute_dtype = 8, 32, compute_dtype
    run = train.setup(cfg)
    params, opt_state = train.init_state(run)
    step = train.make_train_step(run.graphdef, run.optimizer, compute_dtype, 1)
    tokens = np.zeros((1, 8, 32), np.int32)
    jaxpr = jax.make_jaxpr(step)(params, opt_state, {"inputs": tokens, "targets": tokens})

    def dots(j):
        for e in j.eqns:
            if e.primitive.name == "dot_general":
                yield tuple(str(v.aval.dtype) for v in (*e.invars, *e.outvars))
            for value in e.params.values():
                for sub in value if isinstance(value, tuple) else (value,):
                    if isinstance(sub, ClosedJaxpr):
                        yield from dots(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        yield from dots(sub)

    found = list(dots(jaxpr.jaxpr))
    assert found and set(found) == {(compute_dtype,) * 3}, set(found)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_forward_shapes_and_remat_agree(model):
    fields = {k: v for k, v in (SMALL_LLAMA if model == "llama" else SMALL_GPT2).items() if k != "preset"}
    fields["family"] = model
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    plain = models.build(models.ModelConfig(**fields))
    remat = models.build(models.ModelConfig(**fields, remat="full"))
    logits = plain(tokens)
    assert logits.shape == (2, 16, 256)
    np.testing.assert_allclose(remat(tokens), logits, rtol=1e-6)
    # causal: changing a later token leaves earlier logits alone
    changed = plain(tokens.at[:, 10].set((tokens[:, 10] + 1) % 256))
    np.testing.assert_allclose(changed[:, :10], logits[:, :10], rtol=1e-5, atol=1e-6)
    assert not np.allclose(changed[:, 10:], logits[:, 10:])


CASES = {
    "dp": ("dp", {"data": 8}, {}),
    "fsdp": ("fsdp", {"data": 8}, {}),
    "tp": ("tp", {"data": 2, "model": 4}, {}),
    "tp_sp": ("tp_sp", {"data": 2, "model": 4}, {}),
    "2d": ("2d", {"data": 2, "model": 4}, {}),
    "dp-accum": ("dp", {"data": 4, "model": 2}, {"grad_accum": 2}),
    "gpt2-tp": ("tp", {"data": 2, "model": 4}, {"model": SMALL_GPT2}),
    "explicit-rules": ({"batch": "model", "mlp": "data", "vocab": "data"}, {"data": 2, "model": 4}, {}),
}
SHARDFLOW_CASES = ["dp", "fsdp", "tp", "tp_sp", "2d", "gpt2-tp"]
# The jit engine differs from strategy to strategy only in its specs; these cover every kind of
# spec (split batch, split params on both axes, split sequence, accumulation, flax metadata).
JIT_CASES = ["tp_sp", "2d", "dp-accum", "gpt2-tp", "explicit-rules"]


def strategy_config(case, engine, data_dir, out):
    strategy, mesh, extra = CASES[case]
    return small_config(data_dir, out, strategy=strategy, mesh=mesh, engine=engine, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("engine,case", [("jit", c) for c in JIT_CASES] + [("shardflow", c) for c in SHARDFLOW_CASES])
def test_strategy_matches_single_device(engine, case, data_dir, tmp_path):
    cfg = strategy_config(case, engine, data_dir, tmp_path)
    expected = single_device_losses(cfg)
    got = train.train(cfg, progress=False)["losses"]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], expected, rtol=1e-5)
    assert expected[2] < expected[0]


@pytest.mark.slow
def test_activation_constraints_reach_the_traced_step(data_dir, tmp_path):
    """The model's constrain() calls become sharding constraints of the step: the residual
    stream is split along the sequence under tp_sp, along the batch only under dp."""

    def pinned_specs(strategy, mesh):
        cfg = small_config(data_dir, tmp_path, strategy=strategy, mesh=mesh, engine="jit")
        run = train.setup(cfg)
        step = run.train_step()
        params, opt_state = jax.eval_shape(lambda: train.init_state(run))
        batch = {k: jax.ShapeDtypeStruct((1, 8, 32), jnp.int32) for k in ("inputs", "targets")}
        text = str(jax.make_jaxpr(step)(params, opt_state, batch))
        return set(re.findall(r"sharding_constraint\[.*?spec=(P\([^)]*\))", text, re.S))

    assert pinned_specs("dp", {"data": 8}) == {"P('data', None, None)"}
    # the residual stream [batch, seq, embed]; no logits exist to pin (the loss is fused over
    # vocab tiles; its rule lays the head's vocab split out)
    assert pinned_specs("tp_sp", {"data": 2, "model": 4}) == {"P('data', 'model', None)"}


@pytest.mark.parametrize("routing", ["capacity", "dropless"])
def test_a_moe_layer_with_its_experts_split_equals_one_device(routing):
    """A Mixture-of-Experts layer (models/moe.py) with its experts split over 'expert' and the
    batch over 'data': its output and routing statistics equal the layer's on one device."""
    import shardflow as sf
    from shardflow.models import moe
    from shardflow.models.config import preset

    cfg = preset(
        "moe-tiny", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, moe_ffn_dim=16, routing=routing
    )
    graphdef, params = nnx.split(moe.MoE(cfg, nnx.Rngs(0)))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16, 32)), jnp.float32)

    def layer(params, x):
        return nnx.merge(graphdef, params)(x)

    experts = jax.tree.map(lambda p: P("expert") if p.ndim == 3 else P(), params)
    step = sf.parallelize(
        layer, mesh=sf.make_mesh({"data": 2, "expert": 4}), in_specs=(experts, P("data")), out_specs=(P("data"), P())
    )
    for got, want in zip(jax.tree.leaves(step(params, x)), jax.tree.leaves(jax.jit(layer)(params, x)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
