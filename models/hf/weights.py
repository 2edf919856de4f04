"""The tensors of a Hugging Face checkpoint to and from the models' parameters: each weight
transposed, reshaped and stacked over the layers as ``_Tensor`` says; ``load`` places them in
their shardings as it reads, ``save`` gathers and writes them (process 0)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from .config_mapping import INDEX_FILE, SINGLE_FILE, HFCheckpointError, config_to_hf, read_config

# --- the tensors ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One Hugging Face tensor name (with ``{i}`` for a layer's index) and the parameters of
    ours it holds: ``split`` turns the HF tensor into ours, ``join`` ours back into it. Per-layer
    tensors map to our stacked parameters' slices."""

    name: str
    ours: tuple[tuple[str, ...], ...]
    split: Callable[[np.ndarray], tuple]
    join: Callable[..., np.ndarray]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name


def _same(name, path):
    return _Tensor(name, (path,), lambda w: (w,), lambda x: x)


def _linear(name, path, in_shape, out_shape):
    """An [out, in] nn.Linear weight held as our [*in_shape, *out_shape]."""
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    return _Tensor(name, (path,), lambda w: (w.T.reshape(*in_shape, *out_shape),), lambda x: x.reshape(n_in, n_out).T)


def _llama_tensors(cfg: ModelConfig) -> list[_Tensor]:
    d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    layer = "model.layers.{i}."
    tensors = [
        _same("model.embed_tokens.weight", ("embedding",)),
        _same("model.norm.weight", ("final_norm", "scale")),
        _same(layer + "input_layernorm.weight", ("layers", "attn_norm", "scale")),
        _same(layer + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale")),
        _linear(layer + "self_attn.q_proj.weight", ("layers", "attn", "wq"), (d,), (h, hd)),
        _linear(layer + "self_attn.k_proj.weight", ("layers", "attn", "wk"), (d,), (kv, hd)),
        _linear(layer + "self_attn.v_proj.weight", ("layers", "attn", "wv"), (d,), (kv, hd)),
        _linear(layer + "self_attn.o_proj.weight", ("layers", "attn", "wo"), (h, hd), (d,)),
        _linear(layer + "mlp.gate_proj.weight", ("layers", "mlp", "w_gate"), (d,), (f,)),
        _linear(layer + "mlp.up_proj.weight", ("layers", "mlp", "w_up"), (d,), (f,)),
        _linear(layer + "mlp.down_proj.weight", ("layers", "mlp", "w_down"), (f,), (d,)),
    ]
    if not cfg.tie_embeddings:
        tensors.append(_linear("lm_head.weight", ("lm_head",), (d,), (cfg.vocab_size,)))
    return tensors


def _gpt2_tensors(cfg: ModelConfig) -> list[_Tensor]:
    layer = "transformer.h.{i}."
    qkv = lambda part: tuple(("layers", x, part) for x in ("q", "k", "v"))  # noqa: E731
    split3 = lambda w: tuple(np.split(w, 3, axis=-1))  # noqa: E731
    concat = lambda *xs: np.concatenate(xs, axis=-1)  # noqa: E731
    tensors = [
        _same("transformer.wte.weight", ("wte", "embedding")),
        _same("transformer.wpe.weight", ("wpe", "embedding")),
        _same("transformer.ln_f.weight", ("ln_f", "scale")),
        _same("transformer.ln_f.bias", ("ln_f", "bias")),
        _Tensor(layer + "attn.c_attn.weight", qkv("kernel"), split3, concat),
        _Tensor(layer + "attn.c_attn.bias", qkv("bias"), split3, concat),
    ]
    # Conv1D weights are [in, out], as ours.
    for hf_name, ours in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
        tensors += [
            _same(f"{layer}{hf_name}.weight", ("layers", ours, "scale")),
            _same(f"{layer}{hf_name}.bias", ("layers", ours, "bias")),
        ]
    for hf_name, ours in (("attn.c_proj", "proj"), ("mlp.c_fc", "fc"), ("mlp.c_proj", "fc_proj")):
        tensors += [
            _same(f"{layer}{hf_name}.weight", ("layers", ours, "kernel")),
            _same(f"{layer}{hf_name}.bias", ("layers", ours, "bias")),
        ]
    return tensors


def _tensors(cfg: ModelConfig) -> list[_Tensor]:
    return _gpt2_tensors(cfg) if cfg.family == "gpt2" else _llama_tensors(cfg)


# Buffers older checkpoints saved that are not parameters: RoPE frequencies, GPT-2's causal mask.
_BUFFERS = re.compile(r"(\.rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")


class _Reader:
    """The tensors of a model directory by name, read on demand from one or many files; names
    may lack the base model's prefix ("model." / "transformer."), as some checkpoints have."""

    def __init__(self, directory: Path, prefix: str, stack: contextlib.ExitStack):
        from safetensors import safe_open

        index = directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{index} is not a safetensors index ({e})") from None
        elif (directory / SINGLE_FILE).is_file():
            weight_map = None
        else:
            found = sorted(p.name for p in directory.iterdir())
            raise HFCheckpointError(
                f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE} (it holds "
                f"{', '.join(found) or 'nothing else'}; .bin / .pt checkpoints are not read)"
            )
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self._handles, self._where = {}, {}
        for file in files:
            if not (directory / file).is_file():
                raise HFCheckpointError(f"{directory / file} (named by {INDEX_FILE}) is missing")
            handle = stack.enter_context(safe_open(str(directory / file), framework="np"))
            self._handles[file] = handle
            for name in handle.keys():
                self._where[name] = file
        self._bare = not any(n.startswith(prefix) for n in self._where)
        self._prefix = prefix
        self.unread = set(self._where)

    def _stored_name(self, name: str) -> str:
        return name[len(self._prefix) :] if self._bare and name.startswith(self._prefix) else name

    def get(self, name: str, shape: tuple) -> np.ndarray:
        stored = self._stored_name(name)
        if stored not in self._where:
            raise HFCheckpointError(f"the checkpoint has no tensor {name!r}")
        array = self._handles[self._where[stored]].get_tensor(stored)
        if tuple(array.shape) != tuple(shape):
            raise HFCheckpointError(
                f"tensor {name!r} has shape {tuple(array.shape)}, but config.json makes it {tuple(shape)}"
            )
        self.unread.discard(stored)
        return array


def _pure_dict_leaves(tree, path=()):
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _pure_dict_leaves(value, path + (key,))
    else:
        yield path, tree


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _abstract_model(cfg: ModelConfig):
    from flax import nnx

    from .. import build

    return nnx.eval_shape(lambda: build(cfg))


def load(directory, *, mesh=None, rules="dp", dtype=None) -> tuple[ModelConfig, dict]:
    """(config, parameters) of a Hugging Face model directory.

    The parameters are a nested dict shaped like ``nnx.to_pure_dict(nnx.state(model,
    nnx.Param))`` of ``models.build(config)`` — what the trainer's checkpoints hold and
    ``nnx.merge`` takes. With ``mesh``, each is placed in the NamedSharding that ``rules``
    (a strategy name of ``models.LOGICAL_AXIS_RULES`` or a table) gives its logical axes; a dimension that
    does not divide over its mesh axes is a ValueError naming the parameter. ``dtype``: the
    parameters' dtype (default float32, whatever the checkpoint stores)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from ..sharding import get_rules, param_specs

    directory = Path(directory)
    cfg = read_config(directory)
    dtype = jnp.dtype(dtype or jnp.float32)
    abstract = _abstract_model(cfg)
    shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    specs = param_specs(abstract, get_rules(rules), mesh) if mesh is not None else None

    def place(path, host):
        want = _get(shapes, path).shape
        assert host.shape == want, (path, host.shape, want)  # the table and the model agree
        host = np.asarray(host, dtype)
        if mesh is None:
            return jax.device_put(host)
        sharding = NamedSharding(mesh, _get(specs, path))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    prefix = "transformer." if cfg.family == "gpt2" else "model."
    params: dict = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(directory, prefix, stack)
        for tensor in _tensors(cfg):
            joined_shape = _hf_shape(tensor, shapes)
            layers = range(cfg.n_layers) if tensor.per_layer else [None]
            parts = [tensor.split(reader.get(tensor.name.format(i=i), joined_shape)) for i in layers]
            for k, path in enumerate(tensor.ours):
                host = np.stack([p[k] for p in parts]) if tensor.per_layer else parts[0][k]
                _set(params, path, place(path, host))
        _check_leftovers(reader, cfg, params)
    return cfg, params


def _hf_shape(tensor: _Tensor, shapes: dict) -> tuple:
    """The Hugging Face tensor's shape, from our parameters' (one layer's, where stacked)."""
    ours = [np.broadcast_to(np.int8(0), _get(shapes, p).shape[1 if tensor.per_layer else 0 :]) for p in tensor.ours]
    return tensor.join(*ours).shape


def _check_leftovers(reader: _Reader, cfg: ModelConfig, params: dict) -> None:
    leftover = sorted(n for n in reader.unread if not _BUFFERS.search(n))
    if cfg.tie_embeddings and "lm_head.weight" in leftover:
        # A tied checkpoint that stores its head anyway: fine where it is the embedding.
        head = reader.get("lm_head.weight", (cfg.vocab_size, cfg.d_model))
        embedding = params["wte"]["embedding"] if cfg.family == "gpt2" else params["embedding"]
        if not np.array_equal(head, np.asarray(embedding).astype(head.dtype)):
            raise HFCheckpointError(
                "config.json ties the embeddings (tie_word_embeddings) but "
                "the checkpoint's lm_head.weight differs from the embedding"
            )
        leftover.remove("lm_head.weight")
    if leftover:
        shown = ", ".join(leftover[:5]) + (f", ... ({len(leftover)} in all)" if len(leftover) > 5 else "")
        raise HFCheckpointError(f"the checkpoint holds tensors the model has no place for: {shown}")


def load_model(directory, *, mesh=None, rules="dp", dtype=None):
    """The nnx model (Llama or GPT2) of a Hugging Face directory; see :func:`load`."""
    from flax import nnx

    cfg, params = load(directory, mesh=mesh, rules=rules, dtype=dtype)
    graphdef, _ = nnx.split(_abstract_model(cfg))
    return nnx.merge(graphdef, params)


# --- export --------------------------------------------------------------------------------


def _to_host(x) -> np.ndarray:
    """The whole array on the host, gathered from any sharding (across processes too)."""
    import jax

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def save(directory, model, *, max_shard_bytes: int = 5 << 30) -> Path:
    """Write an nnx Llama / GPT2 (ours, any sharding) as a Hugging Face model directory that
    ``AutoModelForCausalLM.from_pretrained`` loads: config.json and model.safetensors, or
    ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` each (a larger
    single tensor gets a file to itself) with their index. Tensors keep the parameters' dtype.
    In a multi-process run every process must call it (the gathers are collective); process 0
    writes. Returns the directory."""
    import jax
    from flax import nnx
    from safetensors.numpy import save_file

    cfg: ModelConfig = model.cfg
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    host = {path: _to_host(x) for path, x in _pure_dict_leaves(params)}
    dtypes = {str(x.dtype) for x in host.values()}
    if len(dtypes) != 1:
        raise ValueError(f"the parameters have several dtypes ({sorted(dtypes)}); cast them to one before saving")
    tensors: dict[str, np.ndarray] = {}
    for tensor in _tensors(cfg):
        ours = [host[path] for path in tensor.ours]
        for i in range(cfg.n_layers) if tensor.per_layer else [None]:
            parts = [x[i] for x in ours] if tensor.per_layer else ours
            tensors[tensor.name.format(i=i)] = np.ascontiguousarray(tensor.join(*parts))
    if jax.process_index() != 0:
        return Path(directory)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_to_hf(cfg, dtypes.pop()), indent=2) + "\n")
    for stale in [directory / SINGLE_FILE, directory / INDEX_FILE, *directory.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    shards: list[dict] = [{}]
    for name, array in tensors.items():
        size = sum(a.nbytes for a in shards[-1].values())
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = array
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata=metadata)
        return directory
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(a.nbytes for a in tensors.values())
    (directory / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return directory
