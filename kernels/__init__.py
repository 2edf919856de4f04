"""Kernels behind shardflow's attention (installed as ``shardflow.kernels``).

Attention: `attention_xla` (blockwise XLA reference), `flash_attention_gpu` (Pallas, Triton
lowering), `flash_attention_tpu` (Pallas, Mosaic TPU). The public entry point is
`shardflow.attention.attention`; conventions shared by the kernels are in `attention_common`.
"""
