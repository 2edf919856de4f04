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

The package: ``config_mapping`` (config.json to and from ModelConfig) and ``weights`` (the
tensors: reading them into parameters, writing a model out).
"""

from .config_mapping import (
    ARCHITECTURES,
    INDEX_FILE,
    SINGLE_FILE,
    HFCheckpointError,
    config_from_hf,
    config_to_hf,
    read_config,
)
from .weights import load, load_model, save

__all__ = [
    "ARCHITECTURES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFCheckpointError",
    "config_from_hf",
    "config_to_hf",
    "read_config",
    "load",
    "load_model",
    "save",
]
