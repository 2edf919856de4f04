"""The one place the models call attention. Layout [batch, seq, heads, head_dim]; GQA when the
query has a multiple of the key/value heads."""

import jax

import shardflow.attention


def attention(q, k, v, *, causal: bool, impl: str = "ops", context: str = "auto", layout=None):
    """``impl="ops"``: shardflow.attention.attention, the entry point shardflow's passes recognise.
    ``impl="jax"`` / ``"cudnn"``: jax.nn.dot_product_attention directly (JAX's choice of
    implementation / cuDNN forced) — only for the plain-JAX reference the benchmarks compare
    against. ``context``: how the keys reach each query block where the sequence is split over
    a mesh axis (shardflow.attention.attention's), ``layout`` the tokens' order
    (shardflow.attention.Layout or None)."""
    if impl == "ops":
        return shardflow.attention.attention(q, k, v, causal=causal, context=context, layout=layout)
    if layout is not None:
        raise ValueError(f"attention impl {impl!r} takes no token layout ({layout.kind})")
    if impl == "jax":
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    raise ValueError(f"unknown attention impl {impl!r} (choose 'ops', 'jax' or 'cudnn')")
