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


def decoder_layer(x, p, cfg: Cfg):
    x = x + gqa_attention(rmsnorm(x, p["ln1"]), p, cfg)
    return x + swiglu(rmsnorm(x, p["ln2"]), p)


def cross_entropy(logits, targets):
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked)


def layer_params(cfg: Cfg, r):
    d, f, hd = cfg.dim, cfg.ffn, cfg.head_dim
    n = lambda *shape: (r.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    return {"wq": n(d, cfg.heads * hd), "wk": n(d, cfg.kv_heads * hd), "wv": n(d, cfg.kv_heads * hd),
            "wo": n(cfg.heads * hd, d), "w1": n(d, f), "w3": n(d, f), "w2": n(f, d),
            "ln1": np.ones(d, np.float32), "ln2": np.ones(d, np.float32)}


def llama_params(cfg: Cfg, seed=0):
    r = rng(seed)
    return {"embed": (r.standard_normal((cfg.vocab, cfg.dim)) * 0.02).astype(np.float32),
            "layer": layer_params(cfg, r),
            "norm": np.ones(cfg.dim, np.float32),
            "unembed": (r.standard_normal((cfg.dim, cfg.vocab)) / np.sqrt(cfg.dim)).astype(np.float32)}


def llama_loss(params, tokens, targets, cfg: Cfg):
    x = params["embed"][tokens]
    x = decoder_layer(x, params["layer"], cfg)
    logits = rmsnorm(x, params["norm"]) @ params["unembed"]
    return cross_entropy(logits, targets)


OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))


def make_train_step(loss_fn):
    def train_step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


def tokens(cfg: Cfg, seed=1):
    r = rng(seed)
    return (r.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32),
            r.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32))


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
    if name in ("wq", "wk", "wv", "w1", "w3", "unembed"):     # column parallel
        return PS(None, tp)
    if name in ("wo", "w2"):                                  # row parallel
        return PS(tp, None)
    if name == "embed":                                       # vocab parallel
        return PS(tp, None)
    return PS()


def param_specs(params, strategy, mesh):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: weight_spec(path[-1].key, np.ndim(x), strategy, mesh), params)


def batch_spec(strategy, mesh, ndim=2):
    batch, _, tp, sp = axes_roles(strategy, mesh)
    return PS(_one(batch), *([None] * (ndim - 1)))


def activation_spec(strategy, mesh) -> PS:
    """[batch, seq, dim] activations between blocks."""
    batch, _, tp, sp = axes_roles(strategy, mesh)
    return PS(_one(batch), tp if sp else None, None)


def opt_state_specs(opt_state, params, p_specs):
    return optax.tree_map_params(OPTIMIZER, lambda _, s: s, opt_state, p_specs,
                                 transform_non_params=lambda _: PS())
