"""Slicing, padding, gather and scatter: the ops whose params hold global positions."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from shardflow.conversion import Step
from shardflow.registry import Sig, bind_params, decision_of, defrule
from shardflow.rules.elementwise import every, rank, shape
from shardflow.specs import B, P, S, local_shape


def _pad_signatures(eqn):
    # A split dim stays split where every block pads alike: no padding on it, or interior
    # padding with lo + hi == interior (lo, hi >= 0), where block b's result is exactly the local
    # pad of block b (each block ends with hi pad values and the next starts with lo). Edge
    # padding (lo, hi >= 0, no interior) shifts the blocks across their neighbours' boundaries:
    # the "halo" signature, whose lowering moves whole blocks to the devices whose output block
    # they overlap (``pad_halo``: a few ppermutes, priced and shown like any collective). No
    # P -> P although pad is linear: the partial value would be reduced at the padded size.
    config = eqn.params["padding_config"]
    sigs = [
        Sig((S(d), B), (S(d),))
        for d, (lo, hi, interior) in enumerate(config)
        if (lo, hi, interior) == (0, 0, 0) or (lo >= 0 and hi >= 0 and interior > 0 and lo + hi == interior)
    ]
    sigs += [
        Sig((S(d), B), (S(d),), "halo")
        for d, (lo, hi, interior) in enumerate(config)
        if interior == 0 and lo >= 0 and hi >= 0 and lo + hi > 0
    ]
    return sigs


def _halo_dims(eqn, sigs) -> list:
    return sorted({s.ins[0].dim for s in sigs if s is not None and s.name == "halo"})


def _halo_rounds(eqn, d, n):
    """How dim ``d``'s n blocks reach the output blocks they overlap: rounds of ppermutes, each
    ``(pairs, rows, starts)`` — ``pairs`` ((src, dst), ...) with every device sending and
    receiving at most once, ``rows`` the rows each source sends (the most any pair of the round
    needs) and ``starts[src]`` where in its block they begin. Static: the block sizes and the
    padding fix them."""
    lo, _, _ = eqn.params["padding_config"][d]
    size, padded = eqn.invars[0].aval.shape[d], eqn.outvars[0].aval.shape[d]
    if size % n or padded % n:  # not a valid split of this dim (propagation refuses it)
        return []
    b, b_out = size // n, padded // n
    needs = {}  # (src, dst) -> (first, last) input rows of block src that output block dst takes
    for i in range(n):
        first, last = max(0, i * b_out - lo), min(size, (i + 1) * b_out - lo)
        for j in range(first // b, (last - 1) // b + 1) if first < last else ():
            needs[(j, i)] = (max(first, j * b), min(last, (j + 1) * b))
    rounds = []
    for pair in needs:
        for r in rounds:
            if all(pair[0] != s and pair[1] != t for s, t in r):
                r.append(pair)
                break
        else:
            rounds.append([pair])
    out = []
    for r in rounds:
        rows = max(needs[p][1] - needs[p][0] for p in r)
        starts = {j: min(needs[(j, i)][0] - j * b, b - rows) for j, i in r}
        out.append((tuple(r), rows, starts))
    return out


def _halo_axes(sbp, d, names):
    return tuple(a for a, s in zip(names, sbp) if s == S(d))


def pad_halo(eqn, ins, sigs, mesh) -> tuple:
    """The collectives the "halo" lowering runs: per halo dim, in order, one ppermute per round
    that moves rows to another device (the block then has that dim's output size)."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    steps = []
    halo = _halo_dims(eqn, sigs)
    block = [
        n if d in halo else n + lo + hi + interior * max(n - 1, 0)  # as _lower_pad sends it
        for d, (n, (lo, hi, interior)) in enumerate(
            zip(local_shape(eqn.invars[0].aval.shape, ins[0], mesh), eqn.params["padding_config"])
        )
    ]
    itemsize = np.dtype(eqn.invars[0].aval.dtype).itemsize
    for d in halo:
        axes = _halo_axes(ins[0], d, mesh.axis_names)
        n = int(np.prod([sizes[a] for a in axes]))
        row = int(np.prod([m for e, m in enumerate(block) if e != d])) * itemsize
        for r, rows, _ in _halo_rounds(eqn, d, n):
            if any(j != i for j, i in r):
                steps.append(Step("ppermute", axes, d, local_shape=tuple(block), bytes=int(rows * row), perm=r))
        block[d] = eqn.outvars[0].aval.shape[d] // n
    return tuple(steps)


def _lower_pad(local, eqn, ins):
    x, value = ins
    decision = decision_of(eqn)
    halo = _halo_dims(eqn, decision.sigs)
    config = [(0, 0, 0) if d in halo else c for d, c in enumerate(eqn.params["padding_config"])]
    x = lax.pad(x, value, config)
    for d in halo:
        x = _exchange(local, eqn, x, value, d, _halo_axes(decision.ins[0], d, local.names))
    return x


def _exchange(local, eqn, x, value, d, axes):
    """This device's output block of dim ``d`` from the rows of the input blocks that overlap it."""
    lo, _, _ = eqn.params["padding_config"][d]
    n = int(np.prod([local.sizes[a] for a in axes]))
    size, padded = eqn.invars[0].aval.shape[d], eqn.outvars[0].aval.shape[d]
    b, b_out = size // n, padded // n
    me, _ = local.shard_index(eqn.invars[0], d)
    out = jnp.zeros(x.shape[:d] + (b_out,) + x.shape[d + 1 :], x.dtype)
    rows_out = lax.broadcasted_iota(jnp.int32, out.shape, d)
    rounds = _halo_rounds(eqn, d, n)
    # One round that reaches every block: each output row is an input row of what arrived or a
    # padding row, so the arrival padded with the pad value, placed, is the block (no masks).
    alone = len(rounds) == 1 and sorted(i for _, i in rounds[0][0]) == list(range(n))
    for pairs, rows, starts in rounds:
        send_start = np.zeros(n, np.int32)
        source = np.full(n, -1, np.int32)
        for j, i in pairs:
            send_start[j], source[i] = starts[j], j
        sent = lax.dynamic_slice_in_dim(x, jnp.asarray(send_start)[me], rows, d)
        got = sent if all(j == i for j, i in pairs) else lax.ppermute(sent, axes, perm=pairs)
        j = jnp.asarray(source)[me]
        first = j * b + jnp.asarray(send_start)[jnp.maximum(j, 0)]  # input row of got's first row
        offset = first + lo - me * b_out  # its output row here
        fill = value.astype(x.dtype) if alone else jnp.zeros((), x.dtype)
        widened = lax.pad(got, fill, [(b_out, b_out, 0) if e == d else (0, 0, 0) for e in range(x.ndim)])
        placed = lax.dynamic_slice_in_dim(widened, jnp.clip(b_out - offset, 0, rows + b_out), b_out, d)
        if alone:
            return placed
        row_in = me * b_out + rows_out - lo  # the input row of each output row
        mine = (j >= 0) & (row_in >= j * b) & (row_in < (j + 1) * b) & (row_in >= first) & (row_in < first + rows)
        out = jnp.where(mine, placed, out)
    rows_global = me * b_out + rows_out
    return jnp.where((rows_global < lo) | (rows_global >= lo + size), value.astype(x.dtype), out)


defrule(lax.pad_p, lower=_lower_pad, comm=pad_halo, comm_reason="exchanges the blocks of its split dims")(
    _pad_signatures
)


def _lower_slice(local, eqn, ins):
    (x,) = ins
    limit = [
        l if x.shape[d] == eqn.invars[0].aval.shape[d] else x.shape[d]
        for d, l in enumerate(eqn.params["limit_indices"])
    ]
    return lax.slice_p.bind(
        x, start_indices=eqn.params["start_indices"], limit_indices=tuple(limit), strides=eqn.params["strides"]
    )


@defrule(lax.slice_p, lower=_lower_slice)
def _slice(eqn):
    x = eqn.invars[0]
    start, limit, strides = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
    return [
        Sig((S(d),), (S(d),))
        for d in range(rank(x))
        if start[d] == 0 and limit[d] == shape(x)[d] and (strides is None or strides[d] == 1)
    ]


def _summable(x) -> bool:
    return np.issubdtype(x.aval.dtype, np.number)


def _offset_dims(eqn) -> list:
    """Operand dims split under a chosen "offset" signature (a slice or update smaller than the
    dim, at a position that may cross blocks)."""
    decision = decision_of(eqn)
    return sorted({decision.sigs[i].ins[0].dim for i in decision.named("offset")})


def _local_start(local, eqn, d, start, size):
    """Where this device's block of operand dim ``d`` puts the window [start, start + size) of
    the whole dim (start clamped as XLA clamps it), in the block padded by ``size`` on both sides:
    clipped into the padding when the window misses the block."""
    x = eqn.invars[0]
    n, block = x.aval.shape[d], local.shape(x)[d]
    idx, _ = local.shard_index(x, d)
    start = jnp.clip(start, 0, n - size)
    return jnp.clip(start - idx.astype(start.dtype) * block + size, 0, block + size)


def _pad_dims(x, dims, sizes):
    return lax.pad(
        x, jnp.zeros((), x.dtype), [(sizes[d], sizes[d], 0) if d in dims else (0, 0, 0) for d in range(x.ndim)]
    )


def _lower_dynamic_slice(local, eqn, ins):
    x, *idx = ins
    full = eqn.invars[0].aval.shape
    offset = _offset_dims(eqn)
    sizes = eqn.params["slice_sizes"]
    if offset:  # the part of the slice in this block, zeros elsewhere: the sum over blocks is it
        x = _pad_dims(x, offset, sizes)
        idx = [_local_start(local, eqn, d, i, sizes[d]) if d in offset else i for d, i in enumerate(idx)]
    local_sizes = [x.shape[d] if s == full[d] else s for d, s in enumerate(sizes)]
    return lax.dynamic_slice_p.bind(x, *idx, slice_sizes=tuple(local_sizes))


@defrule(lax.dynamic_slice_p, lower=_lower_dynamic_slice)
def _dynamic_slice(eqn):
    x, *idx = eqn.invars
    sizes = eqn.params["slice_sizes"]
    sigs = [Sig((S(d),) + every(len(idx), B), (S(d),)) for d in range(rank(x)) if sizes[d] == shape(x)[d]]
    if _summable(x):
        # a window smaller than a split dim: each device slices what of it lies in its block
        sigs += [Sig((S(d),) + every(len(idx), B), (P,), "offset") for d in range(rank(x)) if sizes[d] < shape(x)[d]]
        sigs.append(Sig((P,) + every(len(idx), B), (P,)))  # linear in the operand, and smaller
    return sigs


def _lower_dynamic_update_slice(local, eqn, ins):
    x, upd, *idx = ins
    offset = _offset_dims(eqn)
    if not offset:
        return lax.dynamic_update_slice_p.bind(x, upd, *idx)
    # write the update into this block padded by its size on each side (a write that misses the
    # block lands in the padding), then drop the padding
    sizes = upd.shape
    padded = _pad_dims(x, offset, sizes)
    idx = [_local_start(local, eqn, d, i, sizes[d]) if d in offset else i for d, i in enumerate(idx)]
    out = lax.dynamic_update_slice_p.bind(padded, upd, *idx)
    return lax.slice(
        out,
        [sizes[d] if d in offset else 0 for d in range(x.ndim)],
        [sizes[d] + x.shape[d] if d in offset else x.shape[d] for d in range(x.ndim)],
    )


@defrule(lax.dynamic_update_slice_p, lower=_lower_dynamic_update_slice)
def _dynamic_update_slice(eqn):
    x, upd, *idx = eqn.invars
    n = len(idx)
    sigs = [Sig((S(d), S(d)) + every(n, B), (S(d),)) for d in range(rank(x)) if shape(upd)[d] == shape(x)[d]]
    # an update smaller than a split dim: each device writes the part that falls in its block
    sigs += [Sig((S(d), B) + every(n, B), (S(d),), "offset") for d in range(rank(x)) if shape(upd)[d] < shape(x)[d]]
    return sigs


# ------------------------------------------------------------------------------ gather / scatter


def gather_dims(eqn):
    """Dim bookkeeping of a gather: which operand/indices dims map to which output dims."""
    operand, indices = eqn.invars
    dn = eqn.params["dimension_numbers"]
    out_rank = rank(eqn.outvars[0])
    offset_out = tuple(dn.offset_dims)
    batch_out = [d for d in range(out_rank) if d not in offset_out]
    idx_batch = [d for d in range(rank(indices)) if d != rank(indices) - 1]  # index vector dim is last
    operand_offset = [
        d for d in range(rank(operand)) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims
    ]
    return dn, offset_out, batch_out, idx_batch, operand_offset


def _local_indices(local, eqn, table, block, indices, index_map, dims):
    """Indices into ``table``'s split ``dims`` made local to this device's ``block``, and which
    of them fall in it (the others are clipped and must be masked out by the caller). Unless
    the mode fills (FILL_OR_DROP), an index is first clamped into the whole table, as XLA runs
    the whole gather under CLIP and PROMISE_IN_BOUNDS alike."""
    clamp = eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP
    in_range = jnp.ones(indices.shape[:-1], bool)
    for k in dims:
        pos = index_map.index(k)
        idx, _ = local.shard_index(table, k)
        component = indices[..., pos]
        if clamp:
            component = jnp.clip(component, 0, table.aval.shape[k] - 1)
        component = component - (idx * block.shape[k]).astype(indices.dtype)
        in_range &= (component >= 0) & (component < block.shape[k])
        indices = indices.at[..., pos].set(jnp.clip(component, 0, block.shape[k] - 1))
    return indices, in_range


def _out_of_bounds(eqn, table, indices, index_map, sizes):
    """Which lookups start outside the whole table (mode FILL_OR_DROP fills them)."""
    oob = jnp.zeros(indices.shape[:-1], bool)
    for pos, k in enumerate(index_map):
        component = indices[..., pos]
        oob |= (component < 0) | (component > table.aval.shape[k] - sizes[k])
    return oob


def _fill_value(eqn, dtype):
    """What a FILL_OR_DROP gather returns out of bounds (JAX's defaults when none is given)."""
    fill = eqn.params.get("fill_value")
    if fill is not None:
        return fill
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.nan
    if jnp.issubdtype(dtype, jnp.bool_):
        return True
    return jnp.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.signedinteger) else jnp.iinfo(dtype).max


def _vocab_dims(eqn) -> list:
    """The table dims split under the chosen "vocab" signatures (a lookup into a table split on
    the indexed dim: each device looks up the rows it holds)."""
    decision = decision_of(eqn)
    return sorted({decision.sigs[i].ins[0].dim for i in decision.named("vocab")})


def _lower_gather(local, eqn, ins):
    operand, indices = ins
    table = eqn.invars[0]
    dn = eqn.params["dimension_numbers"]
    sizes = tuple(operand.shape[d] if s == table.aval.shape[d] else s for d, s in enumerate(eqn.params["slice_sizes"]))
    params = dict(bind_params(eqn), slice_sizes=sizes)
    split = _vocab_dims(eqn)
    if not split:
        return lax.gather_p.bind(operand, indices, **params)
    # a vocab-split table: each device looks up the rows it holds, zeros elsewhere (a partial sum)
    fill = eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP
    oob = _out_of_bounds(eqn, table, indices, dn.start_index_map, eqn.params["slice_sizes"]) if fill else None
    local_indices, in_range = _local_indices(local, eqn, table, operand, indices, dn.start_index_map, split)
    out = lax.gather_p.bind(operand, local_indices, **dict(params, mode=lax.GatherScatterMode.CLIP))
    batch_dims = tuple(d for d in range(out.ndim) if d not in dn.offset_dims)
    spread = lambda mask: lax.broadcast_in_dim(mask, out.shape, batch_dims)  # noqa: E731
    if not fill:
        return jnp.where(spread(in_range), out, jnp.zeros_like(out))
    # out of the whole table: the fill value, held by the first block of the split dims alone
    first = functools.reduce(jnp.logical_and, [local.shard_index(table, k)[0] == 0 for k in split])
    filled = jnp.where(first, jnp.asarray(_fill_value(eqn, out.dtype), out.dtype), jnp.zeros((), out.dtype))
    return jnp.where(spread(oob), filled, jnp.where(spread(in_range), out, jnp.zeros_like(out)))


@defrule(lax.gather_p, lower=_lower_gather)
def _gather(eqn):
    operand, indices = eqn.invars
    dn, offset_out, batch_out, idx_batch, operand_offset = gather_dims(eqn)
    sizes = eqn.params["slice_sizes"]
    sigs = []
    for od, out_d in zip(operand_offset, offset_out):  # untouched operand dims
        if od not in dn.start_index_map and sizes[od] == shape(operand)[od]:
            sigs.append(Sig((S(od), B), (S(out_d),)))
    for ob, ib in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        sigs.append(Sig((S(ob), S(ib)), (S(batch_out[idx_batch.index(ib)]),)))
    for ib, out_d in zip(idx_batch, batch_out):  # split the lookups, whole table
        if ib not in dn.start_indices_batching_dims:
            sigs.append(Sig((B, S(ib)), (S(out_d),)))
    for k in dn.start_index_map:  # vocab-split table: masked local lookup
        if k in dn.collapsed_slice_dims and sizes[k] == 1:
            sigs.append(Sig((S(k), B), (P,), "vocab"))
    return sigs


def _lower_scatter_add(local, eqn, ins):
    operand, indices, updates = ins
    table = eqn.invars[0]
    dn = eqn.params["dimension_numbers"]
    split = _vocab_dims(eqn)
    params = bind_params(eqn)
    if split:  # add only the updates of rows this device holds: the others fall outside its block
        index_map = dn.scatter_dims_to_operand_dims
        if eqn.params["mode"] == lax.GatherScatterMode.CLIP:  # each window clamped into the whole table
            operand_window = [
                d for d in range(rank(table)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
            ]
            window = [
                1
                if k in dn.inserted_window_dims
                else shape(eqn.invars[2])[dn.update_window_dims[operand_window.index(k)]]
                for k in index_map
            ]
            indices = jnp.clip(
                indices, 0, jnp.asarray([shape(table)[k] - w for k, w in zip(index_map, window)], indices.dtype)
            )
        block_start = [
            (local.shard_index(table, k)[0] * operand.shape[k]).astype(indices.dtype)
            if k in split
            else jnp.zeros((), indices.dtype)
            for k in index_map
        ]
        indices = indices - jnp.stack(block_start)
        # XLA skips an update whose window falls outside the operand: no mask, no select
        params = dict(params, mode=lax.GatherScatterMode.FILL_OR_DROP)
    return eqn.primitive.bind(operand, indices, updates, **params)


@defrule(lax.scatter_add_p, lower=_lower_scatter_add)
def _scatter_add(eqn):
    operand, indices, updates = eqn.invars
    dn = eqn.params["dimension_numbers"]
    upd_window = tuple(dn.update_window_dims)
    operand_window = [
        d for d in range(rank(operand)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
    ]
    upd_scatter = [d for d in range(rank(updates)) if d not in upd_window]
    idx_batch = [d for d in range(rank(indices)) if d != rank(indices) - 1]
    sigs = []
    for od, ud in zip(operand_window, upd_window):
        if od not in dn.scatter_dims_to_operand_dims and shape(updates)[ud] == shape(operand)[od]:
            sigs.append(Sig((S(od), B, S(ud)), (S(od),)))
    for ob, ib in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        sigs.append(Sig((S(ob), S(ib), S(upd_scatter[idx_batch.index(ib)])), (S(ob),)))
    for ib, ud in zip(idx_batch, upd_scatter):  # each device adds its own updates
        if ib not in dn.scatter_indices_batching_dims:
            sigs.append(Sig((P, S(ib), S(ud)), (P,)))
    for k in dn.scatter_dims_to_operand_dims:  # vocab-split table: masked local scatter
        if k in dn.inserted_window_dims:
            sigs.append(Sig((S(k), B, B), (S(k),), "vocab"))
    sigs.append(Sig((P, B, P), (P,)))
    return sigs
