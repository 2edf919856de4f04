"""The sharding rule of the routed-experts primitives: expert parallelism as a signature.

Per mesh axis, one of:

* "tokens": the tokens split along one of their leading dims, every expert on every device;
  the weights' gradients are partial sums over the token shards.
* "ep": the tokens and the experts split over the same axis. Each device sorts its token
  choices by expert, sends each to its expert's device, runs its own experts as grouped GEMMs
  over what it received and sends the results home: two exchanges forward, two backward (the
  tokens and their output gradients travel together). ``config.exchange`` says how a device
  sends: a ragged all-to-all of exactly its rows, or an all-to-all of worst-case buffers.
* "expert_partial": the experts split, every token on every device: each device computes the
  choices of its own experts and the result is a partial sum (zero where another device's).
* "ffn": each expert's hidden dim split (w_gate / w_up by column, w_down by row): Megatron's
  MLP inside every expert, the result a partial sum.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from shardflow.conversion import Step
from shardflow.experts_primitives import (
    routed_ffn,
    routed_ffn_grads,
    sf_experts_bwd_p,
    sf_experts_fwd_p,
    sorted_ffn,
    sorted_ffn_grads,
)
from shardflow.program import source_line
from shardflow.registry import Sig, decision_of, defrule
from shardflow.specs import B, P, S, ShardingError, local_shape

_WEIGHTS = ("w_gate", "w_up", "w_down")
_EXPERT = {name: S(0) for name in _WEIGHTS + tuple("d" + w for w in _WEIGHTS)}
_FFN = {"w_gate": S(2), "w_up": S(2), "w_down": S(1), "dw_gate": S(2), "dw_up": S(2), "dw_down": S(1)}

# Seam for tests on backends without a ragged all-to-all (they emulate one): the collective the
# "ragged" exchange runs.
ragged_all_to_all = lax.ragged_all_to_all


def _kept(eqn) -> tuple:
    return ("activations",) if eqn.params["config"].keep_activations else ()


def operand_names(eqn) -> tuple:
    backward = eqn.primitive is sf_experts_bwd_p
    return ("x", "experts", *_WEIGHTS) + ((*_kept(eqn), "dh") if backward else ())


def _result_names(eqn) -> tuple:
    return ("dx", *("d" + w for w in _WEIGHTS)) if eqn.primitive is sf_experts_bwd_p else ("h", *_kept(eqn))


def _sig(eqn, ins: dict, outs: dict, name: str) -> Sig:
    return Sig(
        tuple(ins.get(n, B) for n in operand_names(eqn)), tuple(outs.get(n, P) for n in _result_names(eqn)), name
    )


def _experts_signatures(eqn):
    """Kept activations stay with their tokens ([..., k, 2, ffn]: split as the tokens, or by
    ffn column): no "ep" or "expert_partial" then, where the experts' devices hold them."""
    keep, ndim = eqn.params["config"].keep_activations, eqn.invars[0].aval.ndim
    sigs = []
    for dim in range(ndim - 1):  # the tokens' leading dims
        tokens = {"x": S(dim), "experts": S(dim), "dh": S(dim), "h": S(dim), "dx": S(dim), "activations": S(dim)}
        sigs.append(_sig(eqn, tokens, tokens, "tokens"))
        if not keep:
            sigs.append(_sig(eqn, {**tokens, **_EXPERT}, {**tokens, **_EXPERT}, "ep"))
    if not keep:
        sigs.append(_sig(eqn, _EXPERT, _EXPERT, "expert_partial"))
    ffn = {**_FFN, "activations": S(ndim + 1)}
    sigs.append(_sig(eqn, ffn, ffn, "ffn"))
    return sigs


def _admits(eqn, decision, mesh):
    """An expert's device is found from its index over the axes splitting the experts: under
    "ep" they must all exchange tokens, so "ep" and "expert_partial" never mix."""
    return decision is None or not (decision.named("ep") and decision.named("expert_partial"))


def _padded_exchange(rows, dest, sizes, mine, me, axes):
    """Each device's rows to device ``dest`` in [n_devices, rows] buffers (worst case: every row
    to one device): (the received rows, their local expert ids, the way home). ``sizes``
    [source, destination] counts the rows between devices, ``mine`` [source, local expert] those
    each source sends this device (``me``) per expert: from them the receiver knows every
    received row's expert (a source sends its rows for one device in expert order) and which
    rows are padding (id: the number of local experts)."""
    n_devices, m = sizes.shape[0], rows.shape[0]
    pos = jnp.arange(m) - (jnp.cumsum(sizes[me]) - sizes[me])[dest]
    sent = jnp.zeros((n_devices, *rows.shape), rows.dtype).at[dest, pos].set(rows, unique_indices=True)

    def exchange(x):
        return lax.all_to_all(x, axes, 0, 0)

    def home(out):
        return exchange(out.reshape(n_devices, m, *out.shape[1:]))[dest, pos]

    ends = jnp.cumsum(mine, axis=1)
    ids = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(m), side="right"))(ends)
    return exchange(sent).reshape(n_devices * m, *rows.shape[1:]), ids.reshape(-1), home


def _ragged_exchange(rows, dest, sizes, mine, me, axes):
    """The same by ragged all-to-alls of exactly the rows sent (rows for one device are
    contiguous), received source by source into a buffer of the worst case."""
    n_devices, m = sizes.shape[0], rows.shape[0]
    sent_at = jnp.cumsum(sizes[me]) - sizes[me]
    received = sizes[:, me]
    lands_at = (jnp.cumsum(sizes, axis=0) - sizes)[me]  # in each destination's buffer
    buffer = jnp.zeros((n_devices * m, *rows.shape[1:]), rows.dtype)
    out = ragged_all_to_all(rows, buffer, sent_at, sizes[me], lands_at, received, axis_name=axes)

    def home(out):
        back = jnp.zeros((m, *out.shape[1:]), out.dtype)
        came_from = (jnp.cumsum(sizes, axis=1) - sizes)[:, me]  # each source's sent_at for me
        return ragged_all_to_all(
            out, back, jnp.cumsum(received) - received, received, came_from, sizes[me], axis_name=axes
        )

    local_experts = mine.shape[1]
    run = jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), jnp.arange(n_devices * m), side="right")
    return out, jnp.where(run < mine.size, run % local_experts, local_experts), home


def _expert_parallel(eqn, ins, axes, n_devices):
    """One device's part of an "ep" decision over ``axes``: its token choices sorted by expert,
    sent to the experts' devices, computed there, sent home. The routing's counts go round
    first (an all-gather of [experts] per device)."""
    x, experts, w_gate, w_up, w_down = ins[:5]
    local_experts, k, d = w_gate.shape[0], experts.shape[-1], x.shape[-1]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = lax.all_gather(jnp.bincount(flat, length=n_devices * local_experts).astype(jnp.int32), axes)
    per_device = counts.reshape(n_devices, n_devices, local_experts)  # [source, destination, local expert]
    me = lax.axis_index(axes)
    routing = (flat[order] // local_experts, per_device.sum(-1), per_device[:, me], me, axes)
    ragged = eqn.params["config"].exchange == "ragged"
    if ragged and ragged_all_to_all is lax.ragged_all_to_all and jax.default_backend() == "cpu":
        raise ShardingError(
            f"{source_line(eqn)}: routed experts split over {list(axes)} with exchange='ragged': "
            "jax.lax.ragged_all_to_all has no CPU lowering; exchange='padded' computes the same on CPU"
        )
    exchange = _ragged_exchange if ragged else _padded_exchange
    rows = jnp.repeat(x.reshape(-1, d), k, axis=0).at[order].get(unique_indices=True)
    weights = (w_gate, w_up, w_down)
    if eqn.primitive is sf_experts_fwd_p:
        received, ids, home = exchange(rows, *routing)
        out = home(sorted_ffn(received, ids, *weights))
        return [jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(*experts.shape, d)]
    dh = ins[5].reshape(-1, d)[order].astype(x.dtype)
    received, ids, home = exchange(jnp.concatenate([rows, dh], -1), *routing)
    d_rows, *d_weights = sorted_ffn_grads(received[:, :d], ids, *weights, received[:, d:])
    d_choices = jnp.zeros((flat.size, d), d_rows.dtype).at[order].set(home(d_rows), unique_indices=True)
    return [d_choices.reshape(*experts.shape, d).sum(-2).reshape(x.shape), *d_weights]


def _local_experts(local, eqn, ins):
    decision = decision_of(eqn)
    ep = tuple(local.names[i] for i in decision.named("ep"))
    if ep:
        return _expert_parallel(eqn, ins, ep, math.prod(local.sizes[a] for a in ep))
    first = 0
    if decision.named("expert_partial"):
        shard, _ = local.shard_index(eqn.invars[2], 0)
        first = shard * ins[2].shape[0]
    x, experts, *weights = ins[:5]
    keep = eqn.params["config"].keep_activations
    if eqn.primitive is sf_experts_fwd_p:
        out = routed_ffn(x, experts, *weights, first_expert=first, keep_activations=keep)
        return list(out) if keep else [out]
    *activations, dh = ins[5:]
    return list(routed_ffn_grads(x, experts, *weights, dh.astype(x.dtype), *activations, first_expert=first))


def _experts_comm(eqn, ins, sigs, mesh):
    """An "ep" decision's collectives, per device: the routing's counts (an all-gather of one
    int32 per expert), then its choices' rows (k per local token) out and back; backward, each
    choice's output gradient travels out with its token. A ragged exchange sends the rows for
    other devices: (n-1)/n of them at a balanced load (the price; the bytes follow the
    routing). A padded one sends n-1 buffers of every row."""
    axes = tuple(a for a, s in zip(mesh.axis_names, sigs) if getattr(s, "name", None) == "ep")
    if not axes:
        return []
    n = math.prod(dict(zip(mesh.axis_names, mesh.devices.shape))[a] for a in axes)
    x, n_experts = eqn.invars[0].aval, eqn.invars[2].aval.shape[0]
    k, d = eqn.invars[1].aval.shape[-1], x.shape[-1]
    m = math.prod(local_shape(x.shape, ins[0], mesh)[:-1]) * k
    ragged = eqn.params["config"].exchange == "ragged"

    def send(width):
        moved = jax.core.ShapedArray((m, width), x.dtype)
        whole = m * width * jnp.dtype(x.dtype).itemsize
        return Step("all_to_all", axes, bytes=whole * (n - 1) // (n if ragged else 1), value=moved)

    counts = jax.core.ShapedArray((n_experts,), jnp.int32)
    out = d if eqn.primitive is sf_experts_fwd_p else 2 * d
    return [Step("all_gather", axes, bytes=(n - 1) * n_experts * 4, value=counts), send(out), send(d)]


def _experts_flops(eqn, in_shapes, out_shapes):
    """Three GEMMs of every local choice forward; backward six, and the two of the forward's
    activations again where they were not kept. Under "expert_partial" a device computes its
    experts' share of the choices."""
    x, experts, w_gate = in_shapes[0], in_shapes[1], in_shapes[2]
    share = w_gate[0] / eqn.invars[2].aval.shape[0] if x[:-1] == eqn.invars[0].aval.shape[:-1] else 1.0
    gemms = 3
    if eqn.primitive is sf_experts_bwd_p:
        gemms = 6 if eqn.params["config"].keep_activations else 8
    return gemms * 2.0 * math.prod(experts) * share * x[-1] * w_gate[2]


defrule(
    sf_experts_fwd_p,
    sf_experts_bwd_p,
    lower=_local_experts,
    comm=_experts_comm,
    comm_reason="sends each token choice to its expert's device and the result home",
    flops=_experts_flops,
    admits=_admits,
)(_experts_signatures)
