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
from shardflow.rules.control import Slices
from shardflow.specs import axis_sizes, local_shape, split_axes, to_partition_spec


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
            ins = [read(a) if eqn.primitive is lax.scan_p else stacked(a) for a in eqn.invars]
            rule = registry.rule_of(eqn.primitive)
            if rule is not None and rule.lower is not None:
                outs = rule.lower(self, eqn, ins)
            else:
                outs = eqn.primitive.bind(*ins, **registry.bind_params(eqn))
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, DropVar):
                    env[v] = x
        return [stacked(a) for a in jaxpr.outvars]

    def body_fn(self, jaxpr):
        closed = jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, ())
        return lambda *args: self.eval(closed.jaxpr, closed.consts, args)


def lower(program: Program, donated: tuple = ()):
    """(the jitted SPMD callable of a boxed program, taking and returning flat global arrays;
    the PartitionSpec of each input). ``donated``: flat argument indices whose buffers the
    outputs may reuse."""
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
    return jax.jit(mapped, donate_argnums=donated, compiler_options=compiler_options(mesh)), in_specs


def compiler_options(mesh) -> dict:
    """XLA options of the lowered program. On GPUs, no dynamic-slice fusion: XLA clones a
    custom call whose result a scan also stacks for the backward (a layer's attention output
    and LSE), one copy fused with the stacking, one for the layer: the Pallas attention forward
    ran twice per layer, 7 ms of a 226 ms step (1b, dp over 4 H200s; 220 ms without it)."""
    if mesh.devices.flat[0].platform != "gpu":
        return {}
    return {"xla_gpu_enable_dynamic_slice_fusion": False}
