"""SBP: how one tensor lies on a device mesh.

Per mesh axis a tensor is one of
  ``S(d)``  split along tensor dim ``d``,
  ``B``     broadcast (every device holds the whole tensor),
  ``P``     partial (the global value is the sum — or max — of the local ones).
An ``NdSbp`` is a tuple with one entry per mesh axis, in mesh order. When several mesh axes
split the same tensor dim, the dim is split in mesh order (the earlier axis is the major one),
exactly like ``PartitionSpec(("data", "model"))`` on a ``Mesh(("data", "model"))``.

``PartitionSpec`` converts both ways: a dim naming axis ``a`` <-> ``S(dim)`` on ``a``; an axis
named nowhere <-> ``B``; ``unreduced={a}`` <-> ``P`` on ``a``.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
from collections.abc import Sequence

import jax
import numpy as np
from jax.extend import source_info_util
from jax.sharding import Mesh, PartitionSpec

from shardflow import _compat

# ----------------------------------------------------------------------------- the user's code
# shardflow is library code like JAX, never "your line" — except its trainer (shardflow/train/),
# code a user reads and edits like their own train.py. passes/ registers itself.
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
source_info_util.register_exclusion(_PACKAGE + os.sep)
_compat.register_inclusion(os.path.join(_PACKAGE, "train") + os.sep)

_INSTALLED = re.compile(r"[\\/](?:site|dist)-packages[\\/]")


def is_user_file(file_name: str) -> bool:
    """Whether ``file_name`` is the user's code: not JAX, the stdlib or shardflow (JAX's exclusions),
    nor an installed package such as optax or flax. JAX's stdlib exclusion covers site-packages
    only where the stdlib directory contains it (pyenv), not in a virtualenv."""
    return _compat.is_user_filename(file_name) and not _INSTALLED.search(file_name)


def installed_file(file_name: str) -> str | None:
    """``optax/_classification.py`` for a file of an installed package other than JAX's, else None."""
    found = _INSTALLED.search(file_name)
    if found is None:
        return None
    package = re.split(r"[\\/]", file_name[found.end() :])[0]
    return None if package in ("jax", "jaxlib") else f"{package}/{os.path.basename(file_name)}"


def user_line() -> str:
    """``file.py:LINE`` of the innermost frame of the user's code on the Python stack, "" if none.
    Generated code (a dataclass's ``__init__``, file ``<string>``) is the module's it runs in."""
    frame = sys._getframe(1)
    while frame is not None:
        file_name = frame.f_code.co_filename
        if file_name.startswith("<"):
            file_name = frame.f_globals.get("__file__") or file_name
        if is_user_file(file_name):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def definition(fn) -> str:
    """``name (file.py:LINE)`` of a user's function, for errors about it, its arguments and outputs:
    the function a wrapper wraps (``jax.value_and_grad(loss)``: ``loss``'s line), and a
    ``functools.partial``'s function."""
    while True:
        inner = getattr(fn, "__wrapped__", None) or (fn.func if isinstance(fn, functools.partial) else None)
        if inner is None or inner is fn:
            break
        fn = inner
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__name__", type(fn).__name__)
    if code is None:
        return name
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


class ShardingError(ValueError):
    """Every refusal of shardflow: names the value, the spec and the user's source line.

    The message starts with the line of the user's code that called into shardflow when the
    error was made (``train.py:40: ...``, as a compiler's diagnostics do); ``message`` is the rest.
    """

    def __init__(self, message: str, line: str | None = None):
        self.message = message
        self.line = user_line() if line is None else line
        super().__init__(f"{self.line}: {message}" if self.line else message)

    def __reduce__(self):
        return type(self), (self.message, self.line)


class _Atom:
    """An SBP of one mesh axis: immutable, and interned — one object per value, so that the
    NdSbp tuples the planners key their tables by hash and compare by identity, in C (as
    dataclasses they hashed in Python: 8M calls building the 1b step's integer program)."""

    __slots__ = ("_key",)
    _interned: dict

    def __init_subclass__(cls):
        cls._interned = {}

    @classmethod
    def _intern(cls, key):
        atom = cls._interned.get(key)
        if atom is None:
            atom = cls._interned[key] = object.__new__(cls)
            object.__setattr__(atom, "_key", key)
        return atom

    def __setattr__(self, name, value):
        raise AttributeError(f"{self!r} is immutable")

    def __reduce__(self):
        return type(self), self._key


class Split(_Atom):
    __slots__ = ()

    def __new__(cls, dim):
        if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)):
            raise ShardingError(f"S({dim!r}): S takes the tensor dim to split, an int (S(0), S(1), ...)")
        return cls._intern((int(dim),))

    @property
    def dim(self) -> int:
        return self._key[0]

    def __repr__(self):
        return f"S({self.dim})"


class Broadcast(_Atom):
    __slots__ = ()

    def __new__(cls):
        return cls._intern(())

    def __repr__(self):
        return "B"


class Partial(_Atom):
    __slots__ = ()

    def __new__(cls, op: str = "sum"):
        if op not in ("sum", "max", "min"):
            raise ShardingError(
                f"P({op!r}): a partial value is reduced by 'sum', 'max' or 'min' (sf.P, sf.P('max'), sf.P('min'))"
            )
        return cls._intern((op,))

    @property
    def op(self) -> str:
        return self._key[0]

    def __call__(self, op: str) -> Partial:
        return Partial(op)

    def __repr__(self):
        return "P" if self.op == "sum" else f"P({self.op})"


Sbp = Split | Broadcast | Partial
NdSbp = tuple  # tuple[Sbp, ...], one entry per mesh axis

S = Split
B = Broadcast()
P = Partial("sum")

_ATOM = re.compile(r"\s*(S\s*\(\s*(-?\d+)\s*\)|B|P\s*\(\s*['\"]?(sum|max|min)['\"]?\s*\)|P)\s*")


def is_sbp_atom(x) -> bool:
    return isinstance(x, (Split, Broadcast, Partial))


class _Auto:
    """``sf.AUTO``, an in_specs leaf: the whole-program solver (``passes.solve``) chooses that
    argument's layout along with every other sharding."""

    def __repr__(self):
        return "sf.AUTO"


AUTO = _Auto()


def is_spec_leaf(x) -> bool:
    """A leaf of an in_specs/out_specs tree: a PartitionSpec, an SBP string, an SBP tuple, None,
    sf.AUTO."""
    return (
        x is None
        or x is AUTO
        or isinstance(x, (PartitionSpec, str))
        or is_sbp_atom(x)
        or (isinstance(x, tuple) and len(x) > 0 and all(is_sbp_atom(a) for a in x))
    )


def parse_sbp_string(text: str) -> tuple:
    atoms = []
    for part in _split_top_level(text):
        m = _ATOM.fullmatch(part)
        if not m:
            raise ShardingError(f"cannot read SBP {part.strip()!r} in spec {text!r}: {_unreadable(part)}")
        tok = m.group(1)
        if tok.startswith("S"):
            atoms.append(Split(int(m.group(2))))
        elif tok == "B":
            atoms.append(B)
        elif tok == "P":
            atoms.append(P)
        else:
            atoms.append(Partial(m.group(3)))
    return tuple(atoms)


def _unreadable(part: str) -> str:
    """Why an entry of an SBP string is none of S(d), B, P, P(max), P(min)."""
    if not part.strip():
        return "an empty entry; expected S(d), B, P, P(max) or P(min)"
    if part.count("(") != part.count(")"):
        return "unbalanced parentheses; expected S(d), B, P, P(max) or P(min)"
    if part.strip().startswith("S("):
        return "S takes the tensor dim to split, an int (S(0), S(1), ...)"
    if part.strip().startswith("P("):
        return "a partial value is reduced by 'sum', 'max' or 'min': P, P(max) or P(min)"
    return "expected S(d), B, P, P(max) or P(min)"


def _split_top_level(text: str):
    depth, start = 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    yield text[start:]


def axis_sizes(mesh: Mesh) -> dict:
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def to_sbp(spec, mesh: Mesh, ndim: int | None = None, *, what: str = "value", any_order: bool = False) -> NdSbp:
    """Any accepted spec (NdSbp tuple, SBP string, PartitionSpec, None) -> NdSbp for ``mesh``.

    ``ndim`` (the tensor's rank) is checked when given; ``what`` names the value in errors.
    ``any_order``: accept a PartitionSpec that splits a dim over several axes against mesh order
    (``split_orders`` says which; the program boundary reorders such blocks with a ppermute).
    """
    names = tuple(mesh.axis_names)
    if spec is None:
        return (B,) * len(names)
    if is_sbp_atom(spec):
        spec = (spec,)
    if isinstance(spec, str):
        spec = _parse(spec, names, what)
    if isinstance(spec, PartitionSpec):
        sbp = _from_partition_spec(spec, mesh, ndim, what, any_order)
    elif not isinstance(spec, (tuple, list)):
        raise ShardingError(f"{what}: spec {spec!r} ({type(spec).__name__}) is not a sharding spec; {_forms(names)}")
    else:
        spec = tuple(spec)
        if not all(is_sbp_atom(a) for a in spec):
            raise ShardingError(
                f"{what}: spec {spec!r} is neither SBP (S(d), B, P) nor a PartitionSpec; {_forms(names)}"
            )
        if len(spec) != len(names):
            raise ShardingError(
                f"{what}: SBP spec {spec!r} has {len(spec)} entries but mesh axes {names} need {len(names)}"
            )
        sbp = spec
    if ndim is not None:
        for axis, s in zip(names, sbp):
            if isinstance(s, Split) and not (0 <= s.dim < ndim):
                raise ShardingError(
                    f"{what}: {s!r} on mesh axis {axis!r} under spec {format_sbp(sbp)} but the tensor has rank {ndim}"
                )
    return tuple(sbp)


def _forms(names) -> str:
    """The accepted spec forms, for mesh axes ``names``, as the end of an error message."""
    sbp = ["S(0)"] + ["B"] * (len(names) - 1)
    return (
        f"a spec is one SBP per mesh axis {names}, e.g. ({', '.join('sf.' + a for a in sbp)}) or "
        f"{', '.join(sbp)!r}, a PartitionSpec such as PartitionSpec({names[0]!r}), or None (whole)"
    )


def _parse(text: str, names, what) -> tuple:
    try:
        return parse_sbp_string(text)
    except ShardingError as e:
        hint = f"; did you mean PartitionSpec({text!r})?" if text in names else f"; {_forms(names)}"
        raise ShardingError(f"{what}: {e.message}{hint}") from None


def _from_partition_spec(spec: PartitionSpec, mesh: Mesh, ndim, what, any_order=False) -> NdSbp:
    names = tuple(mesh.axis_names)
    if ndim is not None and len(spec) > ndim:
        raise ShardingError(f"{what}: PartitionSpec {spec} is longer than the tensor's rank {ndim}")
    out = {a: B for a in names}
    seen = set()

    def take(axis, sbp):
        if axis not in out:
            raise ShardingError(f"{what}: unknown mesh axis {axis!r} in {spec}; the mesh has {names}")
        if axis in seen:
            raise ShardingError(f"{what}: mesh axis {axis!r} is used twice in {spec}")
        seen.add(axis)
        out[axis] = sbp

    for dim, entry in enumerate(spec.partitions):
        group = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
        order = [names.index(a) if a in names else -1 for a in group]
        for axis in group:
            take(axis, Split(dim))
        if order != sorted(order) and not any_order:
            raise ShardingError(
                f"{what}: {spec} splits dim {dim} over {group} against mesh order {names}; inside the "
                "program shardflow splits a dim over several axes in mesh order (in_specs and out_specs "
                "may use any order)"
            )
    for axis in sorted(getattr(spec, "unreduced", ()) or ()):
        take(axis, P)
    return tuple(out[a] for a in names)


def split_orders(spec, mesh: Mesh) -> tuple:
    """``((dim, axes), ...)`` for each dim that PartitionSpec ``spec`` splits over several mesh
    axes against mesh order (major first); () for any other spec."""
    if not isinstance(spec, PartitionSpec):
        return ()
    names = tuple(mesh.axis_names)
    out = []
    for dim, entry in enumerate(spec):
        group = tuple(entry) if isinstance(entry, tuple) else ()
        if len(group) > 1 and all(a in names for a in group):
            if [names.index(a) for a in group] != sorted(names.index(a) for a in group):
                out.append((dim, group))
    return tuple(out)


def to_partition_spec(sbp, mesh: Mesh, ndim: int | None = None, orders: tuple = ()) -> PartitionSpec:
    """NdSbp -> PartitionSpec (P axes become ``unreduced``); ``orders`` (``split_orders``) puts
    a dim's axes in another order than the mesh's."""
    sbp = to_sbp(sbp, mesh, ndim)
    names = tuple(mesh.axis_names)
    rank = ndim if ndim is not None else 1 + max([s.dim for s in sbp if isinstance(s, Split)], default=-1)
    dims = [[] for _ in range(rank)]
    unreduced = set()
    for axis, s in zip(names, sbp):
        if isinstance(s, Split):
            dims[s.dim].append(axis)
        elif isinstance(s, Partial):
            unreduced.add(axis)
    for dim, axes in orders:
        dims[dim] = list(axes)
    entries = [None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims]
    while entries and entries[-1] is None:
        entries.pop()
    if unreduced:
        return PartitionSpec(*entries, unreduced=frozenset(unreduced))
    return PartitionSpec(*entries)


def split_axes(sbp: NdSbp, dim: int, names: Sequence[str]) -> tuple:
    """The mesh axes that split tensor dim ``dim``, major first."""
    return tuple(a for a, s in zip(names, sbp) if isinstance(s, Split) and s.dim == dim)


def partial_axes(sbp: NdSbp, names: Sequence[str]) -> tuple:
    return tuple(a for a, s in zip(names, sbp) if isinstance(s, Partial))


def local_shape(shape: Sequence[int], sbp: NdSbp, mesh: Mesh) -> tuple:
    sizes = axis_sizes(mesh)
    out = list(shape)
    for axis, s in zip(mesh.axis_names, sbp):
        if isinstance(s, Split):
            out[s.dim] //= sizes[axis]
    return tuple(out)


def divides(shape, sbp: NdSbp, mesh: Mesh) -> bool:
    """Whether every dim of ``shape`` divides by the product of the mesh axes splitting it."""
    return _indivisible(shape, sbp, mesh) is None


def _indivisible(shape, sbp: NdSbp, mesh: Mesh):
    """(dim, mesh axes, their device count) of the first dim they do not divide, or None."""
    split = {}  # dim -> (its mesh axes, major first; their device count)
    for axis, n, s in zip(mesh.axis_names, mesh.devices.shape, sbp):
        if type(s) is Split:
            axes, count = split.get(s.dim, ((), 1))
            split[s.dim] = (axes + (axis,), count * n)
    for dim in sorted(split):
        axes, n = split[dim]
        if dim < len(shape) and shape[dim] % n:
            return dim, axes, n
    return None


def check_divisible(shape, dtype, sbp: NdSbp, mesh: Mesh, *, what: str, source: str = "") -> None:
    """A ShardingError unless ``sbp`` can hold a ``dtype[shape]`` value on ``mesh``: every split dim
    divisible by its axes, and no P(max) / P(min) of a complex value (XLA has no complex max all-reduce)."""
    for axis, s in zip(mesh.axis_names, sbp):
        if s in (Partial("max"), Partial("min")) and jax.dtypes.issubdtype(dtype, np.complexfloating):
            where = f" at {source}" if source else ""
            raise ShardingError(
                f"{what} {as_dtype(dtype).name}{list(shape)}{where}: {s!r} on mesh axis {axis!r} under spec "
                f"{format_sbp(sbp)}; XLA has no max all-reduce of complex values — take the max of a "
                "whole (B) value, or of its real part or abs"
            )
    bad = _indivisible(shape, sbp, mesh)
    if bad is not None:
        dim, axes, n = bad
        where = f" at {source}" if source else ""
        raise ShardingError(
            f"{what} {dtype}{list(shape)}{where}: dim {dim} of size {shape[dim]} is not divisible by "
            f"{n} (mesh axes {axes}) under spec {format_sbp(sbp)}; shardflow never replicates silently"
        )


def unstacked(sbp):
    """The NdSbp of one slice of a value stacked on a new leading dim (a loop's trip of a
    stacked input or output), or None where the stacked dim is split."""
    if sbp is None or Split(0) in sbp:
        return None
    return tuple(Split(s.dim - 1) if isinstance(s, Split) else s for s in sbp)


def stacked(sbp):
    """The NdSbp of values of ``sbp`` stacked on a new leading dim."""
    return tuple(Split(s.dim + 1) if isinstance(s, Split) else s for s in sbp)


def format_sbp(sbp: NdSbp) -> str:
    return "(" + ", ".join(repr(s) for s in sbp) + ")"


def as_dtype(dtype):
    """A numpy dtype, or JAX's extended dtype (a typed PRNG key) as it is: both have .itemsize
    and .name."""
    return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def nbytes(shape, dtype) -> int:
    return int(math.prod(shape)) * as_dtype(dtype).itemsize


def describe(aval) -> str:
    return f"{as_dtype(aval.dtype).name}{list(aval.shape)}"
