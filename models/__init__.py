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
