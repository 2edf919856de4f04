"""The one place the models call attention. Layout [batch, seq, heads, head_dim]; GQA when the
query has a multiple of the key/value heads."""
import jax

from shardflow import ops


def attention(q, k, v, *, causal: bool, impl: str = "ops"):
    """``impl="ops"``: shardflow.ops.attention, the entry point shardflow's passes recognise.
    ``impl="jax"``: jax.nn.dot_product_attention directly (cuDNN on GPU) — only for the
    plain-JAX reference the benchmarks compare against."""
    if impl == "ops":
        return ops.attention(q, k, v, causal=causal)
    if impl == "jax":
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    raise ValueError(f"unknown attention impl {impl!r} (choose 'ops' or 'jax')")
