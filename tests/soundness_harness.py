"""The harness of tests/test_rule_soundness.py: a catalogue case's equation taken out of its
traced function, built as a one-equation Program under forced signatures (one per mesh axis),
boxed and lowered, and run against the equation run whole on values drawn for it."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, Var, jaxpr_as_fun, new_jaxpr_eqn

import shardflow as sf
import shardflow.attention  # noqa: F401  (registers the attention primitives' rule)
import shardflow.rules  # noqa: F401  (registers every rule)
from shardflow import passes, registry
from shardflow.program import Program
from shardflow.registry import DECISION, Decision, Sig
from shardflow.specs import B, Partial, ShardingError, Split, check_divisible

# ------------------------------------------------------------------------------ values


def is_key(dtype) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


def normal(rng, shape, dtype):
    if is_key(dtype):  # typed PRNG keys: distinct keys from a drawn seed
        keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), max(1, math.prod(shape)))
        return keys.reshape(shape)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.unsignedinteger):
        return rng.integers(0, 17, shape).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-8, 9, shape).astype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def uniform(lo, hi):
    return lambda rng, shape, dtype: rng.uniform(lo, hi, shape).astype(dtype)


def ints(lo, hi):
    """Integers in [lo, hi)."""
    return lambda rng, shape, dtype: rng.integers(lo, hi, shape).astype(dtype)


def nonzero(rng, shape, dtype):
    return (rng.integers(1, 9, shape) * rng.choice([-1, 1], shape)).astype(dtype)


def scaled(s):
    return lambda rng, shape, dtype: (s * rng.standard_normal(shape)).astype(dtype)


def out_of_range(size):
    """Indices into a dim of ``size``: in [-4, size + 4), the first always above, the last below."""

    def gen(rng, shape, dtype):
        x = rng.integers(-4, size + 4, shape)
        x.flat[0], x.flat[-1] = size + 1, -2
        return x.astype(dtype)

    return gen


POS, UNIT, GE1 = uniform(0.5, 2.0), uniform(-0.9, 0.9), uniform(1.1, 3.0)


# ------------------------------------------------------------------------------ a case


@dataclasses.dataclass(frozen=True, repr=False)
class Case:
    name: str  # test id
    prim: object  # the primitive whose equation is tested
    fn: Callable
    args: tuple  # (shape, dtype) of fn's arguments, for tracing
    values: tuple = ()  # (operand index of the equation, generator) where not ``normal``
    xfail: tuple = ()  # (signature repr, reason): known unsound signatures

    def __repr__(self):
        return f"Case({self.name!r})"


def _find(jaxpr, prim):
    """The first equation of ``prim`` in ``jaxpr`` or its nested jaxprs (jnp wraps ops in jits)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is prim:
            return eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, (Jaxpr, ClosedJaxpr)):
                    found = _find(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub, prim)
                    if found is not None:
                        return found
    return None


@functools.cache
def traced(c: Case):
    """(the equation of ``c.prim``, with every result a fresh Var; its signatures, () while the
    primitive has no rule)."""
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in c.args]
    eqn = _find(jax.make_jaxpr(c.fn)(*args).jaxpr, c.prim)
    assert eqn is not None, f"{c.name}: no {c.prim.name} equation in the traced function"
    eqn = eqn.replace(outvars=[Var(v.aval) for v in eqn.outvars])  # DropVars become results
    return eqn, tuple(registry.signatures(eqn) or ())


def operands(eqn):
    """The distinct non-literal operands of ``eqn``, in order of first use."""
    out = []
    for x in eqn.invars:
        if not isinstance(x, Literal) and x not in out:
            out.append(x)
    return out


@functools.cache
def mesh(sizes: tuple):
    return sf.make_mesh(dict(zip("xy", sizes)))


def nd(sigs, field, k):
    return tuple(getattr(s, field)[k] for s in sigs)


def decision(eqn, sigs) -> Decision:
    return Decision(
        ins=tuple(nd(sigs, "ins", k) for k in range(len(eqn.invars))),
        outs=tuple(nd(sigs, "outs", j) for j in range(len(eqn.outvars))),
        sigs=tuple(sigs),
    )


def valid(c: Case, eqn, sigs, m) -> bool:
    """Whether per-axis signatures ``sigs`` together fit ``eqn`` on mesh ``m`` as propagation
    checks it: every split dim divides, no complex P(max), no literal split, and the rule
    ``admits`` it."""
    admits = registry.rule_of(eqn.primitive).admits
    if admits is not None and not admits(eqn, decision(eqn, sigs), m):
        return False
    for atoms, field in ((eqn.invars, "ins"), (eqn.outvars, "outs")):
        for k, x in enumerate(atoms):
            sbp = nd(sigs, field, k)
            if isinstance(x, Literal) and any(isinstance(s, Split) for s in sbp):
                return False
            try:
                check_divisible(x.aval.shape, x.aval.dtype, sbp, m, what="value")
            except ShardingError:
                return False
    return True


def _debug_info(c: Case, invars, outvars) -> DebugInfo:
    return DebugInfo(
        "test_rule_soundness",
        c.name,
        tuple(f"x{k}" for k in range(len(invars))),
        tuple(f"[{j}]" for j in range(len(outvars))),
    )


@dataclasses.dataclass
class Built:
    fn: Callable  # the lowered SPMD callable
    stacked: list  # per program input: None, or (leading dims, their ops) of stacked parts


@functools.cache
def build(c: Case, sig_idx: tuple, sizes: tuple) -> Built:
    """The one-equation Program of ``c`` with signature ``sigs[i]`` on mesh axis ``i``, boxed
    and lowered."""
    eqn, all_sigs = traced(c)
    sigs = tuple(all_sigs[i] for i in sig_idx)
    m = mesh(sizes)
    d = decision(eqn, sigs)
    ins, outs = d.ins, d.outs
    body = eqn.replace(params={**eqn.params, DECISION: d})
    eqns, invars, in_sbp, stacked, sbp = [], [], [], [], {}
    for x in operands(eqn):
        want = ins[eqn.invars.index(x)]  # as its first use needs it; boxing converts for others
        sbp[x] = want
        p_axes = [i for i, s in enumerate(want) if isinstance(s, Partial)]
        if not p_axes:
            invars.append(x)
            in_sbp.append(want)
            stacked.append(None)
            continue
        # A partial operand: its parts are a program input with one leading dim per P axis,
        # split over that axis; a squeeze (its decision forced too) makes the local part.
        lead = len(p_axes)
        parts = Var(jax.core.ShapedArray(tuple(sizes[i] for i in p_axes) + tuple(x.aval.shape), x.aval.dtype))
        parts_sbp = tuple(
            Split(p_axes.index(i)) if isinstance(s, Partial) else Split(s.dim + lead) if isinstance(s, Split) else s
            for i, s in enumerate(want)
        )
        squeeze = new_jaxpr_eqn(
            [parts],
            [x],
            lax.squeeze_p,
            {"dimensions": tuple(range(lead)), DECISION: Decision((parts_sbp,), (want,))},
            frozenset(),
        )
        eqns.append(squeeze)
        invars.append(parts)
        in_sbp.append(parts_sbp)
        sbp[parts] = parts_sbp
        stacked.append((tuple(sizes[i] for i in p_axes), tuple(want[i].op for i in p_axes)))
    sbp.update(zip(eqn.outvars, outs))
    jaxpr = Jaxpr([], invars, list(eqn.outvars), eqns + [body], debug_info=_debug_info(c, invars, eqn.outvars))
    out_sbp = tuple(tuple(B if isinstance(s, Partial) else s for s in o) for o in outs)
    program = Program(
        ClosedJaxpr(jaxpr, []),
        m,
        in_sbp=tuple(in_sbp),
        out_sbp=out_sbp,
        sbp=sbp,
        facts=frozenset({"inlined", "sharded"}),
    )
    program = passes.run(program, [p for p in passes.DEFAULT if p.name in ("boxing", "unroll", "lower")])
    fn, _ = program.lowered
    return Built(fn, stacked)


@functools.cache
def reference(c: Case):
    eqn, _ = traced(c)
    jaxpr = Jaxpr([], operands(eqn), list(eqn.outvars), [eqn], debug_info=_debug_info(c, operands(eqn), eqn.outvars))
    return jax.jit(jaxpr_as_fun(ClosedJaxpr(jaxpr, [])))


def _combine(parts, ops):
    """The global value of stacked parts: the sum (max, min) over each leading dim."""
    for op in ops:
        if parts.dtype == np.bool_:
            parts = parts.any(0)
        else:
            parts = {"sum": lambda p: p.sum(0, dtype=p.dtype), "max": lambda p: p.max(0), "min": lambda p: p.min(0)}[
                op
            ](parts)
    return parts


def _parts(rng, x, lead, gen):
    """Random parts of a partial operand (a bool's first part is the value, the others False)."""
    shape = tuple(lead) + tuple(x.aval.shape)
    dtype = np.dtype(x.aval.dtype)
    if dtype == np.bool_:
        parts = np.zeros(shape, bool)
        parts[(0,) * len(lead)] = gen(rng, x.aval.shape, dtype)
        return parts
    return gen(rng, shape, dtype)


def _tolerance(expected, inputs):
    """(rtol, atol): exact for ints and bools; 1e-5 for fp32, 1e-2 for 16-bit floats, atol scaled
    by the largest finite magnitude of the result and the operands and parts (a partial's parts
    round on their own scale)."""
    if not jnp.issubdtype(expected.dtype, jnp.inexact):
        return 0.0, 0.0
    eps = 1e-2 if expected.dtype.itemsize <= 2 else 1e-5
    scale = 1.0
    for x in [expected, *inputs]:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            finite = np.abs(x[np.isfinite(x)]).astype(np.float64)
            scale = max(scale, float(finite.max()) if finite.size else 1.0)
    return eps, eps * scale


def check(c: Case, sig_idx: tuple, sizes: tuple, seed: int):
    """The lowered one-equation Program of ``c`` under signatures ``sig_idx`` (one per axis of the
    mesh of ``sizes``) equals the equation run whole, on values drawn from ``seed``."""
    eqn, _ = traced(c)
    built = build(c, sig_idx, sizes)
    rng = np.random.default_rng(seed)
    gens = dict(c.values)
    sigs = [traced(c)[1][i] for i in sig_idx]
    where = f"{c.name} under {' / '.join(map(sig_repr, sigs))} on mesh {dict(zip('xy', sizes))}, seed {seed}"
    args, whole = [], []
    for x, stacked in zip(operands(eqn), built.stacked):
        gen = gens.get(eqn.invars.index(x)) or normal
        if stacked is None:
            value = gen(rng, x.aval.shape, x.aval.dtype)
            args.append(value)
            whole.append(value)
        else:
            lead, ops = stacked
            parts = _parts(rng, x, lead, gen)
            args.append(parts)
            whole.append(_combine(parts, ops))
    actual = built.fn(*args)
    expected = reference(c)(*whole)
    assert len(actual) == len(expected)
    values = [x for x in args + whole if not is_key(x.dtype)]
    for j, (a, e) in enumerate(zip(actual, expected)):
        if is_key(e.dtype):
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        a, e = np.asarray(a), np.asarray(e)
        assert (a.shape, a.dtype) == (e.shape, e.dtype), f"result {j} of {where}"
        rtol, atol = _tolerance(e, values)
        if e.dtype.itemsize <= 2 and jnp.issubdtype(e.dtype, jnp.floating):
            a, e = a.astype(np.float32), e.astype(np.float32)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"result {j} of {where}")


def sig_repr(sig: Sig) -> str:
    fmt = lambda atoms: ",".join(map(repr, atoms))  # noqa: E731
    return f"{fmt(sig.ins)}->{fmt(sig.outs)}" + (f":{sig.name}" if sig.name else "")
