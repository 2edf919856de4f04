"""Single-device programs and the specs of each parallel strategy, shared by the core tests.

Every program is ordinary JAX; a strategy only says how its inputs lie on the mesh:
  dp    batch split over every mesh axis, parameters replicated
  fsdp  batch split over every axis, parameters (and optimizer state) split on dim 0 too
  tp    Megatron: column-parallel in, row-parallel out over the last axis; batch over the others
  sp    tp, and activations between blocks split along the sequence over the last axis
  2d    batch over the first axis, tp over the last (1-D meshes: same as tp)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as PS

STRATEGIES = ("dp", "fsdp", "tp", "sp", "2d")


@dataclasses.dataclass(frozen=True)
class Cfg:
    batch: int = 8
    seq: int = 16
    dim: int = 32
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 64
    vocab: int = 64
    layers: int = 2

    @property
    def head_dim(self):
        return self.dim // self.heads


def rng(seed=0):
    return np.random.default_rng(seed)


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    """Leaf by leaf, with ``atol`` relative to the leaf's largest magnitude (above 1): what
    summation order moves in a sum of terms that large."""
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(actual_leaves, expected_leaves):
        e = np.asarray(e)
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        np.testing.assert_allclose(np.asarray(a), e, rtol=rtol, atol=atol * scale)


# ------------------------------------------------------------------------------ the model


def rmsnorm(x, g):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g


def rope(x):
    _, s, _, d = x.shape
    freq = 1.0 / (10000 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angle = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def gqa_attention(x, p, cfg: Cfg):
    b, s, _ = x.shape
    q = (x @ p["wq"]).reshape(b, s, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim)
    k = (x @ p["wk"]).reshape(b, s, cfg.kv_heads, cfg.head_dim)
    v = (x @ p["wv"]).reshape(b, s, cfg.kv_heads, cfg.head_dim)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k) / np.sqrt(cfg.head_dim)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, -1e9)
    w = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgst,btkd->bskgd", w, v).reshape(b, s, cfg.dim)
    return out @ p["wo"]


def swiglu(x, p):
    return (jax.nn.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]


def mlp(x, p):
    return jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def identity(x):
    return x


def decoder_layer(x, p, cfg: Cfg, pin=identity):
    """``pin`` marks the activations between blocks (sequence parallelism pins them S(seq))."""
    x = pin(x + gqa_attention(rmsnorm(x, p["ln1"]), p, cfg))
    return pin(x + swiglu(rmsnorm(x, p["ln2"]), p))


def cross_entropy(logits, targets):
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked)


def layer_params(cfg: Cfg, r):
    d, f, hd = cfg.dim, cfg.ffn, cfg.head_dim
    n = lambda *shape: (r.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    return {
        "wq": n(d, cfg.heads * hd),
        "wk": n(d, cfg.kv_heads * hd),
        "wv": n(d, cfg.kv_heads * hd),
        "wo": n(cfg.heads * hd, d),
        "w1": n(d, f),
        "w3": n(d, f),
        "w2": n(f, d),
        "ln1": np.ones(d, np.float32),
        "ln2": np.ones(d, np.float32),
    }


def llama_params(cfg: Cfg, seed=0):
    r = rng(seed)
    return {
        "embed": (r.standard_normal((cfg.vocab, cfg.dim)) * 0.02).astype(np.float32),
        "layer": layer_params(cfg, r),
        "norm": np.ones(cfg.dim, np.float32),
        "unembed": (r.standard_normal((cfg.dim, cfg.vocab)) / np.sqrt(cfg.dim)).astype(np.float32),
    }


def llama_loss(params, tokens, targets, cfg: Cfg, pin=identity):
    x = pin(params["embed"][tokens])
    x = decoder_layer(x, params["layer"], cfg, pin)
    logits = rmsnorm(x, params["norm"]) @ params["unembed"]
    return cross_entropy(logits, targets)


# eps=1e-6 rather than 1e-8: Adam's m/sqrt(v) maps a gradient entry near 1e-8 to about ±lr
# whatever its value, so summation-order noise in such entries would swamp an rtol=1e-5 oracle.
OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-6, weight_decay=0.1))


def make_train_step(loss_fn):
    def train_step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def tokens(cfg: Cfg, seed=1):
    r = rng(seed)
    return (
        r.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32),
        r.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32),
    )


# ------------------------------------------------------------------------------ strategies


def axes_roles(strategy: str, mesh):
    """(batch axes, fsdp axes, tp axis or None, sequence parallel?)."""
    names = tuple(mesh.axis_names)
    last = names[-1]
    rest = names[:-1]
    if strategy == "dp":
        return names, (), None, False
    if strategy == "fsdp":
        return names, names, None, False
    if strategy == "tp":
        return rest, (), last, False
    if strategy == "sp":
        return rest, (), last, True
    if strategy == "2d":
        return (names[0],) if len(names) > 1 else (), (), last, False
    raise ValueError(strategy)


def _one(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def weight_spec(name: str, ndim: int, strategy: str, mesh) -> PS:
    """Spec of parameter ``name`` (a leaf key of the layer/model params)."""
    batch, fsdp, tp, _ = axes_roles(strategy, mesh)
    if fsdp:
        return PS(_one(fsdp))
    if tp is None or ndim < 2:
        return PS()
    if name in ("wq", "wk", "wv", "w1", "w3", "unembed"):  # column parallel
        return PS(None, tp)
    if name in ("wo", "w2"):  # row parallel
        return PS(tp, None)
    if name == "embed":  # vocab parallel
        return PS(tp, None)
    return PS()


def param_specs(params, strategy, mesh):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: weight_spec(path[-1].key, np.ndim(x), strategy, mesh), params
    )


def batch_spec(strategy, mesh, ndim=2):
    batch, _, tp, sp = axes_roles(strategy, mesh)
    return PS(_one(batch), *([None] * (ndim - 1)))


def activation_spec(strategy, mesh) -> PS:
    """[batch, seq, dim] activations between blocks."""
    batch, _, tp, sp = axes_roles(strategy, mesh)
    return PS(_one(batch), tp if sp else None, None)


def opt_state_specs(opt_state, params, p_specs):
    return optax.tree_map_params(OPTIMIZER, lambda _, s: s, opt_state, p_specs, transform_non_params=lambda _: PS())


def pin_for(strategy, mesh):
    """The activation pin of a strategy: sequence parallelism constrains [batch, seq, dim] values."""
    import shardflow as sf

    if axes_roles(strategy, mesh)[3]:
        spec = activation_spec(strategy, mesh)
        return lambda x: sf.constrain(x, spec)
    return identity


# ------------------------------------------------------------------------------ test cases
# Each builder: (strategy, mesh) -> (fn, args, in_specs, out_specs), fn a single-device program.


def case_mlp(strategy, mesh, cfg=Cfg()):
    r = rng(2)
    params = {
        "w1": (r.standard_normal((cfg.dim, cfg.ffn)) / 6).astype(np.float32),
        "w2": (r.standard_normal((cfg.ffn, cfg.dim)) / 8).astype(np.float32),
    }
    x = r.standard_normal((cfg.batch, cfg.seq, cfg.dim)).astype(np.float32)
    pin = pin_for(strategy, mesh)

    def fn(params, x):
        loss = lambda p: jnp.mean(pin(x + mlp(pin(x), p)) ** 2)
        return jax.value_and_grad(loss)(params)

    ps = param_specs(params, strategy, mesh)
    return fn, (params, x), (ps, batch_spec(strategy, mesh, 3)), (PS(), ps)


def case_attention(strategy, mesh, cfg=Cfg()):
    params = layer_params(cfg, rng(3))
    params = {k: params[k] for k in ("wq", "wk", "wv", "wo", "ln1")}
    x = rng(4).standard_normal((cfg.batch, cfg.seq, cfg.dim)).astype(np.float32)
    pin = pin_for(strategy, mesh)

    def fn(params, x):
        loss = lambda p: jnp.mean(pin(x + gqa_attention(rmsnorm(pin(x), p["ln1"]), p, cfg)) ** 2)
        return jax.value_and_grad(loss)(params)

    ps = param_specs(params, strategy, mesh)
    return fn, (params, x), (ps, batch_spec(strategy, mesh, 3)), (PS(), ps)


def case_llama_step(strategy, mesh, cfg=Cfg()):
    params = llama_params(cfg)
    opt_state = OPTIMIZER.init(params)
    pin = pin_for(strategy, mesh)
    step = make_train_step(lambda p, a, b: llama_loss(p, a, b, cfg, pin))
    ps = param_specs(params, strategy, mesh)
    os_ = opt_state_specs(opt_state, params, ps)
    bs = batch_spec(strategy, mesh)
    return step, (params, opt_state, *tokens(cfg)), (ps, os_, bs, bs), (ps, os_, PS())


def case_vocab_ce(strategy, mesh, cfg=Cfg()):
    full = llama_params(cfg)
    params = {"embed": full["embed"], "unembed": full["unembed"]}

    def fn(params, toks, targets):
        def loss(p):
            x = jnp.tanh(p["embed"][toks])
            return cross_entropy(x @ p["unembed"], targets)

        return jax.value_and_grad(loss)(params)

    ps = param_specs(params, strategy, mesh)
    bs = batch_spec(strategy, mesh)
    return fn, (params, *tokens(cfg)), (ps, bs, bs), (PS(), ps)


def case_scan(strategy, mesh, cfg=Cfg()):
    r = rng(5)
    layers = [layer_params(cfg, r) for _ in range(cfg.layers)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *layers)
    params = {"embed": llama_params(cfg)["embed"], "layers": stacked, "unembed": llama_params(cfg)["unembed"]}
    opt_state = OPTIMIZER.init(params)
    pin = pin_for(strategy, mesh)

    def loss(p, toks, targets):
        x = pin(p["embed"][toks])
        x, _ = lax.scan(lambda h, lp: (decoder_layer(h, lp, cfg, pin), None), x, p["layers"])
        return cross_entropy(x @ p["unembed"], targets)

    step = make_train_step(loss)
    flat = param_specs({"embed": params["embed"], "unembed": params["unembed"], **layers[0]}, strategy, mesh)
    ps = {"embed": flat["embed"], "unembed": flat["unembed"], "layers": {k: PS(None, *flat[k]) for k in layers[0]}}
    os_ = opt_state_specs(opt_state, params, ps)
    bs = batch_spec(strategy, mesh)
    return step, (params, opt_state, *tokens(cfg)), (ps, os_, bs, bs), (ps, os_, PS())


def case_cond(strategy, mesh, cfg=Cfg()):
    fn0, args, in_specs, out_specs = case_mlp(strategy, mesh, cfg)
    pin = pin_for(strategy, mesh)

    def fn(params, x):
        def loss(p):
            y = lax.cond(jnp.mean(x) > 0, lambda: mlp(pin(x), p), lambda: -mlp(pin(x), p) * 0.5)
            return jnp.mean(pin(x + y) ** 2)

        return jax.value_and_grad(loss)(params)

    return fn, args, in_specs, out_specs


def case_while(strategy, mesh, cfg=Cfg()):
    _, args, in_specs, _ = case_mlp(strategy, mesh, cfg)
    pin = pin_for(strategy, mesh)

    def fn(params, x):
        def body(state):
            i, h = state
            return i + 1, pin(h + 0.1 * mlp(pin(h), params))

        _, h = lax.while_loop(lambda s: (s[0] < 3) & (jnp.max(jnp.abs(s[1])) < 1e6), body, (0, x))
        return h

    return fn, args, in_specs, batch_spec(strategy, mesh, 3)


CASES = {
    "mlp": case_mlp,
    "attention": case_attention,
    "llama_step": case_llama_step,
    "vocab_ce": case_vocab_ce,
    "scan": case_scan,
    "cond": case_cond,
    "while": case_while,
}
