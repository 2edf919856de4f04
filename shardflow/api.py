"""``sf.parallelize``: trace, run the pass list (``shardflow.pipeline``), lower; cached per argument shapes."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.tree_util import keystr, tree_flatten_with_path

from shardflow import pipeline
from shardflow.passes.lower import lower
from shardflow.explain import Plan, make_plan
from shardflow.mesh import LinkModel, check_mesh
from shardflow.program import Program, trace
from shardflow.specs import (Partial, ShardingError, check_divisible, describe, format_sbp, is_spec_leaf,
                             split_orders, to_sbp)


def _flat_specs(specs, tree_of, what: str, paths):
    """Broadcast a spec prefix tree over the flat leaves of ``tree_of``."""
    try:
        flat = jax.tree.leaves(jax.tree.broadcast(specs, tree_of, is_leaf=is_spec_leaf), is_leaf=is_spec_leaf)
    except ValueError as e:
        raise ShardingError(f"{what} {specs!r} do not match the {what.split('_')[0]}put tree: {e}") from None
    if len(flat) != len(paths):
        raise ShardingError(f"{what} {specs!r} give {len(flat)} specs for {len(paths)} values")
    return flat


@dataclasses.dataclass
class Compiled:
    program: Program            # the boxed program
    fn: Callable                # jitted shard_map over flat global arrays
    in_shardings: tuple
    out_tree: Any
    arg_names: tuple


class Parallelized:
    def __init__(self, fn, *, mesh: Mesh, in_specs, out_specs=None, links: LinkModel | None = None,
                 donate_argnums=(), passes=None):
        self.fn = fn
        self.donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self.mesh = check_mesh(mesh, _definition(fn))
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.links = links or LinkModel()
        self.passes = pipeline.DEFAULT if passes is None else tuple(passes)
        self._cache: dict = {}
        functools.update_wrapper(self, fn)

    # ------------------------------------------------------------------ compile

    def _compile(self, args, kwargs=None) -> Compiled:
        if kwargs:
            raise TypeError(
                f"{_definition(self.fn)} was called with keyword arguments {sorted(kwargs)}; "
                "in_specs are positional, so pass every array positionally, or bind the others "
                "with functools.partial before parallelize")
        leaves, in_tree = jax.tree.flatten(args)
        avals = tuple(jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in leaves)
        key = (in_tree, avals)
        if key not in self._cache:
            self._cache[key] = self._build(args, in_tree, avals)
        return self._cache[key]

    def _build(self, args, in_tree, avals) -> Compiled:
        paths = [keystr(p) for p, _ in tree_flatten_with_path(args)[0]]
        names = tuple(f"args{p}" for p in paths)
        where = _definition(self.fn)
        in_specs = _flat_specs(self.in_specs, args, "in_specs", paths)
        in_sbp, in_orders = zip(*[self._boundary(spec, aval, f"argument {name}", "in_specs")
                                  for name, aval, spec in zip(names, avals, in_specs)]) if avals else ((), ())

        out_trees = []

        def flat_fn(*flat):
            leaves, tree = jax.tree.flatten(self.fn(*jax.tree.unflatten(in_tree, flat)))
            out_trees.append(tree)
            return leaves

        closed = trace(flat_fn, *avals)
        (out_tree,) = out_trees
        out_sbp, out_orders = self._out_sbp(closed, out_tree)
        program = Program(closed, self.mesh, tuple(in_sbp), out_sbp, links=self.links, arg_names=names,
                          in_orders=tuple(in_orders), out_orders=out_orders)
        program = pipeline.run(program, self.passes)
        donated = tuple(i for i, (path, _) in enumerate(tree_flatten_with_path(args)[0])
                        if path[0].idx in self.donate_argnums)
        fn, in_ps = lower(program, donated)
        shardings = tuple(NamedSharding(self.mesh, p) for p in in_ps)
        return Compiled(program, fn, shardings, out_tree, names)

    def _out_sbp(self, closed, out_tree):
        outs = closed.jaxpr.outvars
        if self.out_specs is None:
            return (None,) * len(outs), ()
        shaped = jax.tree.unflatten(out_tree, list(range(len(outs))))
        try:
            flat = jax.tree.leaves(jax.tree.broadcast(self.out_specs, shaped, is_leaf=is_spec_leaf),
                                   is_leaf=is_spec_leaf)
        except ValueError as e:
            raise ShardingError(f"out_specs {self.out_specs!r} do not match the output tree {out_tree}: {e}") from None
        pairs = [self._boundary(spec, v.aval, f"output {i}", "out_specs") for i, (v, spec) in enumerate(zip(outs, flat))]
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)

    def _boundary(self, spec, aval, name: str, kind: str):
        """(NdSbp, split orders) of an input or output spec; a P there is refused."""
        where = _definition(self.fn)
        what = f"{name} {describe(aval)} of {where}"
        sbp = to_sbp(spec, self.mesh, len(aval.shape), what=what, any_order=True)
        if any(isinstance(s, Partial) for s in sbp):
            raise ShardingError(f"{what}: {kind} {format_sbp(sbp)} has P; inputs and outputs are whole values "
                                "(B or S): outputs are reduced")
        check_divisible(aval.shape, aval.dtype, sbp, self.mesh, what=name, source=where)
        return sbp, split_orders(spec, self.mesh)

    # ------------------------------------------------------------------ public

    def __call__(self, *args, **kwargs):
        c = self._compile(args, kwargs)
        leaves = [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(args), c.in_shardings)]
        return jax.tree.unflatten(c.out_tree, c.fn(*leaves))

    def lower(self, *args, **kwargs):
        c = self._compile(args, kwargs)
        structs = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=s)
                   for x, s in zip(jax.tree.leaves(args), c.in_shardings)]
        return c.fn.lower(*structs)

    def explain(self, *args, **kwargs) -> Plan:
        c = self._compile(args, kwargs)
        return make_plan(c.program)

    def program(self, *args, **kwargs) -> Program:
        """The boxed Program (a jaxpr with explicit ``sf_box`` conversions), for inspection."""
        return self._compile(args, kwargs).program


def _definition(fn) -> str:
    """``name (file.py:LINE)`` of the user's function, for errors about its arguments/outputs."""
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__name__", type(fn).__name__)
    if code is None:
        return name
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def parallelize(fn=None, *, mesh: Mesh, in_specs, out_specs=None, links: LinkModel | None = None,
                donate_argnums=(), passes=None):
    """Run single-device ``fn`` as one SPMD program on ``mesh``.

    ``in_specs`` / ``out_specs`` are pytree prefixes of the arguments / outputs; leaves are SBP
    (``(sf.S(0), sf.B)``, ``"S(0), B"``) or ``PartitionSpec``. ``out_specs=None``: as propagated.
    ``donate_argnums``: as in ``jax.jit`` — a training step donates its parameters and optimizer
    state so their buffers hold the new ones. ``passes``: the pass list (default
    ``sf.pipeline.DEFAULT``; see ``shardflow.pipeline`` to insert one). Usable as a decorator:
    ``@sf.parallelize(mesh=..., in_specs=...)``.
    """
    kwargs = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs, links=links, donate_argnums=donate_argnums,
                  passes=passes)
    if fn is None:
        return lambda f: Parallelized(f, **kwargs)
    return Parallelized(fn, **kwargs)
