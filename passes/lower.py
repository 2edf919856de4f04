"""lower: a boxed Program -> one ``jax.jit(jax.shard_map(local program))``.

Before: a boxed Program (``passes.boxing``): every operand has the NdSbp its use needs and
every sharding change is an ``sf_box`` equation. After: a per-device function, traced inside
``shard_map`` over all mesh axes, in which each value is its local block: shape-carrying params
(broadcast_in_dim, reshape, iota, slices, gather/scatter on a split dim) are rewritten to local
shapes and shard offsets, and each ``sf_box`` runs its steps as lax collectives
(all_gather / psum / psum_scatter / all_to_all) or local slices and masks.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core

from shardflow.primitives import box_p, constrain_p
from shardflow.program import REMAT, Program, is_literal, open_jaxpr, scan_arity
from shardflow.specs import axis_sizes, local_shape, split_axes, to_partition_spec

LOCAL_RULES: dict[str, Callable] = {}


def local_rule(*names):
    def register(fn):
        for n in names:
            LOCAL_RULES[n] = fn
        return fn
    return register


class Local:
    """Evaluates a boxed jaxpr on local blocks inside shard_map."""

    def __init__(self, program: Program):
        self.p = program
        self.names = program.axis_names
        self.sizes = axis_sizes(program.mesh)

    def shape(self, var) -> tuple:
        return local_shape(var.aval.shape, self.p.sbp[var], self.p.mesh)

    def shard_index(self, var, dim):
        """(index of this device's block along ``dim``, number of blocks)."""
        axes = split_axes(self.p.sbp[var], dim, self.names)
        idx, count = jnp.int32(0), 1
        for a in axes:
            idx = idx * self.sizes[a] + lax.axis_index(a)
            count *= self.sizes[a]
        return idx, count

    def eval(self, jaxpr: core.Jaxpr, consts, args):
        env = {}

        def read(a):
            return a.val if is_literal(a) else env[a]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            fn = LOCAL_RULES.get(eqn.primitive.name)
            if fn is not None:
                outs = fn(self, eqn, ins)
            else:
                outs = eqn.primitive.bind(*ins, **eqn.params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, core.DropVar):
                    env[v] = x
        return [read(a) for a in jaxpr.outvars]

    def body_fn(self, jaxpr):
        closed = jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else core.ClosedJaxpr(jaxpr, ())
        return lambda *args: self.eval(closed.jaxpr, closed.consts, args)


def apply_steps(local: Local, x, steps):
    for st in steps:
        if st.kind == "all_gather":
            x = lax.all_gather(x, st.axes if len(st.axes) > 1 else st.axes[0], axis=st.dim, tiled=True)
        elif st.kind == "all_reduce":
            x = (lax.psum if st.op == "sum" else lax.pmax)(x, st.axes)
        elif st.kind == "reduce_scatter":
            x = lax.psum_scatter(x, st.axes[0], scatter_dimension=st.dim, tiled=True)
        elif st.kind == "all_to_all":
            x = lax.all_to_all(x, st.axes[0], st.dim, st.src_dim, tiled=True)
        elif st.kind == "slice":
            size = x.shape[st.dim] // local.sizes[st.axes[0]]
            x = lax.dynamic_slice_in_dim(x, lax.axis_index(st.axes[0]) * size, size, st.dim)
        elif st.kind == "pad":
            n, size = local.sizes[st.axes[0]], x.shape[st.dim]
            shape = x.shape[:st.dim] + (size * n,) + x.shape[st.dim + 1:]
            x = lax.dynamic_update_slice_in_dim(jnp.zeros(shape, x.dtype), x,
                                                lax.axis_index(st.axes[0]) * size, st.dim)
        elif st.kind == "mask":
            if st.op == "sum":
                x = jnp.where(lax.axis_index(st.axes[0]) == 0, x, jnp.zeros_like(x))
        else:  # pragma: no cover
            raise NotImplementedError(st.kind)
    return x


@local_rule(box_p.name)
def _box(local, eqn, ins):
    return apply_steps(local, ins[0], eqn.params["steps"])


@local_rule(constrain_p.name)
def _constrain(local, eqn, ins):
    return ins[0]


@local_rule(lax.broadcast_in_dim_p.name)
def _broadcast_in_dim(local, eqn, ins):
    return lax.broadcast_in_dim_p.bind(ins[0], shape=local.shape(eqn.outvars[0]),
                                       broadcast_dimensions=eqn.params["broadcast_dimensions"], sharding=None)


@local_rule(lax.reshape_p.name)
def _reshape(local, eqn, ins):
    return lax.reshape(ins[0], local.shape(eqn.outvars[0]))


@local_rule(lax.iota_p.name)
def _iota(local, eqn, ins):
    out = eqn.outvars[0]
    dim, dtype = eqn.params["dimension"], eqn.params["dtype"]
    shape = local.shape(out)
    x = lax.broadcasted_iota(dtype, shape, dim)
    idx, count = local.shard_index(out, dim)
    if count > 1:
        x = x + (idx * shape[dim]).astype(dtype)
    return x


@local_rule(lax.slice_p.name)
def _slice(local, eqn, ins):
    (x,) = ins
    limit = [l if x.shape[d] == eqn.invars[0].aval.shape[d] else x.shape[d]
             for d, l in enumerate(eqn.params["limit_indices"])]
    return lax.slice_p.bind(x, start_indices=eqn.params["start_indices"], limit_indices=tuple(limit),
                            strides=eqn.params["strides"])


@local_rule(lax.dynamic_slice_p.name)
def _dynamic_slice(local, eqn, ins):
    x, *idx = ins
    sizes = [x.shape[d] if s == eqn.invars[0].aval.shape[d] else s for d, s in enumerate(eqn.params["slice_sizes"])]
    return lax.dynamic_slice_p.bind(x, *idx, slice_sizes=tuple(sizes))


def _local_indices(local, table, block, indices, index_map, dims):
    """Indices into ``table``'s split ``dims`` made local to this device's ``block``, and which
    of them fall in it (the others are clipped and must be masked out by the caller)."""
    in_range = jnp.ones(indices.shape[:-1], bool)
    for k in dims:
        pos = index_map.index(k)
        idx, _ = local.shard_index(table, k)
        component = indices[..., pos] - (idx * block.shape[k]).astype(indices.dtype)
        in_range &= (component >= 0) & (component < block.shape[k])
        indices = indices.at[..., pos].set(jnp.clip(component, 0, block.shape[k] - 1))
    return indices, in_range


def _split_indexed_dims(local, table, index_map, collapsed):
    return [k for k in index_map if k in collapsed and split_axes(local.p.sbp[table], k, local.names)]


@local_rule(lax.gather_p.name)
def _gather(local, eqn, ins):
    operand, indices = ins
    table = eqn.invars[0]
    dn = eqn.params["dimension_numbers"]
    sizes = tuple(operand.shape[d] if s == table.aval.shape[d] else s
                  for d, s in enumerate(eqn.params["slice_sizes"]))
    params = dict(eqn.params, slice_sizes=sizes)
    split = _split_indexed_dims(local, table, dn.start_index_map, dn.collapsed_slice_dims)
    if not split:
        return lax.gather_p.bind(operand, indices, **params)
    # vocab-split table: look up the rows this device holds, zeros elsewhere (a partial sum)
    indices, in_range = _local_indices(local, table, operand, indices, dn.start_index_map, split)
    out = lax.gather_p.bind(operand, indices, **params)
    batch_dims = tuple(d for d in range(out.ndim) if d not in dn.offset_dims)
    return jnp.where(lax.broadcast_in_dim(in_range, out.shape, batch_dims), out, jnp.zeros_like(out))


@local_rule(lax.scatter_add_p.name)
def _scatter_add(local, eqn, ins):
    operand, indices, updates = ins
    table = eqn.invars[0]
    dn = eqn.params["dimension_numbers"]
    split = _split_indexed_dims(local, table, dn.scatter_dims_to_operand_dims, dn.inserted_window_dims)
    if split:  # vocab-split table: add only the updates of rows this device holds
        indices, in_range = _local_indices(local, table, operand, indices, dn.scatter_dims_to_operand_dims, split)
        scatter_dims = tuple(d for d in range(updates.ndim) if d not in dn.update_window_dims)
        updates = jnp.where(lax.broadcast_in_dim(in_range, updates.shape, scatter_dims), updates,
                            jnp.zeros_like(updates))
    return eqn.primitive.bind(operand, indices, updates, **eqn.params)


@local_rule(lax.scan_p.name)
def _scan(local, eqn, ins):
    p = eqn.params
    nc, nk = scan_arity(p)
    body = local.body_fn(p["jaxpr"])
    consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]

    def step(carry, x):
        out = body(*consts, *carry, *x)
        return out[:nk], out[nk:]

    carry, ys = lax.scan(step, list(init), list(xs), length=p["length"], reverse=p["reverse"],
                         unroll=p["unroll"])
    return list(carry) + list(ys)


@local_rule(lax.while_p.name)
def _while(local, eqn, ins):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond, body = local.body_fn(p["cond_jaxpr"]), local.body_fn(p["body_jaxpr"])
    cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    return lax.while_loop(lambda c: cond(*cconsts, *c)[0], lambda c: body(*bconsts, *c), list(init))


@local_rule(lax.cond_p.name)
def _cond(local, eqn, ins):
    branches = [local.body_fn(b) for b in eqn.params["branches"]]
    return lax.switch(ins[0], branches, *ins[1:])


@local_rule(*REMAT)
def _checkpoint(local, eqn, ins):
    body = local.body_fn(open_jaxpr(eqn.params["jaxpr"]))
    return jax.checkpoint(lambda *a: body(*a), prevent_cse=eqn.params["prevent_cse"],
                          policy=eqn.params["policy"])(*ins)


def lower(program: Program, donated: tuple = ()):
    """The jitted SPMD callable of a boxed program, taking and returning flat global arrays;
    ``donated``: flat argument indices whose buffers the outputs may reuse."""
    local = Local(program)
    jaxpr = program.jaxpr
    mesh = program.mesh
    in_specs = tuple(to_partition_spec(s, mesh, len(v.aval.shape)) for v, s in zip(jaxpr.jaxpr.invars, program.in_sbp))
    out_specs = tuple(to_partition_spec(program.sbp[v] if not is_literal(v) else None, mesh, len(v.aval.shape))
                      for v in jaxpr.jaxpr.outvars)

    def per_device(*args):
        return tuple(local.eval(jaxpr.jaxpr, jaxpr.consts, args))

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(mapped, donate_argnums=donated), in_specs, out_specs
