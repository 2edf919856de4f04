"""``sf.parallelize``: trace, run the pass list (``shardflow.passes``), lower; cached per argument shapes."""

from __future__ import annotations

import dataclasses
import fractions
import functools
import math
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.tree_util import keystr, tree_flatten_with_path

from shardflow.explain import Plan, make_plan
from shardflow.links import LinkModel
from shardflow.mesh import check_mesh
from shardflow.passes import ALL as ALL_PASSES
from shardflow.passes import DEFAULT as DEFAULT_PASSES
from shardflow.passes import Pass
from shardflow.passes import run as run_passes
from shardflow.program import Program, all_eqns, trace
from shardflow.registry import decision_of
from shardflow.specs import (
    AUTO,
    B,
    Partial,
    ShardingError,
    check_divisible,
    definition,
    describe,
    format_sbp,
    is_spec_leaf,
    is_user_file,
    split_orders,
    to_sbp,
)


def spec_of_each_leaf(specs, values, specs_name: str, values_name: str, noun: str, where: str) -> list:
    """(the path of its spec in ``specs``, the spec) for each leaf of ``values``, in flatten order.
    ``specs`` is a pytree prefix of ``values`` whose leaves are specs, as shard_map's in_specs;
    ``noun`` names one leaf of ``values`` (argument, output) in errors."""
    out = []

    def walk(spec, value, path):
        spec_children, spec_node = _children(spec)
        if is_spec_leaf(spec) or jax.tree_util.treedef_is_leaf(spec_node):
            out.extend([(specs_name + keystr(path), spec)] * len(jax.tree.leaves(value)))
            return
        value_children, value_node = _children(value)
        if spec_node != value_node:
            spec_name, value_name = specs_name + keystr(path), values_name + keystr(path)
            raise ShardingError(
                f"{spec_name} {spec!r} do not match the structure of {value_name} of {where}: "
                f"{_difference(spec, value, spec_name, value_name, noun)}; {specs_name} is a pytree prefix "
                f"of the {noun}s, as in shard_map"
            )
        for (key, s), (_, v) in zip(spec_children, value_children):
            walk(s, v, path + key)

    walk(specs, values, ())
    return out


def _children(tree):
    """((key path, child) of each child of the root of ``tree``, the root alone as a PyTreeDef)."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda node: node is not tree)


def _difference(spec, value, spec_name: str, value_name: str, noun: str) -> str:
    """What differs between a node of a spec tree and the node of values it is meant to match."""
    if type(spec) is not type(value):
        return f"{spec_name} is {_a(spec)}, {value_name} {_a(value)}"
    spec_keys = [keystr(k) for k, _ in _children(spec)[0]]
    value_keys = [keystr(k) for k, _ in _children(value)[0]]
    missing = [f"no spec for {value_name}{k}" for k in value_keys if k not in spec_keys]
    extra = [f"{spec_name}{k} matches no {noun}" for k in spec_keys if k not in value_keys]
    if missing or extra:
        return ", ".join(missing + extra)
    return f"{spec_name} is {jax.tree.structure(spec)}, {value_name} {jax.tree.structure(value)}"


def _a(x) -> str:
    """``a float32[8, 12] array``, ``a tuple of 2``, ``a dict with keys ['w1']``."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a {describe(x)} array"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(x, key=repr)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"


@dataclasses.dataclass
class Compiled:
    program: Program  # the boxed program
    fn: Callable  # jitted shard_map over flat global arrays
    in_shardings: tuple
    out_tree: Any
    arg_names: tuple


class Parallelized:
    def __init__(
        self,
        fn,
        *,
        mesh: Mesh,
        in_specs,
        out_specs=None,
        links: LinkModel | None = None,
        donate_argnums=(),
        passes=None,
        memory_budget: int | str | None = None,
        stationary=(),
    ):
        self.fn = fn
        self.memory_budget = memory_budget_bytes(memory_budget, definition(fn))
        self.stationary = (stationary,) if isinstance(stationary, str) else tuple(stationary)
        self.donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self.mesh = check_mesh(mesh, definition(fn))
        unknown = [a for a in self.stationary if a not in self.mesh.axis_names]
        if unknown:
            raise ShardingError(
                f"stationary={self.stationary!r} of {definition(fn)}: {unknown} not axes of the mesh "
                f"{dict(self.mesh.shape)}"
            )
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.links = links or LinkModel()
        self.passes = DEFAULT_PASSES if passes is None else pass_list(passes, definition(fn))
        self._cache: dict = {}
        functools.update_wrapper(self, fn)

    # ------------------------------------------------------------------ compile

    def _compile(self, args, kwargs=None) -> Compiled:
        if kwargs:
            raise TypeError(
                f"{definition(self.fn)} was called with keyword arguments {sorted(kwargs)}; "
                "in_specs are positional, so pass every array positionally, or bind the others "
                "with functools.partial before parallelize"
            )
        leaves, in_tree = jax.tree.flatten(args)
        avals = tuple(jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in leaves)
        key = (in_tree, avals)
        if key not in self._cache:
            self._cache[key] = self._build(args, in_tree, avals)
        return self._cache[key]

    def _build(self, args, in_tree, avals) -> Compiled:
        names = tuple(f"args{keystr(p)}" for p, _ in tree_flatten_with_path(args)[0])
        in_specs = spec_of_each_leaf(self.in_specs, args, "in_specs", "args", "argument", definition(self.fn))
        in_sbp, in_orders = (
            zip(
                *[
                    self._boundary(spec, aval, f"{spec_path} for argument {name}")
                    for name, aval, (spec_path, spec) in zip(names, avals, in_specs)
                ]
            )
            if avals
            else ((), ())
        )

        out_trees = []

        def flat_fn(*flat):
            leaves, tree = jax.tree.flatten(self.fn(*jax.tree.unflatten(in_tree, flat)))
            out_trees.append(tree)
            return leaves

        closed = trace(flat_fn, *avals)
        (out_tree,) = out_trees
        out_sbp, out_orders = self._out_sbp(closed, out_tree)
        program = Program(
            closed,
            self.mesh,
            tuple(in_sbp),
            out_sbp,
            links=self.links,
            arg_names=names,
            in_orders=tuple(in_orders),
            out_orders=out_orders,
            memory_budget=self.memory_budget,
            stationary=self.stationary,
            donated=tuple(
                i for i, (path, _) in enumerate(tree_flatten_with_path(args)[0]) if path[0].idx in self.donate_argnums
            ),
        )
        program = run_passes(program, self.passes)
        replicated = replicated_axes(program)
        if replicated:
            warnings.warn(_replication(replicated, definition(self.fn)), stacklevel=_user_stacklevel())
        fn, in_ps = program.lowered
        shardings = tuple(NamedSharding(self.mesh, p) for p in in_ps)
        return Compiled(program, fn, shardings, out_tree, names)

    def _out_sbp(self, closed, out_tree):
        outs = closed.jaxpr.outvars
        if self.out_specs is None:
            return (None,) * len(outs), ()
        shaped = jax.tree.unflatten(out_tree, [v.aval for v in outs])
        specs = spec_of_each_leaf(self.out_specs, shaped, "out_specs", "output", "output", definition(self.fn))
        pairs = [
            self._boundary(spec, v.aval, f"{spec_path} for output {i}")
            for i, (v, (spec_path, spec)) in enumerate(zip(outs, specs))
        ]
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)

    def _boundary(self, spec, aval, name: str):
        """(NdSbp, split orders) of an input or output spec; a P there is refused. ``name`` says
        which spec of which value (``in_specs[0] for argument args[0]['w1']``)."""
        where = definition(self.fn)
        what = f"{name} {describe(aval)} of {where}"
        if spec is AUTO:
            if name.startswith("out_specs"):
                raise ShardingError(
                    f"{what}: sf.AUTO is an in_specs leaf; leave an output's spec None for the planner to choose it"
                )
            return None, ()  # the solver chooses it (passes.solve)
        sbp = to_sbp(spec, self.mesh, len(aval.shape), what=what, any_order=True)
        if any(isinstance(s, Partial) for s in sbp):
            raise ShardingError(
                f"{what}: {format_sbp(sbp)} has P; inputs and outputs are whole values (B or S): outputs are reduced"
            )
        check_divisible(aval.shape, aval.dtype, sbp, self.mesh, what=name, source=where)
        return sbp, split_orders(spec, self.mesh)

    # ------------------------------------------------------------------ public

    def __call__(self, *args, **kwargs):
        c = self._compile(args, kwargs)
        leaves = [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(args), c.in_shardings)]
        return jax.tree.unflatten(c.out_tree, c.fn(*leaves))

    def lower(self, *args, **kwargs):
        c = self._compile(args, kwargs)
        structs = [
            jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=s)
            for x, s in zip(jax.tree.leaves(args), c.in_shardings)
        ]
        return c.fn.lower(*structs)

    def explain(self, *args, **kwargs) -> Plan:
        c = self._compile(args, kwargs)
        return make_plan(c.program)

    def program(self, *args, **kwargs) -> Program:
        """The boxed Program (a jaxpr with explicit ``sf_box`` conversions), for inspection."""
        return self._compile(args, kwargs).program


class ReplicatedAxisWarning(UserWarning):
    """A mesh axis over which the plan splits no value: the whole program repeated on each of
    its devices (``warnings.simplefilter("ignore", sf.ReplicatedAxisWarning)`` where intended)."""


def replicated_axes(program: Program) -> list:
    """(name, size) of each mesh axis of more than one device on which every value of the
    planned ``program`` is B, and every operand an equation takes and makes."""
    used = set()
    names = program.axis_names
    layouts = [*program.sbp.values(), *program.in_sbp, *program.out_sbp]
    for eqn in all_eqns(program.jaxpr.jaxpr):
        d = decision_of(eqn)
        if d is not None:
            layouts += [*d.ins, *d.outs]
    for sbp in layouts:
        used.update(a for a, s in zip(names, sbp or ()) if s != B)
    return [(a, n) for a, n in zip(names, program.mesh.devices.shape) if n > 1 and a not in used]


def _replication(replicated: list, where: str) -> ReplicatedAxisWarning:
    one = len(replicated) == 1
    axes = " and ".join(f"{a!r} ({n} devices)" for a, n in replicated)
    it = "it" if one else "them"
    warning = ReplicatedAxisWarning(
        f"mesh {'axis' if one else 'axes'} {axes} of {where}: no value is split or partial over {it}: every "
        f"device along {it} runs the same work on the same data. Split an argument over {'it' if one else 'each'} "
        f"in in_specs, or leave {it} out of the mesh, unless the {math.prod(n for _, n in replicated)} copies are "
        "intended"
    )
    warning.axes = replicated
    return warning


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised here that points at the innermost frame of user code."""
    frame, level = sys._getframe(1), 1
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AMOUNT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_BUDGET_FORMS = (
    "an int of bytes (40_000_000_000, 40e9) or a string with units: '40GB' (10^9 bytes) or "
    "'40GiB' (2^30 bytes); B, KB, MB, GB, TB and KiB, MiB, GiB, TiB"
)


def memory_budget_bytes(budget, where: str) -> int | None:
    """``memory_budget`` in bytes: an int of bytes (a float of a whole number, ``40e9``, too) or
    a string of a number and a unit — ``"40GB"`` (decimal: KB, MB, GB, TB are 10^3 .. 10^12
    bytes), ``"40GiB"`` (binary: KiB .. TiB are 2^10 .. 2^40), ``"4096"`` or ``"4096B"`` bytes —,
    units in any case, rounded down to whole bytes; None stays None. Anything else, or a budget
    under one byte, is a ShardingError naming ``where`` (the user's function)."""
    what = f"memory_budget={budget!r} of {where}"
    if budget is None:
        return None
    if isinstance(budget, str):
        amount = _AMOUNT.fullmatch(budget)
        if amount is None or amount.group(2).lower() not in _UNITS:
            raise ShardingError(f"{what}: cannot read it as a memory size; a memory budget is {_BUDGET_FORMS}")
        nbytes = int(fractions.Fraction(amount.group(1)) * _UNITS[amount.group(2).lower()])
    elif isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, float, np.integer, np.floating)):
        raise ShardingError(f"{what} is a {type(budget).__name__}; a memory budget is {_BUDGET_FORMS}")
    elif not float(budget).is_integer():
        raise ShardingError(f"{what}: not a whole number of bytes; a memory budget is {_BUDGET_FORMS}")
    else:
        nbytes = int(budget)
    if nbytes < 1:
        raise ShardingError(
            f"{what} is {nbytes:,} bytes; a memory budget is a positive number of bytes per device: {_BUDGET_FORMS}"
        )
    return nbytes


def pass_list(passes, where: str) -> tuple:
    """``passes`` as a tuple of Pass objects, each named one (``"solve"``) resolved to the pass
    of that name; a ShardingError naming ``where`` for an unknown name, an entry of another
    type, or a list that does not end lowered."""
    known = {p.name: p for p in ALL_PASSES}
    if isinstance(passes, (str, Pass)):
        passes = (passes,)
    out = []
    for i, p in enumerate(passes):
        if isinstance(p, str):
            if p not in known:
                raise ShardingError(
                    f"passes[{i}] {p!r} of {where}: no pass is named {p!r}; the passes are "
                    f"{', '.join(map(repr, known))}, or Pass objects (sf.passes.DEFAULT, "
                    "sf.passes.SOLVER)"
                )
            p = known[p]
        elif not isinstance(p, Pass):
            raise ShardingError(
                f"passes[{i}] {p!r} of {where}: neither a Pass nor a pass's name; the passes are "
                f"{', '.join(map(repr, known))}, or Pass objects (sf.passes.DEFAULT, sf.passes.SOLVER)"
            )
        out.append(p)
    names = tuple(p.name for p in out)
    facts: set = set()  # a pass run before the facts it requires is refused as it runs (Pass.__call__)
    for p in out:
        facts = (facts - {f.name for f in p.invalidates}) | {f.name for f in p.ensures}
    if "lowered" not in facts:
        raise ShardingError(
            f"passes {names} of {where}: end without 'lowered'; end the list with 'boxing', "
            f"'unroll', 'lower', as sf.passes.DEFAULT {tuple(q.name for q in DEFAULT_PASSES)} does"
        )
    return tuple(out)


def parallelize(
    fn=None,
    *,
    mesh: Mesh,
    in_specs,
    out_specs=None,
    links: LinkModel | None = None,
    donate_argnums=(),
    passes=None,
    memory_budget: int | str | None = None,
    stationary=(),
):
    """Run single-device ``fn`` as one SPMD program on ``mesh``.

    ``in_specs`` / ``out_specs`` are pytree prefixes of the arguments / outputs; leaves are SBP
    (``(sf.S(0), sf.B)``, ``"S(0), B"``) or ``PartitionSpec``. ``out_specs=None``: as propagated.
    ``donate_argnums``: as in ``jax.jit`` — a training step donates its parameters and optimizer
    state so their buffers hold the new ones. ``passes``: the pass list (default
    ``sf.passes.DEFAULT``; see ``shardflow.passes`` to insert one), as Pass objects or their
    names (``["inline", "cse", "solve", "boxing", "unroll", "lower"]`` is ``sf.passes.SOLVER``). ``memory_budget``:
    what one device may hold, for the solver (``sf.passes.SOLVER``; default: a GPU's memory):
    an int of bytes, or a string of a number and a unit — ``"40GB"`` (KB, MB, GB, TB: powers of
    1000), ``"40GiB"`` (KiB, MiB, GiB, TiB: powers of 1024), units in any case, rounded down to
    whole bytes. It bounds the inputs and what the layer loops hold (their stacked outputs and
    their operands, a layer's weights as the loop takes them), explain's ``memory_bytes``;
    partial: other intermediates and temporaries are not counted yet. Usable as a decorator:
    ``@sf.parallelize(mesh=..., in_specs=...)``. ``stationary``: mesh axes over which the
    planners move no input (nor its casts, nor a loop's slices of it) away from its spec, as
    tensor parallelism keeps its weights: activations move instead. A move that no plan can
    avoid is still made, at a price that ranks it after every other plan, and explain lists it.
    """
    kwargs = dict(
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        links=links,
        donate_argnums=donate_argnums,
        passes=passes,
        memory_budget=memory_budget,
        stationary=stationary,
    )
    if fn is None:
        return lambda f: Parallelized(f, **kwargs)
    return Parallelized(fn, **kwargs)
