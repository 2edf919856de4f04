"""`attention`, the one attention entry point of shardflow and of its models.

It runs as the primitives of `shardflow.attention_primitives` (one forward, one backward under
differentiation), which shardflow's passes lay out by their rule in `shardflow.attention_rule`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from shardflow import attention_rule  # noqa: F401  (registers the primitives' sharding rule)
from shardflow.attention_primitives import (
    CONTEXTS,
    AttentionConfig,
    implementation_of,
    sf_attention_bwd_p,
    sf_attention_fwd_p,
)
from shardflow.ring_attention import Layout


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config, q, k, v, extras):
    return tuple(sf_attention_fwd_p.bind(q, k, v, *extras, config=config))


def _attention_fwd(config, q, k, v, extras):
    out, lse = sf_attention_fwd_p.bind(q, k, v, *extras, config=config)
    return (out, lse), (q, k, v, extras, out, lse)


def _attention_bwd(config, residuals, cotangents):
    q, k, v, extras, out, lse = residuals
    dout, dlse = cotangents
    bwd_extras = tuple(extras) + ((dlse,) if config.has_dlse else ())
    dq, dk, dv = sf_attention_bwd_p.bind(q, k, v, out, lse, dout.astype(out.dtype), *bwd_extras, config=config)
    # Integer operands (segment ids, offsets) get no cotangent.
    return dq, dk, dv, tuple(None for _ in extras)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_shapes(q, k, v, segment_ids):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention: q, k, v must be [batch, seq, heads, head_dim], got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"attention: k and v must have the same shape, got {k.shape} and {v.shape}")
    batch, _, heads_q, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"attention: batch and head_dim of q {q.shape} and k {k.shape} differ")
    if heads_q % k.shape[2]:
        raise ValueError(
            f"attention: heads_q={heads_q} is not a multiple of heads_kv={k.shape[2]} (q {q.shape}, k {k.shape})"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"attention: dtype must be bfloat16, float16 or float32, got {q.dtype}")
    if segment_ids is not None:
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"attention: segment_ids must be integers, got {segment_ids.dtype}")
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"attention: segment_ids need seq_q == seq_kv, got q {q.shape}, k {k.shape}")
        if segment_ids.shape != q.shape[:2]:
            raise ValueError(f"attention: segment_ids must be [batch, seq] = {q.shape[:2]}, got {segment_ids.shape}")


def _cudnn_attention(q, k, v, *, causal, scale, segment_ids, q_offset, kv_offset, return_lse):
    """jax.nn.dot_product_attention(implementation="cudnn"), for comparison only.

    It keeps JAX's own custom VJP (cuDNN's backward) and is not wrapped in the sf_attention_*
    contract, since cuDNN through jax.nn returns no lse.
    """
    if return_lse:
        raise ValueError("attention: backend='cudnn' cannot return lse")
    if segment_ids is not None:
        raise ValueError("attention: backend='cudnn' does not take segment_ids here")
    if causal and not (
        isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset - kv_offset == 0
        and q.shape[1] == k.shape[1]
    ):
        raise ValueError(
            "attention: backend='cudnn' supports causal only with equal q/kv lengths and q_offset == kv_offset"
        )
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    segment_ids=None,
    q_offset=0,
    kv_offset=0,
    return_lse: bool = False,
    backend: str = "auto",
    context: str = "auto",
    layout=None,
):
    """Softmax attention over [batch, seq, heads, head_dim] inputs, with GQA/MQA.

    Args:
      q: [batch, seq_q, heads_q, head_dim]; k, v: [batch, seq_kv, heads_kv, head_dim] with
        heads_q a multiple of heads_kv (q head h uses kv head h // (heads_q // heads_kv)).
        bfloat16, float16 or float32, all the same dtype.
      causal: query at global position q_offset + i sees keys at kv_offset + j <= q_offset + i.
      scale: logit scale, default 1 / sqrt(head_dim).
      segment_ids: optional int [batch, seq] (seq_q == seq_kv); queries see only keys of the same
        segment (packed documents).
      q_offset, kv_offset: global positions of the first query / key (Python ints or traced int
        scalars), e.g. for one step of ring attention.
      return_lse: also return lse [batch, heads_q, seq_q], float32, natural log.
      backend: "auto" (on Hopper GPUs the Mosaic GPU kernels where they apply, else XLA with a
        warning naming why; Pallas on TPUs; XLA elsewhere, on other GPUs with a warning),
        "pallas" (on GPU the Mosaic GPU kernels where they apply, else the Triton ones, which
        jax deprecates),
        "interpret" (the GPU Pallas kernels in interpret mode), "interpret_tpu" (the TPU Pallas
        kernels in interpret mode), "pallas_tpu", "xla"
        (blockwise, never materialises seq_q x seq_kv), "cudnn" (comparison pass-through to
        jax.nn.dot_product_attention; no lse, segment ids or offsets).
      context: where sf.parallelize splits the sequence of q, k and v over a mesh axis, how the
        keys reach every query block: "ring" (K/V blocks passed around the axis,
        shardflow.ring_attention), "all_gather" (K/V gathered, only q split; with a ``layout``,
        the ring's balanced steps on K/V gathered once, dK/dV sums passed home), "ulysses" (q, k, v
        re-split by heads with all-to-alls: the kv heads must divide over the axis), "hybrid"
        (Ulysses over the innermost sequence-split mesh axis, a ring over the others), or "auto"
        (the cheapest by the cost model, any of these). No effect on one device.
      layout: None (tokens in order) or a ``Layout`` (``Layout("zigzag", n)``, ``Layout("striped",
        n)``): the sequence of q, k and v is stored in that order (``Layout.permute``, applied
        once to the tokens), which balances a causal ring of n devices; the mask follows the
        tokens' positions, out, lse and segment ids come in the same order. Needs seq_q ==
        seq_kv and no offsets.

    A row that sees no key gives zeros and lse = -inf. Returns out [batch, seq_q, heads_q,
    head_dim] in q's dtype, and lse if return_lse.
    """
    if context not in CONTEXTS:
        raise ValueError(f"attention: context must be one of {CONTEXTS}, got {context!r}")
    if layout is not None:
        if not isinstance(layout, Layout):
            raise ValueError(f"attention: layout must be None or a shardflow.attention.Layout, got {layout!r}")
        if (
            not (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0)
            or jnp.shape(q)[1] != jnp.shape(k)[1]
        ):
            raise ValueError(
                f"attention: a {layout.kind} layout needs seq_q == seq_kv and no offsets "
                f"(got q {jnp.shape(q)}, k {jnp.shape(k)}, offsets {q_offset}, {kv_offset})"
            )
        layout.positions(jnp.shape(q)[1])  # the sequence splits into the layout's chunks
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
    _check_shapes(q, k, v, segment_ids)
    if q.shape[1] == 0 or k.shape[1] == 0:  # no query, or no key to see: nothing to compute
        out = jnp.zeros(q.shape, q.dtype)
        lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
        return (out, lse) if return_lse else out
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    implementation = implementation_of(backend)
    if implementation == "cudnn":
        return _cudnn_attention(
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            segment_ids=segment_ids,
            q_offset=q_offset,
            kv_offset=kv_offset,
            return_lse=return_lse,
        )

    extras = ()
    if segment_ids is not None:
        extras += (segment_ids.astype(jnp.int32),)
    static_offsets = isinstance(q_offset, int) and isinstance(kv_offset, int)
    if not static_offsets:
        extras += (jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32))
    config = AttentionConfig(
        implementation=implementation,
        causal=bool(causal),
        scale=float(scale),
        static_offset_delta=q_offset - kv_offset if static_offsets else None,
        has_segment_ids=segment_ids is not None,
        has_dlse=bool(return_lse),
        context=context,
        layout=layout,
    )
    out, lse = _attention(config, q, k, v, extras)
    return (out, lse) if return_lse else out
