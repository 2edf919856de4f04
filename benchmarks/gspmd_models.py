"""The flax programs of gspmd_programs.py: NNX (CNN, ResNet, ViT, MLP) and Linen (a language
model, an LSTM) models, each a training step under every strategy."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx
from gspmd_specs import Program, batch_spec, normal, param_specs, rng, train_program
from jax.sharding import PartitionSpec as PS

# ------------------------------------------------------------------------------ flax NNX models


class CNN(nnx.Module):
    """MNIST-like: conv, max-pool, conv, max-pool, dense."""

    def __init__(self, rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), rngs=rngs)
        self.fc = nnx.Linear(16 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        return self.fc(x.reshape(x.shape[0], -1))


class ResBlock(nnx.Module):
    def __init__(self, c, rngs):
        self.conv1 = nnx.Conv(c, c, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(c, rngs=rngs)
        self.conv2 = nnx.Conv(c, c, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(c, rngs=rngs)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        return nnx.relu(x + self.bn2(self.conv2(y)))


class ResNet(nnx.Module):
    def __init__(self, rngs, c=16, blocks=2):
        self.stem = nnx.Conv(3, c, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(c, rngs=rngs)
        self.blocks = nnx.List([ResBlock(c, rngs) for _ in range(blocks)])
        self.fc = nnx.Linear(c, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(axis=(1, 2)))


class ViT(nnx.Module):
    """Patch embedding (strided conv), one pre-norm encoder block (MultiHeadAttention, MLP,
    dropout), mean pool, classifier."""

    def __init__(self, rngs, patch=4, image=16, dim=32, heads=4, mlp=64, classes=10):
        self.dim = dim
        self.embed = nnx.Conv(3, dim, (patch, patch), strides=(patch, patch), padding="VALID", rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (1, (image // patch) ** 2, dim)) * 0.02)
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        # no q/k/v biases: a key bias has a zero gradient in exact arithmetic, so Adam would turn
        # its rounding noise into O(lr) updates of either sign, on every engine alike
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=dim, decode=False, keep_rngs=False, use_bias=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, mlp, rngs=rngs)
        self.fc2 = nnx.Linear(mlp, dim, rngs=rngs)
        self.drop = nnx.Dropout(0.1)
        self.ln3 = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, x, rngs):
        x = self.embed(x)
        x = x.reshape(x.shape[0], -1, self.dim) + self.pos
        x = x + self.drop(self.attn(self.ln1(x)), rngs=rngs)
        x = x + self.drop(self.fc2(nnx.gelu(self.fc1(self.ln2(x)))), rngs=rngs)
        return self.head(self.ln3(x).mean(axis=1))


class MLP(nnx.Module):
    def __init__(self, rngs, d_in=32, hidden=64, d_out=16):
        self.fc1 = nnx.Linear(d_in, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, d_out, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.fc1(x)))


def pure_state(model, *filters):
    graphdef, *states = nnx.split(model, *filters)
    return graphdef, [nnx.to_pure_dict(s) for s in states]


# Megatron splits of the NNX models: (regex over the parameter path, dim over 'model').
CONV_TP = ((r"conv1/kernel", -1), (r"conv1/bias", 0), (r"bn1/", 0), (r"conv2/kernel", -2))
ATTN_TP = ((r"(query|key|value)/kernel", 1), (r"out/kernel", 0))
MLP_TP = ((r"fc1/kernel", -1), (r"fc1/bias", 0), (r"fc2/kernel", 0))


@functools.cache
def program_cnn() -> Program:
    graphdef, (params,) = pure_state(CNN(nnx.Rngs(0)), nnx.Param)
    r = rng(1)
    images, labels = normal(r, (16, 16, 16, 1)), r.integers(0, 10, (16,)).astype(np.int32)

    def loss(params, images, labels):
        logits = nnx.merge(graphdef, params)(images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return train_program(params, optax.sgd(0.1, momentum=0.9), loss, (images, labels), CONV_TP)


@functools.cache
def program_resnet() -> Program:
    graphdef, (params, stats) = pure_state(ResNet(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
    r = rng(2)
    images, labels = normal(r, (16, 8, 8, 3)), r.integers(0, 10, (16,)).astype(np.int32)
    stats_specs = functools.partial(param_specs, stats, tp_rules=CONV_TP)  # stats lie like their channels

    def loss(params, stats, images, labels):
        model = nnx.merge(graphdef, params, stats)
        logits = model(images)  # BatchNorm in training mode: batch statistics, running averages updated
        new_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), new_stats

    return train_program(
        params,
        optax.sgd(0.05, momentum=0.9, nesterov=True),
        loss,
        (stats, images, labels),
        CONV_TP,
        aux_specs=stats_specs,
        batch_specs=lambda s: (stats_specs(s), batch_spec(s, 4), batch_spec(s, 1)),
    )


@functools.cache
def program_vit() -> Program:
    graphdef, (params,) = pure_state(ViT(nnx.Rngs(0)), nnx.Param)
    r = rng(3)
    images, labels = normal(r, (8, 16, 16, 3)), r.integers(0, 10, (8,)).astype(np.int32)
    key = np.asarray(jax.random.key_data(jax.random.key(7)))

    def loss(params, images, labels, key):
        model = nnx.merge(graphdef, params)
        logits = model(images, nnx.Rngs(dropout=jax.random.wrap_key_data(key)))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    opt = optax.adamw(optax.warmup_cosine_decay_schedule(1e-4, 1e-3, 10, 100), weight_decay=0.01)
    return train_program(
        params,
        opt,
        loss,
        (images, labels, key),
        CONV_TP + ATTN_TP + MLP_TP,
        batch_specs=lambda s: (batch_spec(s, 4), batch_spec(s, 1), PS()),
    )  # key replicated


# ------------------------------------------------------------------------------ flax Linen models


class LinenLM(nn.Module):
    vocab: int = 128
    dim: int = 32
    heads: int = 4
    ffn: int = 64

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim, name="embed")(tokens)
        h = nn.LayerNorm(name="ln1")(x)
        attn = nn.MultiHeadDotProductAttention(self.heads, use_bias=False, name="attn")  # no biases: see ViT
        x = x + attn(h, h, mask=nn.make_causal_mask(tokens))
        h = nn.LayerNorm(name="ln2")(x)
        x = x + nn.Dense(self.dim, name="fc2")(nn.gelu(nn.Dense(self.ffn, name="fc1")(h)))
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="ln3")(x))


LM_TP = ((r"embed/embedding", 0), (r"head/kernel", -1), (r"head/bias", 0)) + ATTN_TP + MLP_TP


@functools.cache
def program_lm() -> Program:
    model = LinenLM()
    r = rng(4)
    tokens = r.integers(0, 128, (8, 16)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    params = model.init(jax.random.key(0), tokens)["params"]

    def loss(params, tokens, targets):
        logits = model.apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(1e-4, 1e-3, 10, 100), weight_decay=0.1),
    )
    return train_program(params, opt, loss, (tokens, targets), LM_TP)


class LinenLSTM(nn.Module):
    hidden: int = 32

    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.LSTMCell(self.hidden), name="rnn")(x)  # nn.scan over time
        return nn.Dense(8, name="head")(h[:, -1])


LSTM_TP = ((r"cell/i[ifgo]/kernel", -1), (r"cell/h[ifgo]/kernel", -1), (r"cell/h[ifgo]/bias", 0))


@functools.cache
def program_lstm() -> Program:
    model = LinenLSTM()
    r = rng(5)
    x, labels = normal(r, (16, 8, 16)), r.integers(0, 8, (16,)).astype(np.int32)
    params = model.init(jax.random.key(0), x)["params"]

    def loss(params, x, labels):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return train_program(params, optax.adam(1e-3), loss, (x, labels), LSTM_TP)
