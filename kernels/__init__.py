"""Kernels behind shardflow's attention and mixture-of-experts (installed as ``shardflow.kernels``).

Attention: `attention_xla` (blockwise XLA reference), `flash_attention_gpu` (Pallas, Triton
lowering), `flash_attention_mgpu` (its Hopper fast path, Mosaic GPU), `flash_attention_tpu`
(Pallas, Mosaic TPU). The public entry point is `shardflow.attention.attention`; conventions
shared by the kernels are in `attention_common`. Experts: `grouped_matmul_mgpu` (grouped GEMMs
on Hopper, Mosaic GPU).
"""

import jax


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.0)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        return getattr(jax.devices()[0], "compute_capability", "") == "9.0"
    except RuntimeError:
        return False
