"""The core's skeleton: one pricer, decisions on the equations, the pass list and its checked
facts, and the program forms real code uses (with_sharding_constraint, a user's shard_map, a dim
split against mesh order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_tier import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow import conversion
from shardflow.passes.propagate import Propagation
from shardflow.program import all_eqns
from shardflow.registry import DECISION, decision_of
from shardflow.specs import B, P, Partial, S

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
MESHES = {1: {"data": 8}, 2: {"data": 2, "model": 4}, 3: {"pod": 2, "data": 2, "model": 2}}


@pytest.fixture(scope="module")
def mesh():
    return sf.make_mesh({"x": 2, "y": 4})


def _same(f, fn, *args, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(jax.jit(fn)(*args)), rtol=rtol, atol=1e-6)


# ------------------------------------------------------------------------------ one pricer


def _atoms(rank):
    return [B, P, Partial("max")] + [S(d) for d in range(rank)]


@st.composite
def conversions(draw):
    axes = draw(st.sampled_from([1, 2, 3]))
    shape = tuple(draw(st.sampled_from([8, 16, 24])) for _ in range(draw(st.integers(1, 3))))
    src = tuple(draw(st.sampled_from(_atoms(len(shape)))) for _ in range(axes))
    dst = tuple(draw(st.sampled_from([a for a in _atoms(len(shape)) if a != Partial("max")])) for _ in range(axes))
    return axes, shape, src, dst


@settings(max_examples=examples(150), **SETTINGS)
@given(conversions())
def test_propagation_prices_the_plan_that_runs(case):
    """What propagation pays for a conversion is the plan boxing inserts, priced by the links —
    to the last bit, though the pricer builds no Steps where the plan goes direct."""
    axes, shape, src, dst = case
    mesh = sf.make_mesh(MESHES[axes])
    if not (sf.specs.divides(shape, src, mesh) and sf.specs.divides(shape, dst, mesh)):
        return
    links = sf.LinkModel(alpha=3e-6, beta=50e9, per_axis_beta={"data": 20e9})
    program = sf.program.Program(None, mesh, (), (), links=links)
    aval = jax.core.ShapedArray(shape, np.float32)
    steps = conversion.route(shape, np.float32, src, dst, mesh, links)
    expected = sum(links.seconds(s.axes, s.bytes) if s.is_collective else conversion.EPSILON for s in steps)
    assert Propagation(program).seconds(aval, src, dst) == expected


def test_the_issue_example_is_priced_as_the_plan_that_runs():
    """f32[16,64] (S(0),S(1)) -> (S(1),S(1)) on {data: 2, model: 4}: the direct plan gathers
    (3,584 bytes); the plan that runs gathers over model and all-to-alls over data (2,560
    bytes, two collectives as well), and the price is that plan's, not a 256-byte all_to_all's."""
    mesh = sf.make_mesh(MESHES[2])
    direct = conversion.route((16, 64), np.float32, (S(0), S(1)), (S(1), S(1)), mesh)
    assert conversion.total_bytes([s for s in direct if s.is_collective]) == 3584
    links = sf.LinkModel()
    steps = conversion.route((16, 64), np.float32, (S(0), S(1)), (S(1), S(1)), mesh, links)
    assert [(s.kind, s.axes, s.bytes) for s in steps if s.is_collective] == [
        ("all_gather", ("model",), 1536),
        ("all_to_all", ("data",), 1024),
    ]
    priced = conversion.seconds((16, 64), np.float32, (S(0), S(1)), (S(1), S(1)), mesh, links)
    assert priced == pytest.approx(conversion.steps_seconds(steps, links))
    assert priced < conversion.steps_seconds(direct, links)
    assert priced > links.seconds(("data",), 2560) - 1e-12


def test_explain_reports_the_modelled_time_of_each_collective(mesh):
    f = sf.parallelize(lambda x, w: jnp.tanh(x @ w).sum(), mesh=mesh, in_specs=(PS("x", "y"), PS("y")))
    plan = f.explain(np.ones((8, 16), np.float32), np.ones((16, 4), np.float32))
    assert plan.collectives
    for c in plan.collectives:
        assert c.seconds == pytest.approx(sf.LinkModel().seconds(c.axes, c.bytes))
    assert "µs modelled" in str(plan)


# ------------------------------------------------------------------------------ decisions and passes


def _train_step():
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w["a"]) @ w["b"])

    w = {
        "a": np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32),
        "b": np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32),
    }
    x = np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32)
    return jax.grad(loss), (w, x), ({"a": PS(None, "y"), "b": PS("y")}, PS("x"))


def test_every_equation_carries_its_decision(mesh):
    fn, args, in_specs = _train_step()
    program = sf.parallelize(fn, mesh=mesh, in_specs=in_specs).program(*args)
    assert {"inlined", "sharded", "boxed"} <= program.facts
    for eqn in all_eqns(program.jaxpr.jaxpr):
        d = decision_of(eqn)
        assert d is not None and len(d.ins) == len(eqn.invars)
        if eqn.primitive is jax.lax.dot_general_p:
            assert len(d.sigs) == 2  # one 1-D signature per mesh axis
    assert DECISION in str(program)  # JAX's printer shows them


def _rebuild_every_equation(program):
    """A pass that makes a new equation object of every equation, keeping params."""

    def rebuild(jaxpr):
        return jaxpr.replace(eqns=[e.replace() for e in jaxpr.eqns])

    return program.replace(jaxpr=program.jaxpr.replace(jaxpr=rebuild(program.jaxpr.jaxpr)))


def test_a_pass_inserted_after_propagate_keeps_every_decision(mesh):
    """Decisions survive rewriting (they were side tables keyed by id(eqn) and were lost)."""
    fn, args, in_specs = _train_step()
    rebuild = sf.passes.Pass(
        "rebuild", _rebuild_every_equation, requires=(sf.passes.SHARDED,), ensures=(sf.passes.SHARDED,)
    )
    passes = sf.passes.insert_after(sf.passes.DEFAULT, "propagate", rebuild)
    plain = sf.parallelize(fn, mesh=mesh, in_specs=in_specs)
    rebuilt = sf.parallelize(fn, mesh=mesh, in_specs=in_specs, passes=passes)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), rebuilt(*args), plain(*args))
    assert rebuilt.explain(*args).total_bytes == plain.explain(*args).total_bytes


def test_a_pass_that_breaks_a_fact_it_ensures_is_caught(mesh, monkeypatch):
    monkeypatch.setenv("SHARDFLOW_CHECK", "1")
    fn, args, in_specs = _train_step()

    def drop_decisions(program):
        def strip(jaxpr):
            return jaxpr.replace(
                eqns=[e.replace(params={k: v for k, v in e.params.items() if k != DECISION}) for e in jaxpr.eqns]
            )

        return program.replace(jaxpr=program.jaxpr.replace(jaxpr=strip(program.jaxpr.jaxpr)))

    bad = sf.passes.Pass("bad", drop_decisions, requires=(sf.passes.SHARDED,), ensures=(sf.passes.SHARDED,))
    passes = sf.passes.insert_after(sf.passes.DEFAULT, "propagate", bad)
    with pytest.raises(sf.passes.InvariantError, match="has no Decision"):
        sf.parallelize(fn, mesh=mesh, in_specs=in_specs, passes=passes)(*args)


def test_a_pass_runs_only_after_the_facts_it_requires(mesh):
    fn, args, in_specs = _train_step()
    early = sf.passes.Pass("early", lambda p: p, requires=(sf.passes.SHARDED,))
    passes = (early,) + tuple(sf.passes.DEFAULT)
    with pytest.raises(sf.passes.InvariantError, match="requires \\['sharded'\\]"):
        sf.parallelize(fn, mesh=mesh, in_specs=in_specs, passes=passes)(*args)


# ------------------------------------------------------------------------------ real programs' forms


def _layers_step(spec):
    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    ws = np.random.default_rng(0).standard_normal((3, 16, 16)).astype(np.float32) / 4
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    return jax.grad(loss), (ws, x), (spec, PS("x"))


@pytest.mark.parametrize("spec, unrolled", [(PS(), True), (PS(None, None, "y"), False)])
def test_a_layer_loop_is_lowered_unrolled_unless_its_body_communicates(mesh, spec, unrolled):
    """Data parallel, the layers run no collective: the forward and backward loops are lowered
    unrolled (no while loop in the HLO), the forward's residuals handed to the backward block
    by block. Tensor parallel, each layer all-reduces: rolled, so XLA cannot merge the
    backward's collectives with the forward's. Both equal to one device."""
    fn, args, in_specs = _layers_step(spec)
    f = sf.parallelize(fn, mesh=mesh, in_specs=in_specs)
    hlo = f.lower(*args).as_text()
    assert ("while" not in hlo) is unrolled
    np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(jax.jit(fn)(*args)), rtol=1e-5, atol=1e-6)


def test_a_communicating_layer_loop_unrolled_apart_holds_each_trip_apart_behind_the_trip_before(mesh, monkeypatch):
    """With ``unroll.UNROLL_COLLECTIVES`` (off until measured on GPUs) a tensor-parallel layer
    loop is lowered unrolled too: each trip's slices (its layer's weight, and in the backward the
    forward's residuals) go through an optimization barrier with the carries of the trip before
    it — so the backward's all-reduces and gathers cannot be merged with the forward's, yet may
    run a trip ahead — three a loop, forward and backward. Equal to one device."""
    from shardflow.passes import unroll

    monkeypatch.setattr(unroll, "UNROLL_COLLECTIVES", True)
    fn, args, in_specs = _layers_step(PS(None, None, "y"))
    f = sf.parallelize(fn, mesh=mesh, in_specs=in_specs)
    text = f.lower(*args).as_text()
    assert "while" not in text
    barriers = [line for line in text.splitlines() if "stablehlo.optimization_barrier" in line]
    assert len(barriers) == 6, barriers
    np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(jax.jit(fn)(*args)), rtol=1e-5, atol=1e-6)
    fn, args, in_specs = _layers_step(PS())
    data_parallel = sf.parallelize(fn, mesh=mesh, in_specs=in_specs)  # no collective in the loop: no barrier
    assert "optimization_barrier" not in data_parallel.lower(*args).as_text()


def test_a_layer_loop_that_recomputes_is_unrolled_each_recomputation_barred_behind_its_cotangent():
    """One device, no collectives: a loop whose layers are rematerialised (prevent_cse=False,
    as a remat in a scan is written) is lowered unrolled, and each backward trip takes its
    operands — the cotangent handed down among them — through one optimization barrier: else
    XLA merges its recomputation with the forward it repeats. (On one H200 the 7b step with
    full remat ran out of memory unrolled without the barriers, and held 109.8 GB with them,
    115.8 rolled: benchmarks/results/scaling.md. XLA:CPU drops
    optimization barriers, so on CPU no remat saves memory, jax.jit's of an unrolled Python loop
    neither.) Equal to one device."""

    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(jnp.tanh(h @ w) @ w.T), None

        layer = jax.checkpoint(layer, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)
        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    step = jax.grad(loss)
    ws = np.random.default_rng(0).standard_normal((8, 64, 128)).astype(np.float32) / 10
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    f = sf.parallelize(step, mesh=sf.make_mesh({"x": 1}), in_specs=(PS(), PS()))
    text = f.lower(ws, x).as_text()
    assert "while" not in text
    barriers = [line for line in text.splitlines() if "stablehlo.optimization_barrier" in line]
    # the cotangent handed down, and the trip's h and w
    assert len(barriers) == 8, barriers
    assert all(
        sorted(line.split(" : ")[1].split(", ")) == ["tensor<32x64xf32>"] * 2 + ["tensor<64x128xf32>"]
        for line in barriers
    ), barriers
    np.testing.assert_allclose(np.asarray(f(ws, x)), np.asarray(jax.jit(step)(ws, x)), rtol=1e-5, atol=1e-6)


def test_a_remat_outside_loops_keeps_its_optimization_barrier():
    """jax.checkpoint's prevent_cse (on by default): the backward's recomputation takes its
    operands through an optimization barrier in the lowered program, as in jax.jit's, so XLA
    cannot merge it with the forward it repeats. Equal to one device."""
    block = jax.checkpoint(lambda h, w: jnp.tanh(jnp.tanh(h @ w) @ w.T))
    fn = jax.grad(lambda w, x: jnp.sum(block(x, w) ** 2))
    w = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32) / 8
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    f = sf.parallelize(fn, mesh=sf.make_mesh({"x": 1}), in_specs=(PS(), PS()))
    assert "optimization_barrier" in jax.jit(fn).lower(w, x).as_text()
    assert "optimization_barrier" in f.lower(w, x).as_text()
    np.testing.assert_allclose(np.asarray(f(w, x)), np.asarray(jax.jit(fn)(w, x)), rtol=1e-5, atol=1e-6)


def test_with_sharding_constraint_is_a_pin(mesh):
    """It failed with "contains a manual axes ... not allowed"; now it pins like sf.constrain."""

    def fn(x):
        h = jnp.sin(x) * 2
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, PS(None, "y")))
        return h.sum(0)

    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    f = sf.parallelize(fn, mesh=mesh, in_specs=PS("x"))
    _same(f, fn, x)
    program = f.program(x)
    pinned = [decision_of(e) for e in all_eqns(program.jaxpr.jaxpr) if e.primitive.name == "sharding_constraint"]
    assert pinned and pinned[0].outs == ((B, S(1)),)


def test_with_sharding_constraint_of_an_unknown_axis_names_the_line(mesh):
    other = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("z",))
    fn = lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(other, PS("z")))  # noqa: E731
    with pytest.raises(sf.ShardingError, match="test_core.py.*unknown mesh axis 'z'"):
        sf.parallelize(fn, mesh=mesh, in_specs=PS())(np.ones((8, 4), np.float32))


def test_a_users_shard_map_runs_as_a_region(mesh):
    """It failed with KeyError 'subfuns'. Its in/out specs are the region's boundary shardings;
    its body runs as written, with the user's own collectives."""

    def fn(a, w):
        h = jnp.tanh(a @ w)
        region = jax.shard_map(lambda b: jax.lax.psum(b * 2, "y"), mesh=mesh, in_specs=PS("x", "y"), out_specs=PS("x"))
        return region(h).sum(0)

    a = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32)
    f = sf.parallelize(fn, mesh=mesh, in_specs=(PS("x"), PS()))
    _same(f, fn, a, w, rtol=1e-5)
    region = [e for e in all_eqns(f.program(a, w).jaxpr.jaxpr) if e.primitive.name == "shard_map"]
    assert decision_of(region[0]).ins == ((S(0), S(1)),) and decision_of(region[0]).outs == ((S(0), B),)


def test_a_shard_map_on_another_mesh_is_refused(mesh):
    other = sf.make_mesh({"y": 8})
    fn = lambda a: jax.shard_map(lambda b: b * 2, mesh=other, in_specs=PS("y"), out_specs=PS("y"))(a)  # noqa: E731
    with pytest.raises(sf.ShardingError, match="jax.shard_map at test_core.py:.* same mesh"):
        sf.parallelize(fn, mesh=mesh, in_specs=PS())(np.ones((8, 4), np.float32))


@pytest.mark.parametrize(
    "in_spec, out_spec",
    [
        (PS(("y", "x")), PS(("y", "x"))),
        (PS(("y", "x")), PS("x")),
        (PS("x"), PS(("y", "x"))),
        (PS(None, ("y", "x")), PS(None, ("x", "y"))),
    ],
)
def test_a_dim_split_against_mesh_order(mesh, in_spec, out_spec):
    """GSPMD takes P(('y', 'x')) on {x: 2, y: 4}; shardflow refused it. The blocks are permuted
    into mesh order once, at the boundary: one ppermute, bytes in explain."""
    x = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    fn = lambda a: jnp.sin(a) * 2  # noqa: E731
    f = sf.parallelize(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec)
    out = f(x)
    np.testing.assert_allclose(np.asarray(out), np.sin(x) * 2, rtol=1e-6)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 2)
    permutes = [c for c in f.explain(x).collectives if c.kind == "ppermute"]
    reordered = [s for s in (in_spec, out_spec) if sf.specs.split_orders(s, mesh)]
    assert len(permutes) == len(reordered)
    for c in permutes:
        assert c.bytes == x.nbytes // 8  # each device sends its whole block once


def test_a_reduce_scatter_into_a_dim_split_against_mesh_order(mesh):
    """The form of JAX's own reduce-scatter tests: P(None, ('y', 'x')) in, P(('y', 'x')) out."""
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    fn = lambda a: a.sum(0)  # noqa: E731
    f = sf.parallelize(fn, mesh=mesh, in_specs=PS(None, ("y", "x")), out_specs=PS(("y", "x")))
    _same(f, fn, x, rtol=1e-5)
    assert f(x).sharding.is_equivalent_to(NamedSharding(mesh, PS(("y", "x"))), 1)


def test_a_constraint_against_mesh_order_is_refused_with_the_line(mesh):
    fn = lambda a: sf.constrain(a * 2, PS(("y", "x")))  # noqa: E731
    with pytest.raises(sf.ShardingError, match="test_core.py.*against mesh order"):
        sf.parallelize(fn, mesh=mesh, in_specs=PS())(np.ones((8, 4), np.float32))


def test_the_compiler_imports_private_jax_api_in_one_module():
    import pathlib
    import re

    root = pathlib.Path(sf.__file__).resolve().parent
    hits = [
        p
        for p in list(root.rglob("*.py"))
        + list((root.parent / "passes").rglob("*.py"))
        + list((root.parent / "kernels").rglob("*.py"))
        + list((root.parent / "models").rglob("*.py"))
        if re.search(r"jax\._src", p.read_text())
    ]
    assert [p.name for p in hits] == ["_compat.py"], hits


def test_a_literal_converted_on_a_one_device_axis():
    """jnp.take's index arithmetic plans a literal as partial on an axis of one device; the box
    of a literal ran on a Python scalar (found by the GPU tests' one-device cases)."""
    fn = lambda x: x.take(0, axis=-1)  # noqa: E731
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    _same(sf.parallelize(fn, mesh=sf.make_mesh({"data": 1}), in_specs=PS("data")), fn, x)


@pytest.mark.parametrize(
    "spec, widths",
    [
        (PS(None, "y"), ((4, 4), (8, 8))),
        (PS("x", "y"), ((4, 4), (8, 8))),
        (PS("x"), ((3, 5), (2, 2))),
        (PS(None, "y"), ((0, 0), (0, 16))),
    ],
)
def test_pad_on_a_split_dim_exchanges_halos(mesh, spec, widths):
    """Edge padding on a split dim moved the whole input (gathered, 2.3-9.3x GSPMD's bytes); now
    the rows each output block needs are ppermuted from the blocks that hold them, priced and
    listed in explain like any collective."""
    from shardflow import hlo

    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    fn = lambda a: jnp.tanh(jnp.pad(a, widths, constant_values=0.5)) * 2.0  # noqa: E731
    f = sf.parallelize(fn, mesh=mesh, in_specs=spec, out_specs=spec)
    _same(f, fn, x)
    plan = f.explain(x)
    assert plan.collectives and {c.kind for c in plan.collectives} == {"ppermute"}, str(plan)
    assert all("exchanges the blocks" in c.reason for c in plan.collectives)
    assert plan.total_bytes == hlo.total_bytes(f.lower(x).compile().as_text())
    gspmd = jax.jit(fn, in_shardings=NamedSharding(mesh, spec), out_shardings=NamedSharding(mesh, spec))
    assert plan.total_bytes <= 1.1 * hlo.total_bytes(gspmd.lower(x).compile().as_text())


def test_pad_on_a_dim_split_over_two_axes_gathers_one_of_them():
    """f32[16, 64] with dim 0 over (data, model) of {data: 2, model: 4}, padded 4 rows each
    side: gathered over model, each data block pads its own rows (1,536 bytes, GSPMD's). Greedy
    chose data first, pricing its halo while model still split the rows (two rounds), and
    gathered both axes (3,584 bytes); an equation whose lowering runs collectives now chooses
    its axes a second time, each with the others as chosen."""
    mesh = sf.make_mesh({"data": 2, "model": 4})
    spec = PS(("data", "model"))
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    fn = lambda a: jnp.tanh(jnp.pad(a, ((4, 4), (8, 8)), constant_values=0.5)) * 2.0  # noqa: E731
    f = sf.parallelize(fn, mesh=mesh, in_specs=spec, out_specs=spec)
    _same(f, fn, x)
    plan = f.explain(x)
    assert [(c.kind, c.axes, c.bytes) for c in plan.collectives] == [("all_gather", ("model",), 1536)], str(plan)


def test_min_over_a_split_dim_reduces_a_partial_min(mesh):
    """jnp.min over a split dim gathered the whole input (3,072 bytes for f32[16, 64] over
    {y: 4}); it now leaves a partial min and all-reduces the result."""
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    fn = lambda a: (jnp.min(a), jnp.min(a, axis=1))  # noqa: E731
    f = sf.parallelize(fn, mesh=mesh, in_specs=PS(None, "y"), out_specs=PS())
    got, want = f(x), jax.jit(fn)(x)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    plan = f.explain(x)
    assert [c.kind for c in plan.collectives] == ["all_reduce", "all_reduce"], str(plan)
    assert plan.total_bytes == round(2 * 3 / 4 * 4) + round(2 * 3 / 4 * 16 * 4)


@pytest.mark.parametrize("spec", [PS("x"), PS(("x", "y"))])
def test_argmax_over_a_split_dim_gathers_each_blocks_winner_not_the_operand(spec):
    """jnp.argmax / argmin over a split dim gathered the whole operand (f32[16, 64] over x:
    2,048 bytes); now each block's winning value and index are all-gathered (out-sized: 64
    entries of each per block) and the first winner taken. Ties across blocks and a NaN take
    the first occurrence, as one device does. (Priced by bytes, no latency: at this size four
    small gathers cost more α than one gather of the operand, which the default model keeps.)"""
    from shardflow import hlo

    mesh = sf.make_mesh({"x": 2, "y": 4})
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    x[[3, 9, 14], 5] = 7.0  # a tie across blocks: the first row wins
    x[[12, 2], 6] = np.nan  # a NaN wins argmax; the first one
    x[[1, 13], 7] = -7.0
    fn = lambda a: (jnp.argmax(a, axis=0), jnp.argmin(a, axis=0))  # noqa: E731
    f = sf.parallelize(fn, mesh=mesh, in_specs=spec, out_specs=PS(), links=sf.LinkModel(alpha=0.0))
    got, want = f(x), jax.jit(fn)(x)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    assert int(got[0][5]) == 3 and int(got[0][6]) == 2 and int(got[1][7]) == 1
    plan = f.explain(x)
    assert not [c for c in plan.collectives if c.kind == "all_gather" and c.shape == x.shape], str(plan)
    winners = [c for c in plan.collectives if "winner" in c.reason]
    assert sorted(c.dtype for c in winners) == ["float32", "float32", "int32", "int32"], str(plan)
    assert plan.total_bytes == hlo.total_bytes(f.lower(x).compile().as_text())


def test_the_lowered_program_asks_gpus_for_no_dynamic_slice_fusion(mesh):
    """XLA's dynamic-slice fusion cloned the Pallas attention forward whose results a layer scan
    stacks (two forwards per layer on GPUs: benchmarks/results/scaling.md): the
    lowered program turns it off on GPU meshes and passes nothing elsewhere (an option XLA:CPU
    does not know would be an error)."""
    import types

    from shardflow.passes.lower import compiler_options

    assert compiler_options(mesh) == {}
    gpu = types.SimpleNamespace(devices=np.asarray([types.SimpleNamespace(platform="gpu")]))
    assert compiler_options(gpu) == {"xla_gpu_enable_dynamic_slice_fusion": False}


@pytest.mark.parametrize("mode", [None, "clip", "drop"])
def test_a_scatter_into_a_split_table_drops_the_rows_a_device_does_not_hold(mesh, mode):
    """x.at[idx].add(updates) with x's rows split: each device adds the updates of its own rows
    by scattering at block-local indices that XLA drops outside the block, with no mask and no
    select over the updates (they cost 2.3-2.6x GSPMD's flops on the suite's scatter_add rows)."""
    r = np.random.default_rng(3)
    x, updates = r.standard_normal((64, 32)).astype(np.float32), r.standard_normal((16, 32)).astype(np.float32)
    idx = r.integers(-70, 70, (16,)).astype(np.int32)  # negative and out of range included
    fn = lambda a, i, u: a.at[i].add(u, mode=mode)  # noqa: E731
    f = sf.parallelize(fn, mesh=mesh, in_specs=(PS(("x", "y")), PS(), PS()), out_specs=PS(("x", "y")))
    _same(f, fn, x, idx, updates)
    emitted = f.lower(x, idx, updates).as_text().splitlines()  # before XLA's own expansion of the scatter
    assert not [line for line in emitted if "stablehlo.select" in line and "xf32>" in line]
    assert len([line for line in emitted if '"stablehlo.scatter"' in line]) == 1
    # one element per update, its column index out of range too (clamped under "clip")
    cols = r.integers(-40, 40, (16,)).astype(np.int32)
    cell = lambda a, i, j, u: a.at[i, j].add(u[:, 0], mode=mode)  # noqa: E731
    g = sf.parallelize(cell, mesh=mesh, in_specs=(PS(("x", "y")), PS(), PS(), PS()), out_specs=PS(("x", "y")))
    _same(g, cell, x, idx, cols, updates)


def test_a_pad_whose_blocks_keep_their_own_rows_places_them_without_masks():
    """f32[16, 64] with dim 0 split over all 8 devices of {data: 2, model: 4}, padded 4 rows each
    side: data's blocks pad their own rows (one round, no exchange), and the block is the rows
    placed in the pad value — no iota masks and selects over it (pad dp: 1.94x GSPMD's flops
    before, 0.22x after)."""
    mesh = sf.make_mesh({"data": 2, "model": 4})
    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    fn = lambda a: jnp.tanh(jnp.pad(a, ((4, 4), (8, 8)), constant_values=0.5)) * 2.0  # noqa: E731
    spec = PS(("data", "model"))
    f = sf.parallelize(fn, mesh=mesh, in_specs=spec, out_specs=spec)
    _same(f, fn, x)
    hlo_text = f.lower(x).compile().as_text()
    assert not [line for line in hlo_text.splitlines() if " select(" in line and "f32[" in line.split("=")[1]]
