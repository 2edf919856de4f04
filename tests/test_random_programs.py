"""Hypothesis: random small programs under random specs equal themselves on one device, and
every conversion between two NdSbps preserves the value and costs what the table says."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_tier import examples
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import shardflow as sf
from shardflow import conversion
from shardflow.specs import B, P, S

EXAMPLES = int(os.environ.get("SHARDFLOW_HYPOTHESIS_EXAMPLES", "200"))
# The meshes are built by the fixture below, not at import: `pytest -m gpu tests` on one GPU
# collects this module too. The tests' source stays as it was, since Hypothesis derives its
# derandomized examples from it.
MESH = ONE_BY_EIGHT = EIGHT = None
MESHES = dict.fromkeys(["2x4", "4x2"])
SBP_1D = st.sampled_from([B, S(0), S(1)])
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def nd_sbp(rank=2, partial=False):
    atoms = [B, P] + [S(d) for d in range(rank)] if partial else [B] + [S(d) for d in range(rank)]
    return st.tuples(st.sampled_from(atoms), st.sampled_from(atoms))


@pytest.fixture(scope="module", autouse=True)
def meshes():
    global MESH, ONE_BY_EIGHT, EIGHT
    MESH = sf.make_mesh({"data": 2, "model": 4})
    MESHES.update({"2x4": MESH, "4x2": sf.make_mesh({"data": 4, "model": 2})})
    ONE_BY_EIGHT = sf.make_mesh({"data": 1, "model": 8})
    EIGHT = sf.make_mesh({"model": 8})


# ------------------------------------------------------------------------------ conversions


@settings(max_examples=examples(100), **SETTINGS)
@given(src=nd_sbp(partial=True), mid=nd_sbp(partial=True), dst=nd_sbp(partial=False))
@example(src=(S(0), S(1)), mid=(P, P), dst=(S(1), S(1)))  # one reduce-scatter over both axes
@example(src=(B, B), mid=(S(0), P), dst=(S(0), S(0)))
def test_every_conversion_preserves_the_value(src, mid, dst):
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)

    def fn(x):
        return sf.constrain(sf.constrain(sf.constrain(x, src) * 1.5, mid) + 0.0, dst)

    out = sf.parallelize(fn, mesh=MESH, in_specs=(None,), out_specs=dst)(x)
    np.testing.assert_allclose(np.asarray(out), x * 1.5, rtol=1e-6)


@pytest.mark.parametrize(
    "src, dst, kind, factor",
    [
        ((S(0), B), (B, B), "all_gather", 1 / 2),  # (n-1)/n of the gathered tensor
        ((P, B), (B, B), "all_reduce", 2 * 1 / 2),  # 2(n-1)/n
        ((B, P), (B, S(1)), "reduce_scatter", 3 / 4),  # (n-1)/n of the reduced tensor
        ((B, S(0)), (B, S(1)), "all_to_all", 3 / 4 / 4),  # (n-1)/n of the local block
        ((B, B), (S(0), S(1)), None, 0),  # local slices
        ((S(0), S(1)), (P, P), None, 0),  # own shard in place, zeros elsewhere
    ],
)
def test_conversion_bytes_follow_the_table(src, dst, kind, factor):
    steps = conversion.route((8, 16), np.float32, src, dst, MESH)
    sent = conversion.total_bytes(steps)
    assert sent == int(round(factor * 8 * 16 * 4))
    assert [s.kind for s in steps if s.is_collective] == ([kind] if kind else [])


@settings(max_examples=examples(100), **SETTINGS)
@given(src=nd_sbp(partial=True), mid=nd_sbp(partial=True), dst=nd_sbp(partial=False))
def test_every_routed_conversion_preserves_the_value_and_costs_no_more_than_the_direct_plan(src, mid, dst):
    """With no latency a conversion takes the shortest route through NdSbps between wherever
    it moves fewer bytes than the direct plan: the value survives it."""
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    bandwidth_only = sf.LinkModel(alpha=0.0)
    for a, b in ((src, mid), (mid, dst)):
        routed = conversion.route(x.shape, np.float32, a, b, MESH, bandwidth_only)
        assert conversion.total_bytes(routed) <= conversion.total_bytes(
            conversion.route(x.shape, np.float32, a, b, MESH)
        )

    def fn(x):
        return sf.constrain(sf.constrain(sf.constrain(x, src) * 1.5, mid) + 0.0, dst)

    out = sf.parallelize(fn, mesh=MESH, in_specs=(None,), out_specs=dst, links=bandwidth_only)(x)
    np.testing.assert_allclose(np.asarray(out), x * 1.5, rtol=1e-6)


@pytest.mark.parametrize(
    "src, dst, direct, routed",
    [
        # all-reduce over model (1.5 T) / slice over data, all-reduce the half, gather it (1.25 T)
        ((B, P), (B, B), ["all_reduce"], ["all_reduce", "all_gather"]),
        # gather both dims / gather over data, all-to-all over model, slice over data
        ((S(0), S(1)), (S(1), S(0)), ["all_gather", "all_gather"], ["all_gather", "all_to_all"]),
    ],
)
def test_a_route_through_another_layout_is_taken_where_it_moves_fewer_bytes(src, dst, direct, routed):
    shape = (64, 64)
    plain = conversion.route(shape, np.float32, src, dst, MESH)
    cheap = conversion.route(shape, np.float32, src, dst, MESH, sf.LinkModel(alpha=0.0))
    assert [s.kind for s in plain if s.is_collective] == direct
    assert [s.kind for s in cheap if s.is_collective] == routed
    assert conversion.total_bytes(cheap) < conversion.total_bytes(plain)
    # where each collective costs a millisecond, no route of more collectives than the direct plan
    slow = conversion.route(shape, np.float32, src, dst, MESH, sf.LinkModel(alpha=1e-3))
    assert len([s for s in slow if s.is_collective]) <= len(direct)


def test_a_value_of_more_layouts_than_routed_takes_the_direct_plan():
    """Routes are all-pairs shortest paths, cubic in a value's layouts: on four mesh axes a 4-D
    value has 625 and its conversions take the direct plan, no table built."""
    mesh = sf.make_mesh({"a": 2, "b": 2, "c": 2, "d": 1})
    shape, src, dst = (8, 8, 8, 8), (S(0), S(1), S(2), B), (S(1), S(0), B, S(3))
    before = conversion._graph.cache_info().currsize
    routed = conversion.route(shape, np.float32, src, dst, mesh, sf.LinkModel(alpha=0.0))
    assert routed == conversion.route(shape, np.float32, src, dst, mesh)
    assert conversion._graph.cache_info().currsize == before


@settings(max_examples=examples(EXAMPLES), **SETTINGS)
@given(
    src=nd_sbp(3, partial=True),
    mid=nd_sbp(3, partial=True),
    dst=nd_sbp(3, partial=True),
    shape=st.sampled_from([(32, 4096), (8, 16, 4), (32, 4096, 8), (8, 2048, 4096)]),
    alpha=st.sampled_from([0.0, 5e-6]),
)
@example(src=(S(0), S(0)), mid=(B, B), dst=(B, S(1)), shape=(32, 4096), alpha=5e-6)  # one gather over both axes
def test_no_chain_of_conversions_is_priced_below_the_conversion(src, mid, dst, shape, alpha):
    """Every step a direct plan takes is a hop of the router, so the price is a shortest path:
    converting through any layout between costs at least as much."""
    if not all(
        sf.specs.divides(shape, s, MESH) and all(t.dim < len(shape) for t in s if isinstance(t, S))
        for s in (src, mid, dst)
    ):
        return
    price = lambda a, b: conversion.seconds(shape, np.float32, a, b, MESH, sf.LinkModel(alpha=alpha))
    assert price(src, dst) <= price(src, mid) + price(mid, dst) + 1e-11


def test_several_axes_gathered_in_one_collective_are_one_hop():
    """(S(0), S(0)) -> (B, S(1)) of a bf16[32, 4096] was an all-to-all and a gather, 10.4 µs at
    the default latency, when routes changed one mesh axis a step; one gather over both axes
    and a slice take 6.5."""
    shape, src, dst = (32, 4096), (S(0), S(0)), (B, S(1))
    steps = conversion.route(shape, jnp.bfloat16, src, dst, MESH, sf.LinkModel())
    assert [(s.kind, s.axes) for s in steps if s.is_collective] == [("all_gather", ("data", "model"))]
    assert conversion.seconds(shape, jnp.bfloat16, src, dst, MESH, sf.LinkModel()) < 7e-6


@settings(max_examples=examples(100), **SETTINGS)
@given(src=nd_sbp(partial=True), dst=nd_sbp(partial=True), mid=nd_sbp(partial=True))
@example(src=(S(0), S(1)), dst=(S(1), S(1)), mid=(B, B))  # the logits case
def test_an_axis_of_one_device_is_free(src, dst, mid):
    """On a {data: 1, model: 8} mesh a conversion costs what the same model-axis conversion
    costs on {model: 8}, whatever the data axis's SBP: it never gathers over model to put the
    data axis into a dim's split order (the tensor-parallel mesh of `shardflow train` once
    gathered whole logits that way). The value survives such conversions too."""
    shape = (8, 16)
    steps = conversion.route(shape, np.float32, src, dst, ONE_BY_EIGHT)
    alone = conversion.route(shape, np.float32, src[1:], dst[1:], EIGHT)
    assert conversion.total_bytes(steps) == conversion.total_bytes(alone)
    assert [(s.kind, s.axes) for s in steps] == [(s.kind, s.axes) for s in alone]
    out_spec = tuple(B if s == P else s for s in dst)  # outputs cannot be partial
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    fn = lambda x: sf.constrain(sf.constrain(sf.constrain(x, src) * 1.5, mid) + 0.0, dst)
    out = sf.parallelize(fn, mesh=ONE_BY_EIGHT, in_specs=(None,), out_specs=out_spec)(x)
    np.testing.assert_allclose(np.asarray(out), x * 1.5, rtol=1e-6)


# ------------------------------------------------------------------------------ random programs

SHAPES = {"a": (8, 16), "b": (16, 8), "c": (8, 16)}


_COLUMN_SCALES = np.linspace(0.5, 1.5, 16).astype(np.float32)


@jax.jit
def _scale_columns(x):
    return x * _COLUMN_SCALES[: x.shape[1]]


def _ops():
    unary = {
        "tanh": jnp.tanh,
        "exp": lambda x: jnp.exp(0.1 * x),
        "square": lambda x: x * x * 0.5,
        "neg": jnp.negative,
        "cumsum0": lambda x: jnp.cumsum(x, 0) * 0.1,
        "cumsum1": lambda x: jnp.cumsum(x, 1) * 0.1,
        "softmax0": lambda x: jax.nn.softmax(x, 0),
        "softmax1": lambda x: jax.nn.softmax(x, 1),
        "center0": lambda x: x - jnp.mean(x, 0, keepdims=True),
        "center1": lambda x: x - jnp.max(x, 1, keepdims=True),
        "T": lambda x: x.T,
        "reshape": lambda x: x.reshape(x.shape[1], x.shape[0]),
        "split_merge": lambda x: x.reshape(x.shape[0], 4, x.shape[1] // 4).sum(-1).repeat(4, 1),
        "concat_slice": lambda x: jnp.concatenate([x, 2 * x], 0)[x.shape[0] :],
        "take": lambda x: x[jnp.arange(x.shape[0])[::-1] % x.shape[0]],
        "pad_slice": lambda x: jnp.pad(x, ((0, 0), (1, 1)))[:, 1:-1],
        "scan": lambda x: jax.lax.scan(lambda c, xi: (jnp.tanh(0.5 * c + xi), c.sum(0)), x, jnp.stack([x, -x, 2 * x]))[
            0
        ],
        "scan_ys": lambda x: jax.lax.scan(lambda c, xi: (c + 1, xi * c), 1.0, jnp.stack([x, x.T.T]))[1].sum(0),
        "fori": lambda x: jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ x.T @ c * 0.01 + c), x),
        "remat": jax.checkpoint(lambda x: jnp.tanh(x) * x),
        "jit_const": _scale_columns,  # a jit closing over a constant array
        "scan_remat_jit": lambda x: jax.lax.scan(
            jax.checkpoint(lambda c, xi: (_scale_columns(c) + xi, None)), x, jnp.stack([x, -x])
        )[0],
    }
    binary = {"add": jnp.add, "mul": jnp.multiply, "sub": jnp.subtract, "max": jnp.maximum}
    return unary, binary


UNARY, BINARY = _ops()
STEP = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(sorted(UNARY)), st.integers(0, 50)),
    st.tuples(st.just("binary"), st.sampled_from(sorted(BINARY)), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("matmul"), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("constrain"), st.integers(0, 50), nd_sbp()),
)


def build(steps):
    def fn(a, b, c):
        pool = [a, b, c]

        def pick(i, shape=None):
            cands = [v for v in pool if shape is None or v.shape == shape]
            return cands[i % len(cands)] if cands else None

        for step in steps:
            kind = step[0]
            if kind == "unary":
                pool.append(UNARY[step[1]](pick(step[2])))
            elif kind == "binary":
                x = pick(step[2])
                y = pick(step[3], x.shape)
                pool.append(BINARY[step[1]](x, y))
            elif kind == "matmul":
                x = pick(step[1])
                y = pick(step[2], (x.shape[1], x.shape[0]))
                if y is not None:
                    pool.append(jnp.tanh(x @ y / x.shape[1]))
            else:  # pin a value, once: later steps see only the pinned version
                x = pick(step[1])
                k = next(i for i, v in enumerate(pool) if v is x)
                pool[k] = sf.constrain(x, step[2])
        return pool[-1], sum(jnp.sum(v) for v in pool[3:]) if len(pool) > 3 else jnp.sum(a)

    return fn


@settings(max_examples=examples(EXAMPLES), **SETTINGS)
@given(
    steps=st.lists(STEP, min_size=1, max_size=6),
    specs=st.tuples(nd_sbp(), nd_sbp(), nd_sbp()),
    mesh=st.sampled_from(sorted(MESHES)),
)
@example(steps=[("unary", "scan_remat_jit", 0), ("matmul", 3, 1)], specs=((S(0), S(1)), (B, S(0)), (B, B)), mesh="2x4")
def test_random_program_equals_single_device(steps, specs, mesh):
    r = np.random.default_rng(0)
    args = [r.standard_normal(SHAPES[k]).astype(np.float32) for k in "abc"]
    fn = build(steps)
    expected = jax.jit(fn)(*args)
    f = sf.parallelize(fn, mesh=MESHES[mesh], in_specs=specs)
    actual = f(*args)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-4, atol=2e-4)
    assert not f.explain(*args).fallbacks
