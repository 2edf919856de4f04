"""lower: a boxed Program -> one ``jax.jit(jax.shard_map(local program))``.

Requires "boxed" (``passes.boxing``): every operand has the NdSbp its equation's Decision needs
and every sharding change is an ``sf_box`` equation. Produces a per-device function, traced
inside ``shard_map`` over all mesh axes, in which each value is its local block. Each equation
runs through its rule's ``lower`` (``shardflow.registry``) — shape params at local shapes, shard
offsets, the chosen signature's local meaning, a box's collectives — or, without one, is bound
unchanged. Nothing is decided here.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr

from shardflow import registry
from shardflow.program import Program, is_literal
from shardflow.registry import Loop
from shardflow.specs import axis_sizes, local_shape, split_axes, to_partition_spec


class Slices(list):
    """A stacked output of a loop lowered unrolled: its blocks, one per trip, in index order.
    An unrolled loop takes them as its sliced input as they are; anything else reads them
    stacked (``Local.eval`` stacks them once, on first use)."""

    def stacked(self):
        return jnp.stack(self)


class Local:
    """Evaluates a boxed jaxpr on local blocks inside shard_map; what a rule's ``lower`` sees."""

    def __init__(self, program: Program):
        self.p = program
        self.names = program.axis_names
        self.sizes = axis_sizes(program.mesh)
        self.loop = None  # the loop whose body is being evaluated: "rolled" or "unrolled"

    @contextlib.contextmanager
    def looping(self, kind: str = "rolled"):
        outer, self.loop = self.loop, kind
        try:
            yield
        finally:
            self.loop = outer

    def sbp(self, var) -> tuple:
        return self.p.sbp[var]

    def shape(self, var) -> tuple:
        return local_shape(var.aval.shape, self.p.sbp[var], self.p.mesh)

    def shard_index(self, var, dim):
        """(index of this device's block along ``dim``, number of blocks)."""
        idx, count = jnp.int32(0), 1
        for a in split_axes(self.p.sbp[var], dim, self.names):
            idx = idx * self.sizes[a] + lax.axis_index(a)
            count *= self.sizes[a]
        return idx, count

    def eval(self, jaxpr: Jaxpr, consts, args):
        env = {}

        def read(a):  # a literal as an array of its aval's dtype (rules read .shape / .dtype)
            return np.asarray(a.val, a.aval.dtype) if is_literal(a) else env[a]

        def stacked(a):
            x = read(a)
            if isinstance(x, Slices):
                x = env[a] = x.stacked()
            return x

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            region = registry.region_of(eqn)
            ins = [read(a) if isinstance(region, Loop) else stacked(a) for a in eqn.invars]
            rule = registry.rule_of(eqn.primitive)
            if rule is not None and rule.lower is not None:
                outs = rule.lower(self, eqn, ins)
            elif isinstance(region, Loop):
                outs = self.loop_region(eqn, region, ins)
            else:
                outs = eqn.primitive.bind(*ins, **registry.bind_params(eqn))
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, DropVar):
                    env[v] = x
        return [stacked(a) for a in jaxpr.outvars]

    def loop_region(self, eqn, loop: Loop, ins) -> list:
        """A loop unrolled (``passes.unroll`` decided so) keeps its stacked outputs as one block
        per trip (``Slices``), which the next unrolled loop (the backward's) takes as they are.
        Rolled, it is a ``fori_loop`` whose stacked outputs start as uninitialised buffers
        (``lax.empty``) and take one slice a trip; ``lax.scan`` starts them as zeros, which XLA
        materialises (48 GB of writes a step for the 1b step's residuals)."""
        nc, nk, n = loop.consts, loop.carries, loop.trips
        body = self.body_fn(eqn.params[loop.body])
        consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        if n == 0:  # no trips: the carries as they came, the stacked outputs empty
            return list(init) + [
                None if isinstance(v, DropVar) else jnp.zeros(self.shape(v), v.aval.dtype) for v in eqn.outvars[nk:]
            ]
        order = lambda i: n - 1 - i if loop.reverse else i  # noqa: E731
        if registry.decision_of(eqn).unrolled:
            carry, ys = list(init), [{} for _ in eqn.outvars[nk:]]

            def trip_after(k, after):
                """Trip k's slices, through an optimization barrier with ``after``: the carries
                the trip before it starts from. A collective of them is then this loop's own —
                the same gather of a layer's weight in a forward and in its backward are two,
                which XLA would merge and hold from one to the other — and may still run a trip
                ahead, beside the trip before's compute."""
                trip = [x[k] if isinstance(x, Slices) else lax.index_in_dim(x, k, keepdims=False) for x in xs]
                return lax.optimization_barrier((trip, after))[0] if apart and trip and after else trip

            apart = registry.decision_of(eqn).apart
            with self.looping("unrolled"):
                trip = trip_after(order(0), carry)
                for i in range(n):
                    k = order(i)
                    ahead = trip_after(order(i + 1), carry) if i + 1 < n else None
                    out = body(*consts, *carry, *trip)
                    carry = list(out[:nk])
                    for y, o in zip(ys, out[nk:]):
                        y[k] = o
                    trip = ahead
            return carry + [Slices(y[k] for k in range(n)) for y in ys]
        xs = [x.stacked() if isinstance(x, Slices) else x for x in xs]
        ys = [None if isinstance(v, DropVar) else lax.empty(self.shape(v), v.aval.dtype) for v in eqn.outvars[nk:]]
        assert all(y is None or y.shape[0] == n for y in ys), "a loop's stacked dim is never split"

        def step(i, state):
            carry, ys = state
            k = order(i)
            out = body(*consts, *carry, *(lax.dynamic_index_in_dim(x, k, keepdims=False) for x in xs))
            ys = [y if y is None else lax.dynamic_update_index_in_dim(y, o, k, 0) for y, o in zip(ys, out[nk:])]
            return list(out[:nk]), ys

        with self.looping():
            carry, ys = lax.fori_loop(0, n, step, (list(init), ys), unroll=loop.unroll)
        return list(carry) + list(ys)

    def body_fn(self, jaxpr):
        closed = jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, ())
        return lambda *args: self.eval(closed.jaxpr, closed.consts, args)


def lower(program: Program) -> Program:
    """The program with ``lowered``: (its jitted SPMD callable, taking and returning flat global
    arrays; the PartitionSpec of each input). Inputs in ``program.donated`` give the outputs
    their buffers."""
    local = Local(program)
    closed, mesh = program.jaxpr, program.mesh

    def specs(values, sbps, orders):
        orders = orders or ((),) * len(sbps)
        return tuple(to_partition_spec(s, mesh, len(v.aval.shape), o) for v, s, o in zip(values, sbps, orders))

    in_specs = specs(closed.jaxpr.invars, program.in_sbp, program.in_orders)
    out_specs = specs(closed.jaxpr.outvars, program.out_sbp, program.out_orders)

    def per_device(*args):
        return tuple(local.eval(closed.jaxpr, closed.consts, args))

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    fn = jax.jit(mapped, donate_argnums=program.donated, compiler_options=compiler_options(mesh))
    return program.replace(lowered=(fn, in_specs))


def compiler_options(mesh) -> dict:
    """XLA options of the lowered program. On GPUs, no dynamic-slice fusion: XLA clones a
    custom call whose result a scan also stacks for the backward (a layer's attention output
    and LSE), one copy fused with the stacking, one for the layer: the Pallas attention forward
    ran twice per layer, 7 ms of a 226 ms step (1b, dp over 4 H200s; 220 ms without it)."""
    if mesh.devices.flat[0].platform != "gpu":
        return {}
    return {"xla_gpu_enable_dynamic_slice_fusion": False}
