"""FP8 matmuls (models/fp8.py): each GEMM against a float reference of its quantised operands,
every strategy's FP8 step against one device's, the size rule, explain's list, config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import ClosedJaxpr, Jaxpr
from test_models import CASES, SMALL_GPT2, SMALL_LLAMA, small_config

from shardflow import models, train
from shardflow.models import fp8
from shardflow.train import config, planning

# (spec, x shape, w shape): every projection the models multiply, as their modules write it
GEMMS = {
    "qkv": ("bsd,dhk->bshk", (2, 16, 64), (64, 4, 16)),
    "wo": ("bshk,hkd->bsd", (2, 16, 4, 16), (4, 16, 64)),
    "mlp": ("...d,df->...f", (2, 16, 64), (64, 128)),
}


def dequantized(t, fp8_dtype):
    q, s = fp8.quantize(t, fp8_dtype)
    return q.astype(jnp.float32) * s


def dot_dtypes(jaxpr: Jaxpr):
    """The operand dtypes of every dot_general in ``jaxpr`` and the jaxprs inside it."""
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            yield tuple(v.aval.dtype.name for v in e.invars)
        for value in e.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    yield from dot_dtypes(getattr(sub, "jaxpr", sub))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
@pytest.mark.parametrize("gemm", sorted(GEMMS))
def test_each_gemm_equals_a_float_reference_of_its_quantised_operands(gemm, magnitude, dtype):
    """Forward: dot(q(x), q(w)) with e4m3 operands; backward: dx and dw from the e5m2 output
    gradient and the forward's quantised operands — each the float32 product of the
    dequantised operands: to float32's rounding in float32 (1e-6 of the largest output); in
    bfloat16 within two of its roundings (the output's, and the scale's product, which is multiplied in bfloat16)."""
    spec, xs, ws = GEMMS[gemm]
    keys = jax.random.split(jax.random.key(hash((gemm, magnitude)) % 2**31), 3)
    x = (magnitude * jax.random.normal(keys[0], xs)).astype(dtype)
    w = (0.05 * jax.random.normal(keys[1], ws)).astype(dtype)
    y, vjp = jax.vjp(lambda x, w: jnp.einsum(spec, x, w, _dot_general=fp8.fp8_dot_general), x, w)
    g = (1e-4 * jax.random.normal(keys[2], y.shape)).astype(dtype)
    dx, dw = vjp(g)

    exact = lambda a, b: jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)
    want_y, ref_vjp = jax.vjp(exact, dequantized(x, fp8.E4M3), dequantized(w, fp8.E4M3))
    want_dx, want_dw = ref_vjp(dequantized(g, fp8.E5M2))
    rtol = 1e-6 if dtype == jnp.float32 else 2**-7
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert got.dtype == dtype
        # relative to the largest output: where an output's terms cancel, float32 rounds them
        # differently in the two orders (the scales applied per product, or once to the sum)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=rtol, atol=rtol * np.abs(want).max())

    grad = jax.grad(lambda x, w: jnp.einsum(spec, x, w, _dot_general=fp8.fp8_dot_general).sum(), argnums=(0, 1))
    found = list(dot_dtypes(jax.make_jaxpr(grad)(x, w).jaxpr))
    assert ("float8_e4m3fn", "float8_e4m3fn") in found  # the forward
    assert sum("float8_e5m2" in d and "float8_e4m3fn" in d for d in found) == 2  # dgrad and wgrad
    assert all(set(d) <= {"float8_e4m3fn", "float8_e5m2"} for d in found)


def test_the_amax_lands_on_the_formats_largest_value_and_zeros_stay_zero():
    x = jnp.array([[0.3, -700.0], [2.0, 1e-3]])
    q, s = fp8.quantize(x, fp8.E4M3)
    np.testing.assert_allclose(float(s), 700.0 / 448.0, rtol=1e-7)
    assert float(q[0, 1].astype(jnp.float32)) == -448.0
    q, s = fp8.quantize(jnp.zeros((4, 4)), fp8.E5M2)
    assert float(s) == 1.0 and not jnp.any(q.astype(jnp.float32))


@pytest.mark.parametrize(
    "m,n,k,fp8_or_not",
    [
        (8192, 8192, 2048, True),  # torchao's rule takes this weight
        (8192, 4096, 1024, False),  # K <= 1024 and N <= 4096: bf16
        (8192, 1024, 4096, True),
        (8192, 8192, 1000, False),  # not a multiple of 16
    ],
)
def test_the_size_rule(m, n, k, fp8_or_not):
    assert fp8.runs_in_fp8(m, n, k) is fp8_or_not


def test_the_switch_puts_the_projections_in_fp8_and_leaves_small_ones_alone():
    """fp8_small_gemms: all seven projections of a Llama layer forward; fp8 alone on the same
    small model: none (every one is below the size rule); neither: none."""

    def forward_fp8_dots(**flags):
        cfg = models.ModelConfig(**{k: v for k, v in SMALL_LLAMA.items() if k != "preset"}, **flags)
        model = models.build(cfg)
        tokens = jnp.zeros((2, 16), jnp.int32)
        return sum("float8_e4m3fn" in d for d in dot_dtypes(jax.make_jaxpr(model.loss)(tokens, tokens).jaxpr))

    assert forward_fp8_dots(fp8=True, fp8_small_gemms=True) == 7
    assert forward_fp8_dots() == 0
    matmuls = fp8.Matmuls(fp8=True)
    assert not matmuls.admits(4096, 256, 256)
    shapes = fp8.gemm_shapes(models.preset("1b"))
    assert all(matmuls.admits(8 * 4096, n, k) for k, n in shapes.values())


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_recomputes_the_same_fp8_gradients(remat):
    """The scales are recomputed from the same tensors under remat: loss and gradients equal
    the unrematerialised model's."""
    fields = {k: v for k, v in SMALL_LLAMA.items() if k != "preset"} | {"fp8": True, "fp8_small_gemms": True}
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)

    def loss_and_grads(**extra):
        graphdef, params = nnx.split(models.build(models.ModelConfig(**fields, **extra)))
        return jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(tokens, tokens))(params)

    (want, want_grads), (got, got_grads) = loss_and_grads(), loss_and_grads(remat=remat)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), got_grads, want_grads)


def one_device_losses(cfg):
    """The FP8 steps on device 0 alone, the batch cut into the config's accumulation
    micro-batches and run through its pipeline's micro-batches as the trainer does: each
    micro-batch's activations are scaled by their own amax there too."""
    run = train.setup(cfg)
    params, opt_state = jax.device_get(train.init_state(run))
    step_fn = jax.jit(train.make_train_step(run.graphdef, run.optimizer, jnp.float32, cfg.grad_accum, run.pipeline))
    losses = []
    for step in range(cfg.steps):
        shape = (cfg.grad_accum, cfg.batch_size // cfg.grad_accum)
        windows = run.data.windows(run.data.window_starts(step, shape, cfg.data.seq_len, cfg.data.seed), 32)
        params, opt_state, metrics = step_fn(
            params, opt_state, {"inputs": windows[..., :-1], "targets": windows[..., 1:]}
        )
        losses.append(float(metrics["loss"]))
    return losses


FP8_CASES = {**{case: CASES[case] for case in ("dp", "fsdp", "tp", "tp_sp", "2d", "dp-accum", "gpt2-tp")}}
FP8_CASES["pipe"] = ("dp", {"data": 4, "pipe": 2}, {})
FAST = ("2d",)


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in FP8_CASES])
def test_every_strategys_fp8_step_equals_one_devices(case, data_dir, tmp_path):
    """fp32 master weights and compute, every projection in FP8 (fp8_small_gemms): each scale
    is the whole tensor's amax on the mesh as on one device. rtol 1e-4, not the 1e-5 of the
    unquantised strategy tests: a value whose last float bit differs between the programs (a sum
    taken in another order) can round to the neighbouring FP8 value, a step of 6 % in one
    element (seen under tp_sp: 2.5e-5 at the third step)."""
    strategy, mesh, extra = FP8_CASES[case]
    cfg = small_config(data_dir, tmp_path, strategy=strategy, mesh=mesh, **extra)
    cfg.model = {**cfg.model, "fp8": True, "fp8_small_gemms": True}
    if case == "pipe":
        cfg.pipeline.stages, cfg.pipeline.microbatches = 2, 2
    expected = one_device_losses(cfg)
    got = train.train(cfg, progress=False)["losses"]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], expected, rtol=1e-4)
    assert expected[2] < expected[0]


def test_explain_lists_the_fp8_gemms(data_dir, tmp_path):
    """One line per FP8 dot_general (a layer's 7 forward, 14 backward), each at the model's line."""
    cfg = small_config(data_dir, tmp_path, strategy="tp", mesh={"data": 2, "model": 4})
    cfg.model = {**SMALL_GPT2, "fp8": True, "fp8_small_gemms": True}
    run = train.setup(cfg)
    plan = planning.plan_step(run, run.train_step())
    text = str(plan)
    assert len(plan.fp8_gemms) == 6 * 3 and "FP8 GEMMs (18, a loop's body once):" in text
    assert {source.split(":")[0] for _, _, source in plan.fp8_gemms} == {"gpt2.py"}
    assert "float8_e5m2[8, 32, 128] x float8_e4m3fn[64, 128] -> float32[8, 32, 64]" in text


@pytest.mark.slow
def test_fp8_training_follows_bf16s_loss(data_dir, tmp_path):
    """30 steps of the small Llama in bf16 and with every projection in FP8: the last 10
    steps' mean losses within 2 % (`benchmarks/fp8.py convergence` runs the 300 steps
    of the tiny preset to 1 %; over 30 steps the loss still falls fast, so a step's FP8 noise
    moves it more than near the end of a longer run)."""

    def mean_tail(**flags):
        cfg = small_config(data_dir, tmp_path, strategy="dp", mesh={"data": 8}, steps=30, compute_dtype="bfloat16")
        cfg.model = {**cfg.model, **flags}
        losses = train.train(cfg, progress=False)["losses"]
        return float(np.mean([losses[s] for s in sorted(losses)[-10:]]))

    bf16, fp8_loss = mean_tail(), mean_tail(fp8=True, fp8_small_gemms=True)
    assert abs(fp8_loss - bf16) / bf16 < 0.02, (fp8_loss, bf16)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.fp8=fast"], "model.fp8 must be true or false, got 'fast'"),
        (["model.fp8=1"], "model.fp8 must be true or false, got 1"),
        (["model.fp8_small_gemms=true"], "model.fp8_small_gemms .* needs model.fp8: true"),
        (["model.fp8=true"], r"model.fp8: none of this model's GEMMs is large enough for FP8 .* wq \(K 256, N 256\)"),
    ],
)
def test_fp8_config_errors(overrides, message, tmp_path):
    with pytest.raises(config.ConfigError, match=message):
        config.model_config(config.load(None, overrides, out=str(tmp_path)))
