"""The one place the models call attention. Layout [batch, seq, heads, head_dim]; GQA when the
query has a multiple of the key/value heads."""
import jax


def attention(q, k, v, *, causal: bool, impl: str = "ops"):
    """``impl="ops"``: shardflow.ops.attention, the entry point shardflow's passes recognise.
    ``impl="jax"``: jax.nn.dot_product_attention directly (cuDNN on GPU) — the plain-JAX
    reference the benchmarks compare against."""
    if impl == "jax":
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    if impl != "ops":
        raise ValueError(f"unknown attention impl {impl!r} (choose 'ops' or 'jax')")
    try:
        from shardflow import ops
    except ImportError:
        # Temporary: shardflow/ops.py (the attention issue) is being written concurrently.
        # Fall back to JAX's attention ONLY while that module is missing; remove when it lands.
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    return ops.attention(q, k, v, causal=causal)
