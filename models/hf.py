"""Hugging Face checkpoints in and out: LlamaForCausalLM, MistralForCausalLM, GPT2LMHeadModel.

    cfg, params = hf.load("llama-dir", mesh=mesh, rules="tp")   # placed as the rules say
    model = hf.load_model("llama-dir")                           # an nnx Llama, ready to call
    hf.save("out-dir", model)          # AutoModelForCausalLM.from_pretrained("out-dir") loads it

A Hugging Face model directory is ``config.json`` plus ``model.safetensors``, or several
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``; tensors are read and
written with the ``safetensors`` package's numpy API (bfloat16 and float16 checkpoints load
too: parameters are converted to ``dtype``, float32 by default).

Layout. Hugging Face's ``nn.Linear`` weights are [out, in]; ours are [in, out] with the heads
dimension kept apart ([embed, heads, head_dim]) and the layers stacked on a leading depth
dimension, so each weight is transposed, reshaped and stacked. GPT-2's ``Conv1D`` weights are
already [in, out]; its fused ``c_attn`` is split into q, k and v. RoPE needs no permutation:
Hugging Face's Llama rotates halves of each head (``rotate_half``, the checkpoints' q/k weights
were permuted for it once, at conversion from Meta's interleaved layout) and so does
``models.llama.apply_rope``, with the same frequencies.

Exactness. Logits equal transformers' own (float32) up to rounding. Two things are refused
rather than approximated:

- Any config.json key that changes the computation and that the models do not implement
  (``rope_scaling``, ``attention_bias``, ``quantization_config``, an unknown key, ...): a
  :class:`HFCheckpointError` names it. Dropout rates are read and not applied: shardflow's
  models and trainer are dropout-free (inference is unaffected).
- Mistral's ``sliding_window``: the attention has no window, so the imported config carries
  ``sliding_window`` and the model refuses sequences longer than it; within the window a causal
  attention is exactly the windowed one. (``sliding_window: null`` imports as plain Llama.)

Sharding. ``load`` places every parameter directly in its NamedSharding on a given mesh, from
the model's logical axes and a rules table (``models.param_specs``): each device gets its slice
of the host copy of one stacked tensor at a time. ``save`` gathers each parameter from whatever
sharding it has (across processes too); process 0 writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from .config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "GPT2LMHeadModel": "gpt2"}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel"}


class HFCheckpointError(ValueError):
    """A Hugging Face directory that cannot be read exactly into a shardflow model."""


# --- config.json ---------------------------------------------------------------------------

# Keys of every Hugging Face config that do not change the model's logits.
_NEUTRAL_KEYS = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "chunk_size_feed_forward",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "finetuning_task",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "initializer_range",
    "_attn_implementation_autoset",
    "attn_implementation",
    # generation defaults some configs carry
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
}
# Keys that must hold the value the models implement (absent: the Hugging Face default, the same).
_GENERIC_REQUIRED = {
    "is_encoder_decoder": (False,),
    "is_decoder": (False, True),
    "add_cross_attention": (False,),
    "tie_encoder_decoder": (False,),
    "pruned_heads": ({},),
    "cross_attention_hidden_size": (None,),
}
_LLAMA_REQUIRED = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,), "rope_scaling": (None,)}
_LLAMA_READ = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_dropout",
    "pretraining_tp",
}  # pretraining_tp: the same sums, sliced
_GPT2_REQUIRED = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "tie_word_embeddings": (True,),
}
_GPT2_READ = {
    "vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_positions",
    "n_ctx",
    "layer_norm_epsilon",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "reorder_and_upcast_attn",  # float32 softmax either way: the same values
    # the summary_* keys configure GPT2DoubleHeadsModel's classifier, not the LM
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
}


def architecture(hf_config: Mapping) -> str:
    """ "llama", "mistral" or "gpt2" for a config.json; an HFCheckpointError for anything else."""
    archs = hf_config.get("architectures") or []
    if not archs and hf_config.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[hf_config["model_type"]]]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        named = archs or [f"model_type {hf_config.get('model_type')!r}"]
        raise HFCheckpointError(
            f"config.json: architecture {', '.join(map(str, named))} is not supported; "
            f"shardflow.models.hf reads {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[archs[0]]


def _check_keys(hf_config: Mapping, kind: str, read: set, required: dict) -> None:
    required = {**_GENERIC_REQUIRED, **required}
    for key, value in hf_config.items():
        if key in required:
            if value not in required[key]:
                allowed = " or ".join(json.dumps(v) for v in required[key])
                raise HFCheckpointError(
                    f"config.json: {key} = {json.dumps(value)} is not supported for {kind} "
                    f"(shardflow's model computes {key} = {allowed})"
                )
        elif key not in read and key not in _NEUTRAL_KEYS:
            raise HFCheckpointError(
                f"config.json: key {key!r} (= {json.dumps(value)}) is not supported for {kind}: "
                "shardflow's model does not implement it, and ignoring it could change the "
                "model's outputs"
            )


def _rope_theta(hf_config: Mapping) -> float:
    """rope_theta from either spelling: top-level ``rope_theta`` (+ ``rope_scaling``), or
    ``rope_parameters`` {rope_type, rope_theta}."""
    params = hf_config.get("rope_parameters")
    if params is None:
        return float(hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise HFCheckpointError(
            f"config.json: rope_parameters.rope_type = {json.dumps(rope_type)} "
            "is not supported (shardflow's RoPE is the default one)"
        )
    for key, value in params.items():
        if key not in ("rope_type", "rope_theta"):
            raise HFCheckpointError(
                f"config.json: key 'rope_parameters.{key}' (= "
                f"{json.dumps(value)}) is not supported (shardflow's RoPE is "
                "the default one)"
            )
    return float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))


def config_from_hf(hf_config: Mapping) -> ModelConfig:
    """Our ModelConfig for a config.json's contents (absent keys take Hugging Face's defaults)."""
    arch = architecture(hf_config)
    c = hf_config
    if arch == "gpt2":
        _check_keys(c, "GPT2LMHeadModel", _GPT2_READ, _GPT2_REQUIRED)
        d, heads = c.get("n_embd", 768), c.get("n_head", 12)
        if d % heads:
            raise HFCheckpointError(f"config.json: n_embd {d} is not a multiple of n_head {heads}")
        return ModelConfig(
            family="gpt2",
            vocab_size=c.get("vocab_size", 50257),
            d_model=d,
            n_layers=c.get("n_layer", 12),
            n_heads=heads,
            n_kv_heads=heads,
            head_dim=d // heads,
            ffn_dim=c.get("n_inner") or 4 * d,
            max_seq_len=c.get("n_positions", 1024),
            norm_eps=c.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=True,
            init_std=c.get("initializer_range", 0.02),
        )
    kind = "MistralForCausalLM" if arch == "mistral" else "LlamaForCausalLM"
    _check_keys(c, kind, _LLAMA_READ | ({"sliding_window"} if arch == "mistral" else set()), _LLAMA_REQUIRED)
    mistral = arch == "mistral"
    d = c.get("hidden_size", 4096)
    heads = c.get("num_attention_heads", 32)
    return ModelConfig(
        family="llama",
        vocab_size=c.get("vocab_size", 32000),
        d_model=d,
        n_layers=c.get("num_hidden_layers", 32),
        n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or d // heads,
        ffn_dim=c.get("intermediate_size", 14336 if mistral else 11008),
        max_seq_len=c.get("max_position_embeddings", 4096 * 32 if mistral else 2048),
        rope_theta=_rope_theta(c),
        norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        sliding_window=c.get("sliding_window", 4096) if mistral else None,
        init_std=c.get("initializer_range", 0.02),
    )


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """config.json's contents for our config: GPT2LMHeadModel, or Llama (Mistral where the
    config has a sliding window)."""
    if cfg.family == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.ffn_dim,
            "n_positions": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new",
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,  # ours has no dropout
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": True,
            "torch_dtype": dtype,
        }
    mistral = cfg.sliding_window is not None
    out = {
        "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
        "model_type": "mistral" if mistral else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
    }
    if mistral:
        out["sliding_window"] = cfg.sliding_window
    else:
        out["mlp_bias"] = False
    return out


def read_config(directory) -> ModelConfig:
    """Our ModelConfig for a Hugging Face model directory's config.json."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise HFCheckpointError(f"{directory} is not a Hugging Face model directory (no config.json)")
    try:
        hf_config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path} is not JSON: {e}") from None
    return config_from_hf(hf_config)


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

    from . import build

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

    from .sharding import get_rules, param_specs

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
