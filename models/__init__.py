"""Annotated language models for shardflow: Llama-style and GPT-2-style, in Flax NNX."""

__all__ = [
    "GPT2",
    "Llama",
    "ModelConfig",
    "PRESETS",
    "PipelineConfig",
    "REMAT_POLICIES",
    "LOGICAL_AXIS_RULES",
    "STACKED_AXIS",
    "activation_sharding",
    "build",
    "check_rules",
    "constrain",
    "count_params",
    "for_compute",
    "get_rules",
    "logical_axes",
    "param_logical_axes",
    "param_specs",
    "preset",
    "spec_for",
    "with_pipeline",
]
from .config import PRESETS, REMAT_POLICIES, ModelConfig, preset
from .gpt2 import GPT2
from .llama import Llama
from .pipeline import PipelineConfig
from .sharding import (
    LOGICAL_AXIS_RULES,
    STACKED_AXIS,
    activation_sharding,
    check_rules,
    constrain,
    get_rules,
    logical_axes,
    param_logical_axes,
    param_specs,
    spec_for,
    with_pipeline,
)


def build(cfg: ModelConfig, seed: int = 0):
    """A freshly initialised model of the config's family."""
    from flax import nnx

    cls = {"llama": Llama, "gpt2": GPT2}[cfg.family]
    # Placement is the trainer's decision: nnx.with_partitioning only records logical axes.
    with nnx.use_eager_sharding(False):
        return cls(cfg, rngs=nnx.Rngs(seed))


def count_params(model) -> int:
    import jax
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def for_compute(graphdef, params, dtype):
    """The model of ``graphdef`` holding ``params`` (float32 master weights) cast to ``dtype``
    for the forward and backward, except variables made with ``keep_dtype=True``: Llama's norm
    scales, used in float32 by a norm that computes in float32 anyway. A bfloat16 copy of those
    would round each layer's scale gradient to bfloat16, and a gradient partial over the data
    axis would have to be reduced inside the layer loop before that rounding, two small
    all-reduces per layer, where the other gradients are reduced once after it."""
    from flax import nnx

    model = nnx.merge(graphdef, params)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable) and not var.get_metadata().get("keep_dtype"):
            var.value = var.value.astype(dtype)
    return model
