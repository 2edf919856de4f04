"""The optax programs of gspmd_programs.py: an MLP trained by each of several optimizers, and
the cross-entropy losses."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from flax import nnx
from gspmd_models import MLP, MLP_TP, pure_state
from gspmd_specs import ALL, Program, normal, rng, train_program
from jax.sharding import PartitionSpec as PS

# ------------------------------------------------------------------------------ optax optimizers


def _optimizer(name):
    clip = optax.clip_by_global_norm(1.0)
    if name == "adamw":
        inner = optax.adamw(optax.warmup_cosine_decay_schedule(1e-4, 1e-3, 10, 100), weight_decay=0.01)
    elif name == "adafactor":  # factored second moments for the matrices (min_dim_size_to_factor)
        inner = optax.adafactor(optax.linear_schedule(1e-2, 1e-3, 100), min_dim_size_to_factor=16)
    elif name == "lion":
        inner = optax.lion(optax.cosine_decay_schedule(1e-3, 100), weight_decay=0.01)
    elif name == "lamb":
        inner = optax.lamb(optax.exponential_decay(1e-3, 10, 0.9), weight_decay=0.01)
    elif name == "muon":  # Newton-Schulz on the matrices, adam on the biases
        inner = optax.contrib.muon(optax.warmup_constant_schedule(1e-4, 2e-2, 10))
    else:
        raise ValueError(name)
    return optax.chain(clip, inner)


@functools.cache
def program_optimizer(name) -> Program:
    graphdef, (params,) = pure_state(MLP(nnx.Rngs(0)), nnx.Param)
    r = rng(6)
    x, labels = normal(r, (16, 32)), r.integers(0, 16, (16,)).astype(np.int32)

    def loss(params, x, labels):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return train_program(params, _optimizer(name), loss, (x, labels), MLP_TP)


# ------------------------------------------------------------------------------ optax losses


def _logits_spec(strategy):
    return {"dp": PS(ALL, None, None), "tp": PS(None, None, "model"), "2d": PS("data", None, "model")}[strategy]


def case_ce_integer(strategy):
    """optax.softmax_cross_entropy_with_integer_labels and its gradient, the vocab dim split."""
    r = rng(7)
    logits, labels = normal(r, (8, 16, 128), 3.0), r.integers(0, 128, (8, 16)).astype(np.int32)

    def fn(logits, labels):
        return jax.value_and_grad(lambda z: optax.softmax_cross_entropy_with_integer_labels(z, labels).mean())(logits)

    spec = _logits_spec(strategy)
    return fn, (logits, labels), (spec, PS(*spec[:2])), (PS(), spec)


def case_ce_onehot(strategy):
    """optax.softmax_cross_entropy on smoothed one-hot labels, the vocab dim split."""
    r = rng(8)
    logits = normal(r, (8, 16, 128), 3.0)
    labels = optax.smooth_labels(jax.nn.one_hot(r.integers(0, 128, (8, 16)), 128), 0.1)
    labels = np.asarray(labels, np.float32)

    def fn(logits, labels):
        return jax.value_and_grad(lambda z: optax.softmax_cross_entropy(z, labels).mean())(logits)

    spec = _logits_spec(strategy)
    return fn, (logits, labels), (spec, spec), (PS(), spec)
