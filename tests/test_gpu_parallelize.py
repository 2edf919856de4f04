"""On real GPUs, `sf.parallelize` equals the same function on one GPU, in fp32 and bf16: an MLP
training step (optax adamw) under data-parallel, FSDP, tensor-parallel and 2-D specs, a
transformer block on `shardflow.attention.attention` (the Pallas kernels: Triton, and Mosaic GPU for
bf16 on Hopper), a scan over stacked layers, and the Llama model's training step under the
strategy presets.

`python -m pytest -m gpu tests` on a GPU machine. Meshes of 1, 2 and 4 devices; a test skips
where there are fewer GPUs than its mesh needs, the whole module without a GPU.

Tolerances: fp32 runs under jax.default_matmul_precision("highest") (no TF32) and must agree to
rtol 1e-5; bf16 computes in bf16 from fp32 master weights and must agree to rtol 2e-2. Both with
an atol of rtol times the largest magnitude of the compared array: a sum split over devices
rounds in another order, which moves its small elements by that much, not by rtol of themselves.

fp32 attention runs the Triton kernels with IEEE fp32 dots, which compile slowly (a test at
head_dim 64 took about a minute on an H200, jax 0.11.2): the fp32 attention cases use head_dim
16, the bf16 ones 64 (the Mosaic GPU kernels take 64 and 128). The one-device reference of a
function is computed once per module run and shared by its mesh cases.
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow.attention import attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
RTOL = {"fp32": 1e-5, "bf16": 2e-2}


def mesh_of(axes):
    need = math.prod(axes.values())
    if jax.device_count() < need:
        pytest.skip(f"needs {need} GPUs, {jax.device_count()} here")
    return sf.make_mesh(axes)


def precision(dtype_name):
    return jax.default_matmul_precision("highest") if dtype_name == "fp32" else contextlib.nullcontext()


def assert_trees_close(actual, expected, dtype_name):
    """Every leaf within tolerance; a failure lists each leaf that is not (its largest error over
    the leaf's largest magnitude, and the share of its elements out of tolerance)."""
    rtol = RTOL[dtype_name]
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    bad = []
    for (path, e), a in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(actual)):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        name = jax.tree_util.keystr(path)
        assert a.shape == e.shape and np.isfinite(e).all(), name
        scale = float(np.abs(e).max()) if e.size else 0.0
        out = ~(np.abs(a - e) <= rtol * scale + rtol * np.abs(e))  # NaN counts as out
        if out.any():
            err = float(np.abs(a - e).max())  # nan where actual has a NaN
            bad.append(
                f"{name}: max |actual - expected| = {err:.3g} = {err / (scale or 1):.3g} of "
                f"max |expected| {scale:.3g}; {out.mean():.2%} of {e.size} elements out"
            )
    assert not bad, f"{dtype_name}, rtol {rtol} (atol rtol * max |expected|):\n" + "\n".join(bad)


_EXPECTED = {}


def run_both(key, fn, args, mesh, in_specs, out_specs, dtype_name, reference_fn=None):
    """(fn parallelized on mesh, reference_fn (default fn) under jax.jit on one GPU) of *args;
    the reference is computed once per key."""
    host = jax.device_get(args)
    with precision(dtype_name):
        if key not in _EXPECTED:
            _EXPECTED[key] = jax.device_get(jax.jit(reference_fn or fn)(*host))
        actual = jax.device_get(sf.parallelize(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*host))
    return actual, _EXPECTED[key]


def opt_specs_of(optimizer, params, param_specs):
    """The optimizer state's specs: each moment as its parameter, scalars replicated."""
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        jax.eval_shape(optimizer.init, params),
        param_specs,
        transform_non_params=lambda _: PS(),
        is_leaf=lambda x: isinstance(x, PS),
    )


def adamw(lr):
    """adamw with eps 1e-3: at the usual 1e-8 Adam's first step is lr * sign(g), which turns a
    gradient element at rounding level (a sum over devices rounds in another order) into a whole
    +-lr step either way; a larger eps keeps the update a smooth function of the gradient."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, eps=1e-3, weight_decay=0.1))


def train_step_of(loss_fn, optimizer):
    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    return step


# ------------------------------------------------------------------------------------------
# An MLP training step.

MLP_CASES = {  # mesh, specs of w1, b1, w2, w3, specs of the batch
    "one-device": ({"data": 1}, (PS(), PS(), PS(), PS()), PS("data")),
    "dp": ({"data": 2}, (PS(), PS(), PS(), PS()), PS("data")),
    "fsdp": ({"data": 4}, (PS("data"), PS(), PS("data"), PS("data")), PS("data")),
    "tp": ({"model": 4}, (PS(None, "model"), PS("model"), PS("model"), PS()), PS()),
    "2d": ({"data": 2, "model": 2}, (PS("data", "model"), PS("model"), PS("model", "data"), PS("data")), PS("data")),
}


def mlp_loss(dtype):
    def loss_fn(params, x, labels):
        p = jax.tree.map(lambda w: w.astype(dtype), params)  # fp32 master weights
        h = jax.nn.gelu(x.astype(dtype) @ p["w1"] + p["b1"])
        h = h + jnp.tanh(h @ p["w2"]) @ p["w2"].T
        logits = (h @ p["w3"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss_fn


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(MLP_CASES))
def test_mlp_train_step(case, dtype_name):
    axes, (s1, sb1, s2, s3), batch_spec = MLP_CASES[case]
    mesh = mesh_of(axes)
    r = np.random.default_rng(0)
    params = {
        "w1": r.standard_normal((64, 256)) / 8,
        "b1": r.standard_normal(256) / 10,
        "w2": r.standard_normal((256, 128)) / 16,
        "w3": r.standard_normal((256, 16)) / 16,
    }
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    x = r.standard_normal((32, 64)).astype(np.float32)
    labels = r.integers(0, 16, 32).astype(np.int32)
    optimizer = adamw(1e-3)
    opt_state = jax.device_get(optimizer.init(params))
    param_specs = {"w1": s1, "b1": sb1, "w2": s2, "w3": s3}
    opt_specs = opt_specs_of(optimizer, params, param_specs)
    step = train_step_of(mlp_loss(DTYPES[dtype_name]), optimizer)
    actual, expected = run_both(
        ("mlp", dtype_name),
        step,
        (params, opt_state, x, labels),
        mesh,
        (param_specs, opt_specs, batch_spec, batch_spec),
        (param_specs, opt_specs, PS(), PS()),
        dtype_name,
    )
    assert_trees_close(actual, expected, dtype_name)


# ------------------------------------------------------------------------------------------
# A transformer block on shardflow.attention.attention: the Pallas kernels run on the local blocks.

HEADS, KV_HEADS, D_MODEL = 8, 4, 256
_col, _row = PS(None, "model"), PS("model", None)
BLOCK_CASES = {  # mesh, x's spec, whether the weights split over "model"
    "one-device": ({"data": 1}, PS("data"), False),
    "batch": ({"data": 2}, PS("data"), False),
    "heads": ({"model": 4}, PS(), True),
    "batch+heads": ({"data": 2, "model": 2}, PS("data"), True),
    "sequence": ({"model": 2}, PS(None, "model"), False),  # q split, k/v gathered
}
# (dtype, seq, head_dim): fp32 runs the Triton kernels; bf16 at seq 256 the Mosaic GPU ones on
# Hopper (Triton elsewhere, and for the offset causal mask of a split sequence), at 200 Triton.
BLOCK_VARIANTS = [("fp32", 256, 16), ("bf16", 256, 64), ("bf16", 200, 64)]


def block_params(head_dim, seed=0):
    r = np.random.default_rng(seed)
    w = lambda *shape: (r.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)
    return {
        "norm1": np.ones(D_MODEL, np.float32),
        "norm2": np.ones(D_MODEL, np.float32),
        "wq": w(D_MODEL, HEADS * head_dim),
        "wk": w(D_MODEL, KV_HEADS * head_dim),
        "wv": w(D_MODEL, KV_HEADS * head_dim),
        "wo": w(HEADS * head_dim, D_MODEL),
        "up": w(D_MODEL, 512),
        "down": w(512, D_MODEL),
    }


def block_specs(split):
    if not split:
        return jax.tree.map(lambda _: PS(), block_params(16))
    return {"norm1": PS(), "norm2": PS(), "wq": _col, "wk": _col, "wv": _col, "wo": _row, "up": _col, "down": _row}


def block_loss(dtype, head_dim):
    def rms(x, scale):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * scale).astype(dtype)

    def loss_fn(params, x):
        p = jax.tree.map(lambda w: w.astype(dtype), params)
        x = x.astype(dtype)
        b, s, _ = x.shape
        h = rms(x, params["norm1"])
        q = (h @ p["wq"]).reshape(b, s, HEADS, head_dim)
        k = (h @ p["wk"]).reshape(b, s, KV_HEADS, head_dim)
        v = (h @ p["wv"]).reshape(b, s, KV_HEADS, head_dim)
        x = x + attention(q, k, v, causal=True).reshape(b, s, HEADS * head_dim) @ p["wo"]
        x = x + jax.nn.gelu(rms(x, params["norm2"]) @ p["up"]) @ p["down"]
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    return loss_fn


@pytest.mark.parametrize(
    "dtype_name,seq,head_dim", BLOCK_VARIANTS, ids=[f"{d}-{s}-hd{h}" for d, s, h in BLOCK_VARIANTS]
)
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_transformer_block_forward_and_grads(case, dtype_name, seq, head_dim):
    axes, x_spec, split = BLOCK_CASES[case]
    mesh = mesh_of(axes)
    params = block_params(head_dim)
    x = np.random.default_rng(1).standard_normal((4, seq, D_MODEL)).astype(np.float32)
    if case == "sequence" and seq % 2:
        pytest.skip("an odd split")
    specs = block_specs(split)
    fn = jax.value_and_grad(block_loss(DTYPES[dtype_name], head_dim), argnums=(0, 1))
    actual, expected = run_both(
        ("block", dtype_name, seq), fn, (params, x), mesh, (specs, x_spec), (PS(), (specs, x_spec)), dtype_name
    )
    assert_trees_close(actual, expected, dtype_name)


# ------------------------------------------------------------------------------------------
# Context-parallel attention: the sequence split over {context: n}, each variant.

CONTEXT_VARIANTS = (
    "ring",
    "zigzag",
    "striped",
    "ulysses",
    "all_gather",
    "hybrid",
    "zigzag-all_gather",
    "striped-all_gather",
)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("variant", CONTEXT_VARIANTS)
def test_context_parallel_attention_forward_and_grads(variant, n):
    """Causal bf16 attention at head_dim 64 (the Mosaic GPU kernels on Hopper, each ring step's
    pairs with static masks), GQA 8 over 4, q / k / v split along the sequence: out and the three
    gradients equal one GPU's. A variant name as benchmarks/context.py's: a layout (zigzag,
    striped) alone is a ring over tokens in that order, "-all_gather" its steps on K/V gathered;
    "hybrid" on {context: n} alone is Ulysses. The inputs are in the layout's order, as the data
    loader stores them; one GPU un-permutes, attends and permutes back."""
    from shardflow.attention import Layout

    mesh = mesh_of({"context": n})
    kind, _, gathered = variant.partition("-")
    layout = Layout(kind, n) if kind in ("zigzag", "striped") else None
    context = gathered or ("ring" if layout is not None else variant)

    def loss(q, k, v):
        out = attention(q, k, v, causal=True, context=context, layout=layout)
        return jnp.sum(jnp.tanh(out.astype(jnp.float32))), out

    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2048, h, 64)), jnp.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    seq = PS(None, "context")
    fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    actual, expected = run_both(
        ("context", kind if layout is not None else "natural", n),
        fn,
        (q, k, v),
        mesh,
        (seq, seq, seq),
        ((PS(), seq), (seq, seq, seq)),
        "bf16",
    )
    assert_trees_close(actual, expected, "bf16")


# ------------------------------------------------------------------------------------------
# A scan over stacked layers, differentiated.

SCAN_CASES = {  # mesh, spec of the stacked weights [layers, d, d], of x [batch, d]
    "batch": ({"data": 4}, PS(), PS("data")),
    "columns": ({"model": 2}, PS(None, None, "model"), PS()),
    "2d": ({"data": 2, "model": 2}, PS(None, "data", "model"), PS("data")),
}


def scan_loss(dtype):
    def loss_fn(w, x):
        def layer(h, wi):
            h = h + jnp.tanh(h @ wi.astype(dtype))
            return h, jnp.sum(h.astype(jnp.float32) ** 2)

        h, per_layer = jax.lax.scan(layer, x.astype(dtype), w)
        return jnp.mean(h.astype(jnp.float32) ** 2) + 0.01 * jnp.sum(per_layer)

    return loss_fn


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(SCAN_CASES))
def test_scan_forward_and_grads(case, dtype_name):
    axes, w_spec, x_spec = SCAN_CASES[case]
    mesh = mesh_of(axes)
    r = np.random.default_rng(2)
    w = (r.standard_normal((4, 128, 128)) / math.sqrt(128)).astype(np.float32)
    x = r.standard_normal((16, 128)).astype(np.float32)
    fn = jax.value_and_grad(scan_loss(DTYPES[dtype_name]), argnums=(0, 1))
    actual, expected = run_both(
        ("scan", dtype_name), fn, (w, x), mesh, (w_spec, x_spec), (PS(), (w_spec, x_spec)), dtype_name
    )
    assert_trees_close(actual, expected, dtype_name)


# ------------------------------------------------------------------------------------------
# The Llama model's training step under the strategy presets (built from shardflow.models as
# the trainer builds it: fp32 master weights, a compute-dtype copy for the forward).

LLAMA = dict(
    family="llama", vocab_size=256, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, max_seq_len=256
)
LLAMA_HEAD_DIM = {"fp32": 16, "bf16": 64}
LLAMA_CASES = {  # strategy, mesh, remat (full: the layer loop lowered unrolled, each
    # recomputation barred behind its cotangent, as the 7b preset runs)
    "one-device": ("dp", {"data": 1}, "none"),
    "one-device-remat": ("dp", {"data": 1}, "full"),
    "dp": ("dp", {"data": 2}, "none"),
    "fsdp": ("fsdp", {"data": 4}, "none"),
    "fsdp-remat": ("fsdp", {"data": 4}, "full"),
    "tp": ("tp", {"data": 2, "model": 2}, "none"),
    "tp_sp": ("tp_sp", {"data": 2, "model": 2}, "none"),
    "2d": ("2d", {"data": 2, "model": 2}, "none"),
}


@functools.cache
def llama_state(dtype_name, remat):
    from flax import nnx

    from shardflow import models

    model = models.build(models.ModelConfig(**LLAMA, head_dim=LLAMA_HEAD_DIM[dtype_name], remat=remat), seed=0)
    graphdef, _ = nnx.split(model)
    return model, graphdef, jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_train_step(case, dtype_name):
    from flax import nnx

    from shardflow import models

    strategy, axes, remat = LLAMA_CASES[case]
    mesh = mesh_of(axes)
    model, graphdef, params = llama_state(dtype_name, remat)
    rules = models.get_rules(strategy)
    param_specs = models.param_specs(model, rules, mesh)
    dtype = DTYPES[dtype_name]

    def loss_fn(params, inputs, targets):
        m = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params))
        logits = m(inputs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    optimizer = adamw(1e-3)
    opt_state = jax.device_get(optimizer.init(params))
    opt_specs = opt_specs_of(optimizer, params, param_specs)
    step = train_step_of(loss_fn, optimizer)

    def step_with_rules(*args):  # the model's activation constraints, as the trainer pins them
        with models.activation_sharding(rules, sf.constrain):
            return step(*args)

    tokens = np.random.default_rng(3).integers(0, 256, (4, 257)).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    batch_spec = models.spec_for(("batch", None), rules)
    actual, expected = run_both(
        ("llama", dtype_name, remat),
        step_with_rules,
        (params, opt_state, inputs, targets),
        mesh,
        (param_specs, opt_specs, batch_spec, batch_spec),
        (param_specs, opt_specs, PS(), PS()),
        dtype_name,
        reference_fn=step,
    )
    assert_trees_close(actual, expected, dtype_name)
