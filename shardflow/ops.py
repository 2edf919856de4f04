"""Ops that shardflow's passes recognise and rewrite.

`attention` is the one attention entry point. Whatever implementation runs, it shows in a jaxpr
as one recognisable unit (except backend="cudnn", a comparison pass-through, see below):

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
primitives' rule (signatures over named operands, and the local lowering) is registered below.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from shardflow import _compat, ring_attention
from shardflow.conversion import Step
from shardflow.kernels import attention_xla, flash_attention_gpu
from shardflow.program import source_line
from shardflow.registry import Sig, decision_of, defrule
from shardflow.ring_attention import Layout
from shardflow.specs import B, P, S, ShardingError, local_shape

BACKENDS = ("auto", "pallas", "interpret", "xla", "cudnn", "pallas_tpu", "interpret_tpu")
CONTEXTS = ("auto", "ring", "all_gather", "ulysses", "hybrid")


@dataclasses.dataclass(frozen=True)
class _AttentionConfig:
    implementation: str  # "xla", "pallas_gpu", "pallas_tpu", "interpret_gpu", "interpret_tpu"
    causal: bool
    scale: float
    static_offset_delta: int | None  # None when the offsets are operands
    has_segment_ids: bool
    has_dlse: bool
    kv_segment_ids: bool = False  # a second ids operand for the keys (a block of another device's)
    context: str = "auto"  # a sequence split over a mesh axis: "ring", "all_gather", "ulysses" or any
    layout: ring_attention.Layout | None = None  # the tokens' order (zigzag / striped); None: natural


def _implementation(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention: backend must be one of {BACKENDS}, got {backend!r}")
    platform = jax.default_backend()
    if backend == "auto":
        return {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "xla")
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


def _kernels(implementation: str):
    """(forward, backward) callables with the attention_common conventions."""
    if implementation == "xla":
        return attention_xla.forward, attention_xla.backward
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


def _split_extras(config: _AttentionConfig, extras, *, backward: bool):
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


def sf_attention_fwd(config: _AttentionConfig, q, k, v, *extras):
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


def sf_attention_bwd(config: _AttentionConfig, q, k, v, out, lse, dout, *extras):
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


def _attention_primitive(name: str, kernel):
    """A primitive computing ``kernel(config, *operands)``; lowered by tracing the kernel."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(functools.partial(_compat.apply_primitive, prim))

    def abstract_eval(*avals, config):
        shapes = jax.eval_shape(functools.partial(kernel, config), *avals)
        return [jax.core.ShapedArray(x.shape, x.dtype) for x in shapes]

    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(lambda *args, config: kernel(config, *args), multiple_results=True))
    return prim


sf_attention_fwd_p = _attention_primitive("sf_attention_fwd", sf_attention_fwd)
sf_attention_bwd_p = _attention_primitive("sf_attention_bwd", sf_attention_bwd)


# ------------------------------------------------------------------------------ sharding rule

# The dims of each named operand / result: q-like arrays are [batch, seq, heads, head_dim], k-like
# [batch, seq_kv, heads_kv, head_dim], lse-like [batch, heads, seq], segment ids [batch, seq];
# offsets are scalars.
_Q = {"batch": 0, "seq": 1, "heads": 2}
_KV = {"batch": 0, "heads": 2}
_LSE = {"batch": 0, "heads": 1, "seq": 2}
_DIMS = {
    "q": _Q,
    "out": _Q,
    "dout": _Q,
    "dq": _Q,
    "k": _KV,
    "v": _KV,
    "dk": _KV,
    "dv": _KV,
    "lse": _LSE,
    "dlse": _LSE,
    "segment_ids": {"batch": 0, "seq": 1},
    "kv_segment_ids": {"batch": 0, "seq": 1},
    "q_offset": {},
    "kv_offset": {},
}


def operand_names(eqn) -> tuple:
    """The names of an sf_attention_* equation's operands, in order."""
    config = eqn.params["config"]
    backward = eqn.primitive is sf_attention_bwd_p
    names = ["q", "k", "v"] + (["out", "lse", "dout"] if backward else [])
    names += ["segment_ids"] * config.has_segment_ids + ["kv_segment_ids"] * config.kv_segment_ids
    names += ["q_offset", "kv_offset"] * (config.static_offset_delta is None)
    names += ["dlse"] * (backward and config.has_dlse)
    return tuple(names)


def _result_names(eqn) -> tuple:
    return ("dq", "dk", "dv") if eqn.primitive is sf_attention_bwd_p else ("out", "lse")


def _split(names, dim):
    return tuple(S(_DIMS[n][dim]) if dim in _DIMS[n] else B for n in names)


# The sequence dim of each array a ring splits (k and v too: each device holds one block).
_RING = {"q": 1, "k": 1, "v": 1, "out": 1, "dout": 1, "dq": 1, "dk": 1, "dv": 1, "lse": 2, "dlse": 2, "segment_ids": 1}


def _attention_signatures(eqn):
    """Batch rows and heads are independent. Queries may also be split along the sequence with
    whole keys and values (all-gather context parallelism, "query_seq"): each shard attends its
    queries to every key, its causal mask shifted by the shard's offset (see the lowering); the
    backward's dk and dv are then partial sums over the query shards; segment ids stay whole
    (the shard slices its queries'). Or everything split along the sequence ("ring",
    shardflow.ring_attention), segment ids with the tokens:
    K/V blocks pass around the axis instead of being gathered (or, "all_gather" with a token
    layout, gathered once by the ring's own steps); the attention's ``context`` ("ring",
    "all_gather", "auto") says which of the two it may use."""
    ins, outs = operand_names(eqn), _result_names(eqn)
    context = eqn.params["config"].context
    sigs = [
        Sig(_split(ins, "batch"), _split(outs, "batch"), "batch"),
        Sig(_split(ins, "heads"), _split(outs, "heads"), "heads"),
    ]
    if context in ("auto", "all_gather") and eqn.params["config"].layout is None:
        query = tuple(S(_DIMS[n]["seq"]) if n in ("q", "out", "dout", "lse", "dlse") else B for n in ins)
        result = {"out": S(1), "lse": S(2), "dq": S(1), "dk": P, "dv": P}
        sigs.append(Sig(query, tuple(result[n] for n in outs), "query_seq"))
    if context in ("auto", "ring", "hybrid") or (context == "all_gather" and eqn.params["config"].layout is not None):
        sigs.append(Sig(tuple(S(_RING[n]) if n in _RING else B for n in ins), tuple(S(_RING[n]) for n in outs), "ring"))
    return sigs


def _local_attention(local, eqn, ins):
    """Per-device attention. Under the "query_seq" signature this shard's queries start at its
    offset: the causal mask moves with them (the offsets become operands)."""
    config = eqn.params["config"]
    ring = decision_of(eqn).named("ring")
    if ring:
        return _local_ring(local, eqn, ins, tuple(local.names[i] for i in ring))
    if not decision_of(eqn).named("query_seq"):
        return eqn.primitive.bind(*ins, config=config)
    names = operand_names(eqn)
    shard, _ = local.shard_index(eqn.invars[0], _DIMS["q"]["seq"])
    shift = (shard * ins[0].shape[1]).astype(jnp.int32)
    operands = dict(zip(names, ins))
    if config.static_offset_delta is None:
        operands["q_offset"] = operands["q_offset"] + shift
    else:
        operands["q_offset"], operands["kv_offset"] = jnp.int32(config.static_offset_delta) + shift, jnp.int32(0)
        config = dataclasses.replace(config, static_offset_delta=None)
    if config.has_segment_ids:  # whole: this shard's queries' ids, every key's
        ids = operands["segment_ids"]
        operands["segment_ids"] = lax.dynamic_slice_in_dim(ids, shift, ins[0].shape[1], axis=1)
        operands["kv_segment_ids"] = ids
        config = dataclasses.replace(config, kv_segment_ids=True)
    eqn_names = [
        n
        for n in ("q", "k", "v", "out", "lse", "dout", "segment_ids", "kv_segment_ids", "q_offset", "kv_offset", "dlse")
        if n in operands
    ]
    return eqn.primitive.bind(*(operands[n] for n in eqn_names), config=config)


def _local_ring(local, eqn, ins, axes):
    """This device's blocks of a ring: its queries from their global position, K/V block 0 at
    the keys' (the ring finds each block's own)."""
    config = eqn.params["config"]
    operands = dict(zip(operand_names(eqn), ins))
    shard, count = local.shard_index(eqn.invars[0], _DIMS["q"]["seq"])
    if config.layout is not None and count != config.layout.blocks:
        raise ShardingError(
            f"{source_line(eqn)}: attention with tokens in a {config.layout.kind} layout of "
            f"{config.layout.blocks} blocks, its sequence split {count} ways"
        )
    if config.static_offset_delta is None:
        q_base, kv_base = operands["q_offset"], operands["kv_offset"]
    else:
        q_base, kv_base = config.static_offset_delta, 0
    block = dataclasses.replace(config, layout=None, kv_segment_ids=config.has_segment_ids)
    where = dict(
        causal=config.causal,
        q_block=shard,
        q_base=q_base,
        kv_base=kv_base,
        layout=config.layout,
        axes=axes,
        sizes=local.sizes,
        segment_ids=operands.get("segment_ids"),
        gather=config.context == "all_gather",
    )

    def masked(mask):
        """A block's config and offset operands for a ring_attention mask."""
        if mask == ring_attention.FULL:
            return dataclasses.replace(block, causal=False, static_offset_delta=0), ()
        if isinstance(mask, int):
            return dataclasses.replace(block, static_offset_delta=mask), ()
        return dataclasses.replace(block, static_offset_delta=None), mask

    if eqn.primitive is sf_attention_fwd_p:

        def attend(q, k, v, segments, mask):
            block_config, offsets = masked(mask)
            return tuple(sf_attention_fwd_p.bind(q, k, v, *segments, *offsets, config=block_config))

        return list(ring_attention.forward(attend, operands["q"], operands["k"], operands["v"], **where))

    def attend_bwd(q, k, v, out, lse, dout, dlse, segments, mask):
        block_config, offsets = masked(mask)
        extra = (dlse,) if config.has_dlse else ()
        return tuple(sf_attention_bwd_p.bind(q, k, v, out, lse, dout, *segments, *offsets, *extra, config=block_config))

    return list(
        ring_attention.backward(
            attend_bwd, *(operands[n] for n in ("q", "k", "v", "out", "lse", "dout")), operands.get("dlse"), **where
        )
    )


def _attention_comm(eqn, ins, sigs, mesh):
    """A ring's ppermutes, per device, as ring_attention sends them (one collective a step):
    its K/V block n-1 times (K and V as one array where their shapes agree) with its segment ids
    if any; in the backward also the block's dK/dV sums (float32), one step behind the K/V in the
    same collective, then home in K's and V's dtype. With K/V gathered (``context="all_gather"``
    and a layout): one all-gather of the block in each pass, and in the backward n-1 sends of
    the sums in K's and V's dtypes. Nothing for the other signatures (their collectives are
    boxes)."""
    axes = tuple(a for a, s in zip(mesh.axis_names, sigs) if getattr(s, "name", None) == "ring")
    if not axes:
        return []
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    n = math.prod(sizes[a] for a in axes)
    names = operand_names(eqn)

    def local(name, dtype=None, stacked=False):
        aval, sbp = eqn.invars[names.index(name)].aval, ins[names.index(name)]
        shape = ((2,) if stacked else ()) + tuple(local_shape(aval.shape, sbp, mesh))
        return jax.core.ShapedArray(shape, dtype or aval.dtype)

    def send(values):  # ring_attention._send: several arrays travel as their bytes, concatenated
        size = sum(math.prod(x.shape) * x.dtype.itemsize for x in values)
        value = values[0] if len(values) == 1 else jax.core.ShapedArray((size,), jnp.uint8)
        return Step("ppermute", axes, bytes=size, value=value)

    k, v = (eqn.invars[names.index(x)].aval for x in ("k", "v"))
    same_shape = k.shape == v.shape
    home = [local("k", stacked=True)] if same_shape and k.dtype == v.dtype else [local("k"), local("v")]
    block = home + ([local("segment_ids")] if "segment_ids" in names else [])
    if eqn.params["config"].context == "all_gather":
        size = sum(math.prod(x.shape) * x.dtype.itemsize for x in block)
        gather = [Step("all_gather", axes, bytes=(n - 1) * size, value=block[0])] if n > 1 else []
        return gather + ([send(home)] * (n - 1) if eqn.primitive is sf_attention_bwd_p else [])
    if eqn.primitive is not sf_attention_bwd_p:
        return [send(block)] * (n - 1)
    sums = [local("k", jnp.float32, stacked=True)] if same_shape else [local("k", jnp.float32), local("v", jnp.float32)]
    if n == 1:
        return [send(home)]
    return [send(block)] + [send(block + sums)] * (n - 2) + [send(sums), send(home)]


def _propagate_attention(prop, eqn):
    """An explicit ``context`` decides the mesh axes that split q's sequence: there, only that
    variant. (The planner prices collectives, not compute: it would gather q, k and v and run the
    attention whole on every device, or re-split them by heads.) Elsewhere, and for "auto", the
    cheapest signature."""
    sigs = _attention_signatures(eqn)
    context = eqn.params["config"].context
    if context == "auto":
        return prop.generic(eqn)
    q_seq = [i for i, s in enumerate(prop.of(eqn.invars[0])) if s == S(_DIMS["q"]["seq"])]

    def variant(i):  # hybrid (USP): Ulysses over the innermost sequence axis, ring outside it
        name = {
            "ring": "ring",
            "all_gather": "query_seq" if eqn.params["config"].layout is None else "ring",
            "ulysses": "heads",
            "hybrid": "heads" if i == q_seq[-1] else "ring",
        }[context]
        found = [s for s in sigs if s.name == name]
        if not found:
            raise ShardingError(
                f"{source_line(eqn)}: attention(context={context!r}) with q's sequence split over "
                f"{[prop.names[j] for j in q_seq]}: that variant takes no token layout "
                f"({eqn.params['config'].layout})"
            )
        return found

    def candidates(i, whole):
        return variant(i) if i in q_seq else [s for s in sigs if s.name not in ("ring", "query_seq")] + [whole]

    return prop.decide(eqn, prop.choose(eqn, [prop.of(a) for a in eqn.invars], sigs, candidates))


def _attention_flops(eqn, in_shapes, out_shapes):
    """Two matmuls of the local queries against every key forward (K/V blocks come round the ring),
    five backward (the scores recomputed); half the pairs under a causal mask."""
    q, k = in_shapes[0], eqn.invars[1].aval.shape
    batch, seq, heads, dim = q
    matmuls = 5 if eqn.primitive is sf_attention_bwd_p else 2
    return matmuls * 2.0 * batch * heads * seq * k[1] * dim * (0.5 if eqn.params["config"].causal else 1.0)


defrule(
    sf_attention_fwd_p,
    sf_attention_bwd_p,
    lower=_local_attention,
    comm=_attention_comm,
    comm_reason="passes K/V blocks around the ring (and their dK/dV sums home)",
    propagate=_propagate_attention,
    flops=_attention_flops,
    admits=lambda eqn, decision, mesh: eqn.params["config"].context == "auto",
)(_attention_signatures)


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
      backend: "auto" (Pallas on GPU/TPU; XLA elsewhere, or on GPU for heads too wide for the
        kernel), "pallas", "interpret" (the GPU Pallas kernels in interpret mode),
        "interpret_tpu" (the TPU Pallas kernels in interpret mode), "pallas_tpu", "xla"
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
            raise ValueError(f"attention: layout must be None or a shardflow.ops.Layout, got {layout!r}")
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
    implementation = _implementation(backend)
    if (
        backend == "auto"
        and implementation == "pallas_gpu"
        and not flash_attention_gpu.supports_head_dim(q.shape[-1], q.dtype)
    ):
        implementation = "xla"  # heads too wide for the kernel's shared-memory tiles
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
    config = _AttentionConfig(
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
