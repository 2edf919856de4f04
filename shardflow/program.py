"""Program: a closed jaxpr, a mesh, and an NdSbp for every value.

``Program.sbp`` maps each ``jax.core.Var`` — of the top-level jaxpr and of every nested one
(scan / while / cond bodies, remat) — to its NdSbp. Nested jaxprs are cloned per call site by
``passes.inline``, so a Var names one value in one place and a plain dict keyed by Var is enough.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterator

import jax
from jax._src import core, source_info_util
from jax._src.ad_checkpoint import remat_p
from jax.sharding import Mesh

from shardflow.mesh import LinkModel

# Frames of the compiler itself are never "the user's line"; shardflow's models and trainer are.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _module in ("api.py", "primitives.py", "program.py"):
    source_info_util.register_exclusion(os.path.join(_HERE, _module))
source_info_util.register_exclusion(os.path.join(os.path.dirname(_HERE), "passes") + os.sep)


@dataclasses.dataclass
class Program:
    jaxpr: core.ClosedJaxpr
    mesh: Mesh
    in_sbp: tuple                      # NdSbp of each flat input, fixed by in_specs
    out_sbp: tuple                     # NdSbp (or None: as propagated) of each flat output
    sbp: dict = dataclasses.field(default_factory=dict)          # Var -> NdSbp
    uses: dict = dataclasses.field(default_factory=dict)         # id(eqn) -> NdSbp each operand needs
    results: dict = dataclasses.field(default_factory=dict)      # id(jaxpr) -> NdSbp each output needs
    links: LinkModel = dataclasses.field(default_factory=LinkModel)
    fallbacks: list = dataclasses.field(default_factory=list)    # (primitive name, source) run whole

    def replace(self, **kw) -> "Program":
        return dataclasses.replace(self, **kw)

    @property
    def axis_names(self) -> tuple:
        return tuple(self.mesh.axis_names)

    def __str__(self):
        return str(self.jaxpr)


# jax.checkpoint's primitive: jaxprs print it as "checkpoint", its name is "remat2" in
# jax 0.10; the older names are kept for other versions.
REMAT = frozenset({remat_p.name, "checkpoint", "remat"})


def _user_frame(source_info):
    return source_info_util.user_frame(source_info.traceback) if source_info else None


def has_user_frame(source_info) -> bool:
    return _user_frame(source_info) is not None


def source_line(eqn) -> str:
    """``file.py:LINE`` of the user's code that made this equation's value."""
    frame = _user_frame(eqn.source_info)
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.file_name)}:{frame.start_line}"


# ----------------------------------------------------------------------------- nested jaxprs

def subjaxprs(params: dict) -> Iterator[tuple[str, Any]]:
    """(param name, Jaxpr | ClosedJaxpr | tuple of them) for every jaxpr-valued param."""
    for name, value in params.items():
        if isinstance(value, (core.Jaxpr, core.ClosedJaxpr)):
            yield name, value
        elif isinstance(value, tuple) and value and all(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value):
            yield name, value


def map_subjaxprs(eqn, fn: Callable[[core.Jaxpr], core.Jaxpr]):
    """The eqn with ``fn`` applied to every nested (open) jaxpr; ClosedJaxprs keep their consts."""
    def one(j):
        if isinstance(j, core.ClosedJaxpr):
            return core.ClosedJaxpr(fn(j.jaxpr), j.consts)
        return fn(j)

    new = {}
    for name, value in subjaxprs(eqn.params):
        new[name] = tuple(one(v) for v in value) if isinstance(value, tuple) else one(value)
    return eqn.replace(params={**eqn.params, **new}) if new else eqn


def open_jaxpr(j) -> core.Jaxpr:
    return j.jaxpr if isinstance(j, core.ClosedJaxpr) else j


def all_eqns(jaxpr: core.Jaxpr) -> Iterator:
    for eqn in jaxpr.eqns:
        yield eqn
        for _, value in subjaxprs(eqn.params):
            for j in value if isinstance(value, tuple) else (value,):
                yield from all_eqns(open_jaxpr(j))


def scan_arity(params) -> tuple[int, int]:
    """(number of consts, number of carries) of a scan eqn. JAX 0.10 spells them
    ``num_consts`` / ``num_carry``; JAX 0.11 groups operands as ``ft_in = (consts, carry, xs)``."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def new_var(aval) -> core.Var:
    return core.Var(aval)


def is_literal(x) -> bool:
    return isinstance(x, core.Literal)


def trace(fn, *args) -> core.ClosedJaxpr:
    """The closed jaxpr of ``fn`` on abstract arguments."""
    return jax.make_jaxpr(fn)(*args)
