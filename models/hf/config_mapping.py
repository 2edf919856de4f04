"""config.json to and from ModelConfig: the architectures read, the keys that change the
computation checked (refused where the models do not implement them), the rest mapped."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from ..config import ModelConfig

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
