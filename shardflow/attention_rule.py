"""The sharding rule of the attention primitives: their signatures over named operands, the
local lowering (a shard's causal mask moved to its offset, or a ring of K/V blocks), the ring's
collectives, and the flops the cost model charges."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from shardflow import ring_attention
from shardflow.attention_primitives import sf_attention_bwd_p, sf_attention_fwd_p
from shardflow.conversion import Step
from shardflow.program import source_line
from shardflow.registry import Sig, decision_of, defrule
from shardflow.specs import B, P, S, ShardingError, local_shape

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


def _admits(eqn, decision, mesh):
    """Context "auto" only (an explicit context is laid out by q's layout as it comes, greedy's).
    Under a causal mask or segment ids, never a ring on one axis with the queries alone split on
    another: the ring's masks take each query block to span its K/V block's positions, which the
    second split breaks (wrong results, found by the rules' soundness test on a 2x2 mesh)."""
    config = eqn.params["config"]
    if config.context != "auto":
        return False
    if decision is None or not (config.causal or config.has_segment_ids):
        return True
    return not (decision.named("ring") and decision.named("query_seq"))


defrule(
    sf_attention_fwd_p,
    sf_attention_bwd_p,
    lower=_local_attention,
    comm=_attention_comm,
    comm_reason="passes K/V blocks around the ring (and their dK/dV sums home)",
    propagate=_propagate_attention,
    flops=_attention_flops,
    admits=_admits,
)(_attention_signatures)
