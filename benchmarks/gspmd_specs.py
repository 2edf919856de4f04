"""The mesh, the strategies' PartitionSpecs of a program's parameters, optimizer state and
batch, and ``Program``: a training step and its specs under each strategy (gspmd_programs.py)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as PS

MESH_SHAPE = {"data": 2, "model": 4}
ALL = ("data", "model")  # every device
STRATEGIES = ("dp", "fsdp", "tp", "2d")


@functools.cache
def mesh():
    import shardflow as sf

    return sf.make_mesh(MESH_SHAPE)


# ------------------------------------------------------------------------------ specs


def _ways(axes) -> int:
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(MESH_SHAPE[a] for a in axes)


def _largest_dim(shape, ways, taken=()):
    """The largest dim of shape that ``ways`` divides (the first of equals), or None."""
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if d not in taken and shape[d] >= ways and shape[d] % ways == 0:
            return d
    return None


def _spec(ndim, splits: dict) -> PS:
    return PS(*[splits.get(d) for d in range(ndim)])


def param_spec(path: str, shape, strategy: str, tp_rules=()) -> PS:
    """The spec of the parameter at ``path`` (``a/b/kernel``). ``tp_rules``: (regex, dim) pairs,
    the first match names the dim Megatron splits over 'model'."""
    ndim = len(shape)
    if strategy == "dp" or ndim == 0:
        return PS()
    if strategy == "fsdp":
        d = _largest_dim(shape, _ways(ALL))
        return _spec(ndim, {} if d is None else {d: ALL})
    splits = {}
    for pattern, dim in tp_rules:
        if re.search(pattern, path):
            dim = dim % ndim
            if shape[dim] % _ways("model") == 0:
                splits[dim] = "model"
            break
    if strategy == "2d":
        d = _largest_dim(shape, _ways("data"), taken=tuple(splits))
        if d is not None:
            splits[d] = "data"
    return _spec(ndim, splits)


def param_specs(params, strategy, tp_rules=()):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: param_spec(jax.tree_util.keystr(p, simple=True, separator="/"), np.shape(x), strategy, tp_rules),
        params,
    )


def _fits(spec: PS, shape) -> bool:
    if len(spec) > len(shape):
        return False
    return all(a is None or shape[d] % _ways(a) == 0 for d, a in enumerate(spec))


def _keys(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def opt_specs(opt_state, params, p_specs):
    """Optimizer state lies like its parameter where it has the parameter's shape (moments): a
    state leaf whose key path ends with a parameter's key path and has its shape takes its spec;
    factored, scalar or count state is replicated. (Path matching rather than
    optax.tree_map_params, which does not see through every optimizer's state: muon's.)"""
    by_path = {}
    for (path, x), spec in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(p_specs, is_leaf=lambda s: isinstance(s, PS))
    ):
        by_path[_keys(path)] = (np.shape(x), spec)

    def spec_of(path, leaf):
        keys = _keys(path)
        for n in range(len(keys)):
            hit = by_path.get(keys[n:])
            if hit is not None and hit[0] == np.shape(leaf):
                return hit[1]
        return PS()

    return jax.tree_util.tree_map_with_path(spec_of, opt_state)


def batch_spec(strategy, ndim) -> PS:
    return PS(ALL if strategy in ("dp", "fsdp") else "data", *([None] * (ndim - 1)))


def rng(seed):
    return np.random.default_rng(seed)


def normal(r, shape, scale=1.0):
    return (r.standard_normal(shape) * scale).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Program:
    """A single-device function, its arguments (the same under every strategy), and
    ``specs(strategy) -> (in_specs, out_specs)``."""

    fn: Callable
    args: tuple
    specs: Callable


def train_program(params, optimizer, loss_fn, batch, tp_rules=(), aux_specs=None, batch_specs=None) -> Program:
    """``params, opt_state, *batch -> params, opt_state, loss[, aux]``: one optimizer step.
    ``aux_specs(strategy)``: loss_fn returns (loss, aux), aux an output with these specs.
    ``batch_specs(strategy)``: the batch's specs (default: dim 0 as the strategy splits batches)."""
    # Mid-training weights: no parameter starts at zero (a zero bias after one Adam step is
    # lr * sign(grad), whose small entries are rounding noise on any engine).
    r = rng(99)
    params = jax.tree.map(lambda p: np.asarray(p) + normal(r, np.shape(p), 0.05), params)
    opt_state = jax.device_get(optimizer.init(params))
    grad = jax.value_and_grad(loss_fn, has_aux=aux_specs is not None)

    def step(params, opt_state, *batch):
        out, grads = grad(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, *((out,) if aux_specs is None else out))

    def specs(strategy):
        ps = param_specs(params, strategy, tp_rules)
        os_ = opt_specs(opt_state, params, ps)
        bs = batch_specs(strategy) if batch_specs else tuple(batch_spec(strategy, np.ndim(b)) for b in batch)
        outs = (ps, os_, PS()) if aux_specs is None else (ps, os_, PS(), aux_specs(strategy))
        return (ps, os_, *bs), outs

    return Program(step, (params, opt_state, *batch), specs)
