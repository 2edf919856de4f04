"""Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, layers scanned over depth.

Weights are plain ``nnx.Param`` arrays used through einsums, each dimension named by the
``@logical_axes`` decorator of its module (see sharding.py). Compute runs in the dtype of the
parameters the model is merged with: the trainer keeps fp32 master weights and merges a bf16
copy for the forward/backward pass; norms and softmax statistics are computed in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import attention
from .config import ModelConfig
from .fp8 import Matmuls
from .moe import MoE
from .pipeline import (
    RESIDUAL,
    PipelineConfig,
    cross_entropy,
    pipelined_loss,  # noqa: F401
    scan_layers,
)
from .sharding import constrain, logical_axes


@logical_axes(scale=("norm",))
class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), keep_dtype=True)  # models.for_compute
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, layout=None):
    """cos/sin of shape [seq, head_dim // 2], fp32, for the tokens' positions (in ``layout``'s
    order, if given)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    positions = jnp.arange(seq_len) if layout is None else jnp.asarray(layout.positions(seq_len))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate pairs (first half, second half) of the head dimension; x is [b, s, h, d]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _normal(rngs: nnx.Rngs, shape, std):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


@logical_axes(
    wq=("embed", "heads", "head_dim"),
    wk=("embed", "kv_heads", "head_dim"),
    wv=("embed", "kv_heads", "head_dim"),
    wo=("heads", "head_dim", "embed"),
)
class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5  # GPT-2's residual-branch scaling
        self.wq = _normal(rngs, (d, h, hd), cfg.init_std)
        self.wk = _normal(rngs, (d, kv, hd), cfg.init_std)
        self.wv = _normal(rngs, (d, kv, hd), cfg.init_std)
        self.wo = _normal(rngs, (h, hd, d), out_std)
        self.impl, self.context, self.layout = cfg.attention_impl, cfg.attention_context, cfg.layout
        self.matmuls = Matmuls.of(cfg)

    def __call__(self, x, cos, sin):
        einsum = self.matmuls.einsum
        q = einsum("bsd,dhk->bshk", x, self.wq[...])
        k = einsum("bsd,dhk->bshk", x, self.wk[...])
        v = einsum("bsd,dhk->bshk", x, self.wv[...])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, causal=True, impl=self.impl, context=self.context, layout=self.layout)
        return einsum("bshk,hkd->bsd", out, self.wo[...])


@logical_axes(w_gate=("embed", "mlp"), w_up=("embed", "mlp"), w_down=("mlp", "embed"))
class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ffn_dim: int | None = None):
        d, f = cfg.d_model, ffn_dim or cfg.ffn_dim
        self.w_gate = _normal(rngs, (d, f), cfg.init_std)
        self.w_up = _normal(rngs, (d, f), cfg.init_std)
        self.w_down = _normal(rngs, (f, d), cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        self.matmuls = Matmuls.of(cfg)

    def __call__(self, x):
        einsum = self.matmuls.einsum
        gate = jax.nn.silu(einsum("...d,df->...f", x, self.w_gate[...]))
        return einsum("...f,fd->...d", gate * einsum("...d,df->...f", x, self.w_up[...]), self.w_down[...])


class Block(nnx.Module):
    """Attention and a feed-forward layer, each pre-normed on the residual stream; with
    ``moe``, the feed-forward layer is routed experts and the block returns (x, RoutingStats)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not moe:
            self.mlp = SwiGLU(cfg, rngs)
        else:
            shared = SwiGLU(cfg, rngs, ffn_dim=cfg.shared_experts * cfg.expert_ffn_dim) if cfg.shared_experts else None
            self.mlp = MoE(cfg, rngs, shared)

    def __call__(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        if isinstance(self.mlp, SwiGLU):
            return x + self.mlp(self.mlp_norm(x))
        y, stats = self.mlp(self.mlp_norm(x))
        return x + y, stats


class BlockGroup(nnx.Module):
    """``moe_every`` blocks, the last one MoE: the unit stacked over depth when only every
    n-th layer routes to experts. Returns (x, the MoE block's RoutingStats)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.dense = nnx.List([Block(cfg, rngs) for _ in range(cfg.moe_every - 1)])
        self.moe = Block(cfg, rngs, moe=True)

    def __call__(self, x, cos, sin):
        for block in self.dense:
            x = constrain(block(x, cos, sin), RESIDUAL)
        return self.moe(x, cos, sin)


def layer_unit(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The module stacked over depth: a Block, or a BlockGroup where only every n-th is MoE."""
    if not cfg.n_experts:
        return Block(cfg, rngs)
    return Block(cfg, rngs, moe=True) if cfg.moe_every == 1 else BlockGroup(cfg, rngs)


def stacked(make_layer, n_layers: int, rngs: nnx.Rngs):
    """n_layers copies of a layer with a leading depth dimension on every parameter."""

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return make_layer(rngs)

    return make(rngs)


@logical_axes(embedding=("vocab", "embed"), lm_head=("embed", "vocab"))
class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = _normal(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std)
        self.layers = stacked(lambda r: layer_unit(cfg, r), cfg.n_layers // cfg.moe_every, rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = _normal(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std)

    def __call__(self, tokens):
        """tokens [batch, seq] int → logits [batch, seq, vocab] in the compute dtype."""
        hidden, weight, _ = self._features(tokens)
        return constrain(hidden @ weight, ("batch", None, "vocab"))

    def features(self, tokens):
        """(hidden [batch, seq, d_model], weight [d_model, vocab]): the logits' factors, the
        final hidden states and the output projection; the loss never multiplies them whole."""
        return self._features(tokens)[:2]

    def _features(self, tokens):
        """(hidden, weight, the MoE layers' RoutingStats stacked over depth, or None)."""
        cfg = self.cfg
        self._check_window(tokens.shape[1])
        x = self._embed(tokens)
        cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta, cfg.layout)
        x, stats = scan_layers(self.layers, x, cfg.remat, cos, sin)
        head, head_params = self._head()
        return *head(head_params, x), stats

    def loss(self, tokens, targets, *, pipeline: PipelineConfig | None = None, weights=None):
        """Mean next-token cross-entropy (fp32) of ``tokens`` against ``targets`` [batch, seq],
        plus an MoE model's balance and z-losses. With ``pipeline``, the stacked layers run as
        ``sf.pipeline``'s stages (models/pipeline.py); with ``weights`` [batch], the rows'
        weighted mean (dense models: an MoE layer routes a batch's rows together)."""
        return self.losses(tokens, targets, pipeline=pipeline, weights=weights)[0]

    def losses(self, tokens, targets, *, pipeline: PipelineConfig | None = None, weights=None):
        """(loss, stats): ``loss`` as :meth:`loss`; ``stats`` the MoE layers' routing
        statistics ({} for a dense model): the cross-entropy alone, and per MoE layer the
        balance loss, the z-loss, each expert's load and the choices dropped. With
        ``pipeline``, each micro-batch routes on its own (as under gradient accumulation): the
        balance terms are its own, averaged over the micro-batches, as are the statistics."""
        if weights is not None and self.cfg.n_experts:
            raise ValueError("weighted rows: an MoE model routes a batch's rows together; dense models only")
        if pipeline is None:
            hidden, weight, routing = self._features(tokens)
            ce = cross_entropy(hidden, weight, targets, weights)
            if routing is None:
                return ce, {}
            loss = ce + self.routing_loss(routing)
        else:
            loss, routing = self._pipelined_loss(tokens, targets, pipeline, weights)
            if routing is None:
                return loss, {}
            ce = loss - self.routing_loss(routing)
        return loss, {"cross_entropy": ce, **routing._asdict()}

    def routing_loss(self, routing):
        """The weighted balance and z-loss terms of one MoE layer's RoutingStats, or their sum
        over the layers of stacked ones."""
        cfg = self.cfg
        terms = cfg.z_loss_weight * routing.z_loss
        if cfg.balance == "aux_loss":
            terms = terms + cfg.aux_loss_weight * routing.aux_loss
        return jnp.sum(terms)

    def _pipelined_loss(self, tokens, targets, pipeline, weights):
        """(loss, the MoE layers' RoutingStats stacked over depth, or None)."""
        cfg = self.cfg
        self._check_window(tokens.shape[1])
        with jax.ensure_compile_time_eval():  # constants the pipelined layer closes over
            cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta, cfg.layout)
        head, head_params = self._head()
        return pipelined_loss(
            self.layers,
            self._embed(tokens),
            targets,
            pipeline=pipeline,
            remat=cfg.remat,
            layer_args=(cos, sin),
            head=head,
            head_params=head_params,
            layer_loss=self.routing_loss if cfg.n_experts else None,
            weights=weights,
        )

    def _check_window(self, seq_len: int):
        window = self.cfg.sliding_window
        if window is not None and seq_len > window:
            raise ValueError(
                f"a sequence of {seq_len} tokens is longer than model.sliding_window ({window}): "
                "this attention has no window, so it computes a sliding-window model only on "
                "sequences within the window"
            )

    def _embed(self, tokens):
        return constrain(jnp.take(self.embedding[...], tokens, axis=0), RESIDUAL)

    def _head(self):
        """(head(head_params, x) -> (hidden, weight), head_params): the final norm and the
        output projection (the embedding, transposed, where tied) as a pure function."""
        norm_def, norm_state = nnx.split(self.final_norm)
        tied = self.cfg.tie_embeddings
        weight = self.embedding[...] if tied else self.lm_head[...]

        def head(params, x):
            norm_state, weight = params
            return nnx.merge(norm_def, norm_state)(x), weight.T if tied else weight

        return head, (norm_state, weight)
