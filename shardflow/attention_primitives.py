"""The attention primitives and the kernels they run.

Whatever implementation runs, `shardflow.attention.attention` shows in a jaxpr as one
recognisable unit (except backend="cudnn", a comparison pass-through):

* forward: exactly one ``sf_attention_fwd[config=...]`` primitive with operands
  ``(q, k, v[, segment_ids][, q_offset, kv_offset])`` and results ``(out, lse)``;
* backward (under `jax.grad` / `jax.vjp`): exactly one ``sf_attention_bwd[config=...]``
  primitive with operands ``(q, k, v, out, lse, dout[, segment_ids][, q_offset, kv_offset][, dlse])``
  and results ``(dq, dk, dv)``.

``q_offset``/``kv_offset`` are operands only when one of them is traced (both are then passed,
as int32 scalars); static ints live in ``config``. ``dlse`` is an operand only when
``return_lse=True`` (it carries the cotangent of lse). All other configuration (causal, scale,
backend) is the primitive's ``config`` param, so the operands are exactly the arrays above.

They are primitives rather than named ``jit`` calls for two reasons the compiler needs: JAX's
partial evaluation (inside a differentiated scan) never splits a primitive, and a primitive
rebinds at any operand shapes — the sharding passes run it on the local blocks of a batch- or
head-split q/k/v and its abstract evaluation gives the local result shapes. Batch (dim 0) and
heads (dim 2 of q/k/v/out/dout, dim 1 of lse) are independent in every implementation; the
primitives' sharding rule is `shardflow.attention_rule`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax

from shardflow import ring_attention
from shardflow.kernels import attention_xla, flash_attention_gpu, flash_attention_mgpu, on_hopper
from shardflow.primitives import kernel_primitive

BACKENDS = ("auto", "pallas", "interpret", "xla", "cudnn", "pallas_tpu", "interpret_tpu")
CONTEXTS = ("auto", "ring", "all_gather", "ulysses", "hybrid")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    implementation: str  # "xla", "mosaic_gpu", "pallas_gpu", "pallas_tpu", "interpret_gpu", "interpret_tpu"
    causal: bool
    scale: float
    static_offset_delta: int | None  # None when the offsets are operands
    has_segment_ids: bool
    has_dlse: bool
    kv_segment_ids: bool = False  # a second ids operand for the keys (a block of another device's)
    context: str = "auto"  # a sequence split over a mesh axis: "ring", "all_gather", "ulysses" or any
    layout: ring_attention.Layout | None = None  # the tokens' order (zigzag / striped); None: natural


def implementation_of(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention: backend must be one of {BACKENDS}, got {backend!r}")
    platform = jax.default_backend()
    if backend == "auto":
        if platform in ("gpu", "cuda") and not on_hopper():
            _warn_off_hopper(str(getattr(jax.devices()[0], "device_kind", "this GPU")))
            return "xla"
        return {"gpu": "mosaic_gpu", "cuda": "mosaic_gpu", "tpu": "pallas_tpu"}.get(platform, "xla")
    if backend == "pallas":
        if platform in ("gpu", "cuda"):
            return "pallas_gpu"
        if platform == "tpu":
            return "pallas_tpu"
        raise ValueError(
            f"attention: backend='pallas' needs a GPU or TPU, the default backend is "
            f"{platform!r}; use backend='interpret' to run the kernels on CPU"
        )
    if backend == "cudnn" and platform not in ("gpu", "cuda"):
        raise ValueError(f"attention: backend='cudnn' needs an NVIDIA GPU, the default backend is {platform!r}")
    return {
        "interpret": "interpret_gpu",
        "xla": "xla",
        "cudnn": "cudnn",
        "pallas_tpu": "pallas_tpu",
        "interpret_tpu": "interpret_tpu",
    }[backend]


@functools.cache
def _warn_off_hopper(device_kind: str):
    warnings.warn(
        f"attention: shardflow's GPU kernels are built for Hopper (compute capability 9.0), and {device_kind} "
        "is not one: backend='auto' runs the XLA blockwise attention there (kernels/attention_xla.py). "
        "backend='pallas' selects the Pallas Triton kernels, which jax deprecates; backend='cudnn' "
        "jax.nn.dot_product_attention (no lse, segment ids or offsets)",
        stacklevel=4,
    )


@functools.cache
def _warn_off_mosaic(reason: str):
    warnings.warn(
        f"attention: {reason}: on this Hopper GPU backend='auto' runs the XLA blockwise attention "
        "(kernels/attention_xla.py), which is slower; backend='pallas' runs the deprecated Pallas "
        "Triton kernels",
        stacklevel=2,
    )


def _mosaic_or_xla_forward(q, k, v, segment_ids, offset_delta, *, causal, scale):
    """The Mosaic GPU kernel where it takes the operands, else (saying why, once) XLA's."""
    out = flash_attention_mgpu.attend(q, k, v, segment_ids, offset_delta, causal=causal, scale=scale)
    if out is None:
        _warn_off_mosaic(_why_not_mosaic(q, k, segment_ids, offset_delta, causal=causal, scale=scale, backward=False))
        out = attention_xla.forward(q, k, v, segment_ids, offset_delta, causal=causal, scale=scale)
    return out


def _mosaic_or_xla_backward(q, k, v, segment_ids, offset_delta, out, lse, dout, *, causal, scale, dlse=None):
    grads = flash_attention_mgpu.attend_backward(
        q, k, v, segment_ids, offset_delta, out, lse, dout, causal=causal, scale=scale, dlse=dlse
    )
    if grads is None:
        _warn_off_mosaic(_why_not_mosaic(q, k, segment_ids, offset_delta, causal=causal, scale=scale, backward=True))
        grads = attention_xla.backward(
            q, k, v, segment_ids, offset_delta, out, lse, dout, causal=causal, scale=scale, dlse=dlse
        )
    return grads


def _why_not_mosaic(q, k, segment_ids, offset_delta, **kw):
    return flash_attention_mgpu.why_unsupported(*flash_attention_mgpu.widened(q, k), segment_ids, offset_delta, **kw)


def _kernels(implementation: str):
    """(forward, backward) callables with the attention_common conventions."""
    if implementation == "xla":
        return attention_xla.forward, attention_xla.backward
    if implementation == "mosaic_gpu":
        return _mosaic_or_xla_forward, _mosaic_or_xla_backward
    if implementation in ("pallas_gpu", "interpret_gpu"):
        interpret = implementation == "interpret_gpu"
        return (
            functools.partial(flash_attention_gpu.forward, interpret=interpret),
            functools.partial(flash_attention_gpu.backward, interpret=interpret),
        )
    from shardflow.kernels import flash_attention_tpu  # imports jax's Mosaic TPU support

    interpret = implementation == "interpret_tpu"
    return (
        functools.partial(flash_attention_tpu.forward, interpret=interpret),
        functools.partial(flash_attention_tpu.backward, interpret=interpret),
    )


def _split_extras(config: AttentionConfig, extras, *, backward: bool):
    """Trailing operands -> (segment_ids, offset_delta, dlse)."""
    extras = list(extras)
    segment_ids = extras.pop(0) if config.has_segment_ids else None
    if config.kv_segment_ids:
        segment_ids = (segment_ids, extras.pop(0))
    if config.static_offset_delta is None:
        q_offset, kv_offset = extras.pop(0), extras.pop(0)
        offset_delta = q_offset - kv_offset
    else:
        offset_delta = config.static_offset_delta
    dlse = extras.pop(0) if backward and config.has_dlse else None
    assert not extras
    return segment_ids, offset_delta, dlse


def sf_attention_fwd(config: AttentionConfig, q, k, v, *extras):
    """(q, k, v[, segment_ids][, q_offset, kv_offset]) -> (out, lse). Tokens in a ``layout``
    are put in natural order for the kernel and back."""
    segment_ids, offset_delta, _ = _split_extras(config, extras, backward=False)
    forward, _ = _kernels(config.implementation)
    lay = config.layout
    if lay is not None:
        q, k, v = (lay.unpermute(x) for x in (q, k, v))
        segment_ids = None if segment_ids is None else lay.unpermute(segment_ids)
    out, lse = forward(q, k, v, segment_ids, offset_delta, causal=config.causal, scale=config.scale)
    return (out, lse) if lay is None else (lay.permute(out), lay.permute(lse, axis=2))


def sf_attention_bwd(config: AttentionConfig, q, k, v, out, lse, dout, *extras):
    """(q, k, v, out, lse, dout[, segment_ids][, q_offset, kv_offset][, dlse]) -> (dq, dk, dv)."""
    segment_ids, offset_delta, dlse = _split_extras(config, extras, backward=True)
    _, backward = _kernels(config.implementation)
    lay = config.layout
    if lay is not None:
        q, k, v, out, dout = (lay.unpermute(x) for x in (q, k, v, out, dout))
        segment_ids = None if segment_ids is None else lay.unpermute(segment_ids)
        lse, dlse = (None if x is None else lay.unpermute(x, axis=2) for x in (lse, dlse))
    grads = backward(
        q, k, v, segment_ids, offset_delta, out, lse, dout, causal=config.causal, scale=config.scale, dlse=dlse
    )
    return grads if lay is None else tuple(lay.permute(g) for g in grads)


sf_attention_fwd_p = kernel_primitive("sf_attention_fwd", sf_attention_fwd)
sf_attention_bwd_p = kernel_primitive("sf_attention_bwd", sf_attention_bwd)


# ------------------------------------------------------------------------------ sharding rule

# The dims of each named operand / result: q-like arrays are [batch, seq, heads, head_dim], k-like
