"""Program: a closed jaxpr, a mesh, and the facts the passes decided about it.

Facts live on what they describe: a value's NdSbp in ``Program.sbp``, keyed by its Var (a Var
names one value in one place: ``passes.inline`` clones nested jaxprs per call site); an
equation's Decision in the equation's own params (``registry.DECISION``). Both survive any
rewrite that keeps Vars and params. ``facts`` names the invariants the passes so far ensured
(``shardflow.passes``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var
from jax.extend.core import primitives as prims
from jax.sharding import Mesh

from shardflow import _compat
from shardflow.links import LinkModel
from shardflow.registry import DECISION
from shardflow.specs import installed_file, is_user_file


@dataclasses.dataclass
class Program:
    jaxpr: ClosedJaxpr
    mesh: Mesh
    in_sbp: tuple  # NdSbp of each flat input, fixed by in_specs
    out_sbp: tuple  # NdSbp of each flat output (None: as propagated, until propagate)
    sbp: dict = dataclasses.field(default_factory=dict)  # Var -> NdSbp
    links: LinkModel = dataclasses.field(default_factory=LinkModel)
    fallbacks: list = dataclasses.field(default_factory=list)  # (primitive name, source) run whole
    planner: str = "greedy"  # which pass chose the shardings, and how it went
    facts: frozenset = frozenset()  # invariants ensured by the passes run so far
    arg_names: tuple = ()  # names of the flat inputs, for explain and errors
    in_orders: tuple = ()  # per input: ((dim, axes), ...) split against mesh order (specs.split_orders)
    out_orders: tuple = ()  # per output, the same
    memory_budget: int | None = None  # bytes per device a plan may hold (passes.solve); None: a GPU's memory
    stationary: tuple = ()  # mesh axes over which no input is moved from its spec (tensor parallelism's weights)
    donated: tuple = ()  # flat input indices whose buffers the outputs may reuse
    lowered: Any = None  # (jitted SPMD callable, PartitionSpec of each input), by passes.lower

    def replace(self, **kw) -> Program:
        return dataclasses.replace(self, **kw)

    @property
    def auto_inputs(self) -> tuple:
        """The names of the inputs whose layout the solver is to choose (in_specs sf.AUTO)."""
        return tuple(str(n) for n, s in zip(self.arg_names or range(len(self.in_sbp)), self.in_sbp) if s is None)

    @property
    def axis_names(self) -> tuple:
        return tuple(self.mesh.axis_names)

    def __str__(self):
        return str(self.jaxpr)


REMAT_PRIMITIVES = (prims.remat_p,)


@functools.lru_cache(maxsize=4096)
def _user_and_library_frames(traceback) -> tuple:
    """(the innermost frame of user code, the innermost frame of an installed library inside
    that call, e.g. optax's), either None where there is none."""
    library = None
    for frame in _compat.traceback_frames(traceback):
        if is_user_file(frame.file_name):
            return frame, library
        if library is None and installed_file(frame.file_name):
            library = frame
    return None, library


def has_user_frame(source_info) -> bool:
    return _user_and_library_frames(source_info.traceback)[0] is not None


def source_line(eqn) -> str:
    """``train.py:12`` — the line of the user's code that made this equation's value — followed
    by the library line that made it where a library call did (``train.py:12
    (optax/_classification.py:400)``); the library line alone where no user code was on the stack."""
    user, library = _user_and_library_frames(eqn.source_info.traceback)
    here = f"{os.path.basename(user.file_name)}:{user.start_line}" if user else None
    inside = f"{installed_file(library.file_name)}:{library.start_line}" if library else None
    if here and inside:
        return f"{here} ({inside})"
    return here or inside or "<unknown>"


# ----------------------------------------------------------------------------- nested jaxprs


def subjaxprs(params: dict) -> Iterator[tuple[str, Any]]:
    """(param name, Jaxpr | ClosedJaxpr | tuple of them) for every jaxpr-valued param."""
    for name, value in params.items():
        if isinstance(value, (Jaxpr, ClosedJaxpr)):
            yield name, value
        elif isinstance(value, tuple) and value and all(isinstance(v, (Jaxpr, ClosedJaxpr)) for v in value):
            yield name, value


def rebuild(value: tuple, fn) -> tuple:
    """``fn`` over a tuple of jaxprs, keeping its type (custom_linear_solve's is a namedtuple)."""
    items = [fn(v) for v in value]
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)


def map_subjaxprs(eqn, fn: Callable[[str, Jaxpr], Jaxpr], names=None):
    """The eqn with ``fn(param name, jaxpr)`` applied to every nested (open) jaxpr — or to those
    of the params in ``names`` — ClosedJaxprs keeping their consts."""

    def one(name, j):
        return j.replace(jaxpr=fn(name, j.jaxpr)) if isinstance(j, ClosedJaxpr) else fn(name, j)

    new = {}
    for name, value in subjaxprs(eqn.params):
        if names is not None and name not in names:
            continue
        new[name] = rebuild(value, lambda v: one(name, v)) if isinstance(value, tuple) else one(name, value)
    return eqn.replace(params={**eqn.params, **new}) if new else eqn


def open_jaxpr(j) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def rebody(old, new_jaxpr):
    """``new_jaxpr`` in the form (closed or open) of the body param ``old`` it replaces."""
    return old.replace(jaxpr=new_jaxpr) if isinstance(old, ClosedJaxpr) else new_jaxpr


def nested(eqn) -> Iterator[Jaxpr]:
    """The bodies of ``eqn`` that the passes partition: those its Decision lists (a scan's body,
    a cond's branches), not scalar combiners such as a scatter's ``update_jaxpr``. Before
    propagation, every nested jaxpr."""
    return (body for _, body in named_bodies(eqn))


def named_bodies(eqn) -> Iterator[tuple[str, Jaxpr]]:
    """(param name, body) of each of ``nested``'s bodies."""
    decision = eqn.params.get(DECISION)
    names = None if decision is None else {name for name, _ in decision.bodies}
    for name, value in subjaxprs(eqn.params):
        if names is None or name in names:
            for j in value if isinstance(value, tuple) else (value,):
                yield name, open_jaxpr(j)


def all_eqns(jaxpr: Jaxpr) -> Iterator:
    for eqn in jaxpr.eqns:
        yield eqn
        for j in nested(eqn):
            yield from all_eqns(j)


def all_jaxprs(jaxpr: Jaxpr) -> Iterator[Jaxpr]:
    yield jaxpr
    for eqn in jaxpr.eqns:
        for j in nested(eqn):
            yield from all_jaxprs(j)


def scan_arity(params) -> tuple[int, int]:
    """(number of consts, number of carries) of a scan eqn. JAX 0.10 spells them
    ``num_consts`` / ``num_carry``; JAX 0.11 groups operands as ``ft_in = (consts, carry, xs)``."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def new_var(aval) -> Var:
    return Var(aval)


def is_literal(x) -> bool:
    return isinstance(x, Literal)


def trace(fn, *args) -> ClosedJaxpr:
    """The closed jaxpr of ``fn`` on abstract arguments."""
    return jax.make_jaxpr(fn)(*args)
