"""GPT-2-style decoder: learned positions, pre-LayerNorm, GELU MLP, tied embeddings.

Built from Flax's own layers and annotated the Flax way — ``nnx.with_partitioning`` on each
initializer — to show that the trainer's rules tables honour that metadata as well as the
``@logical_axes`` decorator the Llama model uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import attention
from .config import ModelConfig
from .fp8 import Matmuls
from .llama import stacked
from .pipeline import RESIDUAL, PipelineConfig, cross_entropy, pipelined_loss, scan_layers
from .sharding import constrain


def _params_dtype(args, /, *, dtype=None, inexact=True):
    """nnx.Embed promotes to the dtype its parameters had at init (float32) whatever they hold
    now; compute in the dtype of the parameters held instead — the trainer casts them to
    compute_dtype (without this the whole GPT-2 ran in float32 under bfloat16)."""
    del dtype
    return nnx.nn.dtypes.promote_dtype(args, inexact=inexact)


def _init(std: float, axes):
    # eager_sharding=False: record the logical axes only; the trainer decides placement.
    return nnx.with_partitioning(nnx.initializers.normal(std), axes, eager_sharding=False)


def _linear(d_in, d_out, axes, std, rngs, matmuls: Matmuls):
    return nnx.Linear(
        d_in,
        d_out,
        rngs=rngs,
        dot_general=matmuls.dot_general,
        kernel_init=_init(std, axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:], eager_sharding=False),
    )


def _layer_norm(d, eps, rngs):
    return nnx.LayerNorm(
        d,
        epsilon=eps,
        rngs=rngs,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",), eager_sharding=False),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("norm",), eager_sharding=False),
    )


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, std = cfg.d_model, cfg.init_std
        out_std = std / (2 * cfg.n_layers) ** 0.5
        self.n_heads, self.impl = cfg.n_heads, cfg.attention_impl
        self.context, self.layout = cfg.attention_context, cfg.layout
        mm = Matmuls.of(cfg)
        self.ln_1 = _layer_norm(d, cfg.norm_eps, rngs)
        # "heads" here is the merged heads*head_dim dimension; splitting it splits whole heads.
        self.q = _linear(d, d, ("embed", "heads"), std, rngs, mm)
        self.k = _linear(d, d, ("embed", "heads"), std, rngs, mm)
        self.v = _linear(d, d, ("embed", "heads"), std, rngs, mm)
        self.proj = _linear(d, d, ("heads", "embed"), out_std, rngs, mm)
        self.ln_2 = _layer_norm(d, cfg.norm_eps, rngs)
        self.fc = _linear(d, cfg.ffn_dim, ("embed", "mlp"), std, rngs, mm)
        self.fc_proj = _linear(cfg.ffn_dim, d, ("mlp", "embed"), out_std, rngs, mm)

    def __call__(self, x):
        b, s, d = x.shape
        h = self.ln_1(x)
        q, k, v = (f(h).reshape(b, s, self.n_heads, d // self.n_heads) for f in (self.q, self.k, self.v))
        x = x + self.proj(
            attention(q, k, v, causal=True, impl=self.impl, context=self.context, layout=self.layout).reshape(b, s, d)
        )
        return x + self.fc_proj(jax.nn.gelu(self.fc(self.ln_2(x))))


class GPT2(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            rngs=rngs,
            promote_dtype=_params_dtype,
            embedding_init=_init(cfg.init_std, ("vocab", "embed")),
        )
        self.wpe = nnx.Embed(
            cfg.max_seq_len,
            cfg.d_model,
            rngs=rngs,
            promote_dtype=_params_dtype,
            embedding_init=_init(0.01, ("pos", "embed")),
        )
        self.layers = stacked(lambda r: Block(cfg, r), cfg.n_layers, rngs)
        self.ln_f = _layer_norm(cfg.d_model, cfg.norm_eps, rngs)

    def __call__(self, tokens):
        hidden, weight = self.features(tokens)
        return constrain(hidden @ weight, ("batch", None, "vocab"))

    def features(self, tokens):
        """(hidden [batch, seq, d_model], weight [d_model, vocab]): the logits' factors, the
        final hidden states and the tied embedding transposed."""
        x, _ = scan_layers(self.layers, constrain(self._embed(tokens), RESIDUAL), self.cfg.remat)
        head, head_params = self._head()
        return head(head_params, x)

    def losses(self, tokens, targets, *, pipeline: PipelineConfig | None = None, weights=None):
        """(loss, {}): as Llama's, a dense model's has no routing statistics."""
        return self.loss(tokens, targets, pipeline=pipeline, weights=weights), {}

    def loss(self, tokens, targets, *, pipeline: PipelineConfig | None = None, weights=None):
        """Mean next-token cross-entropy (fp32) of ``tokens`` against ``targets`` [batch, seq]
        (with ``weights`` [batch], the rows' weighted mean). With ``pipeline``, the stacked
        layers run as ``sf.pipeline``'s stages (models/pipeline.py)."""
        if pipeline is None:
            return cross_entropy(*self.features(tokens), targets, weights)
        head, head_params = self._head()
        return pipelined_loss(
            self.layers,
            constrain(self._embed(tokens), RESIDUAL),
            targets,
            pipeline=pipeline,
            remat=self.cfg.remat,
            head=head,
            head_params=head_params,
            weights=weights,
        )[0]

    def _embed(self, tokens):
        """Token plus position embeddings; the positions are the tokens' (in the layout's order)."""
        seq, layout = tokens.shape[1], self.cfg.layout
        positions = jnp.arange(seq) if layout is None else jnp.asarray(layout.positions(seq))
        return self.wte(tokens) + self.wpe(positions)[None]

    def _head(self):
        """(head(head_params, x) -> (hidden, weight), head_params): the final LayerNorm and
        the tied embedding, transposed, as a pure function."""
        graphdef, state = nnx.split((self.ln_f, self.wte))

        def head(state, x):
            ln_f, wte = nnx.merge(graphdef, state)
            return ln_f(x), wte.embedding[...].T

        return head, state
