"""Pipeline parallelism (shardflow/pipelining.py, pipeline_tables.py, pipeline_executor.py) on 8
simulated CPU devices: the loss and every
gradient of a pipelined stack of layers plus a head equal plain autodiff of the same model on
one device — the primitive bound outside parallelize, the per-device executor in a shard_map,
and sf.parallelize composing the pipeline axis with data and tensor parallelism — for every
built-in schedule of shardflow.schedules."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from solve_cases import assert_optimum_prices_the_boxed_plan

import shardflow as sf
from shardflow import pipeline_executor, pipeline_tables, schedules

d, Lc, mbsz = 8, 2, 4


def layer(w, h):
    return jnp.tanh(h @ w["w"] + w["b"])


def head_fn(hp, y, tgt):
    return jnp.mean((y @ hp - tgt) ** 2)


def model(n_layers, m, seed=0):
    r = np.random.default_rng(seed)
    layers = {
        "w": jnp.asarray(r.standard_normal((n_layers, d, d)) / 3, jnp.float32),
        "b": jnp.asarray(r.standard_normal((n_layers, d)) / 3, jnp.float32),
    }
    hp = jnp.asarray(r.standard_normal((d, 3)), jnp.float32)
    x = jnp.asarray(r.standard_normal((m * mbsz, d)), jnp.float32)
    tg = jnp.asarray(r.standard_normal((m * mbsz, 3)), jnp.float32)
    return layers, hp, x, tg


def plain_loss(layers, hp, x, tg, m):
    """The un-pipelined model: every layer in turn, the head's loss averaged over micro-batches."""

    def one(x, t):
        h = jax.lax.scan(lambda h, w: (layer(w, h), None), x, layers)[0]
        return head_fn(hp, h, t)

    return jnp.mean(jax.vmap(one)(strided(x, m), strided(tg, m)))


def strided(a, m):
    """Micro-batch i holds rows i, i + m, ... (sf.pipeline's split)."""
    return a.reshape((a.shape[0] // m, m) + a.shape[1:]).swapaxes(0, 1)


def assert_close(got, want, tol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def check(table):
    """The executor under shard_map over {pipe: p} against plain autodiff."""
    p, m, v = table.stages, table.microbatches, table.chunks
    layers, hp, x, tg = model(p * v * Lc, m)
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, m)
    got = jax.value_and_grad(
        lambda *a: sf.pipeline(
            layer, a[0], a[2], head=head_fn, head_params=a[1], head_args=a[3], stages=p, microbatches=m, schedule=table
        ),
        argnums=(0, 1, 2),
    )(layers, hp, x, tg)
    assert_close(got, want)  # the primitive bound outside parallelize: micro-batches in turn

    # the per-device program, in a shard_map over the pipeline axis
    order = np.array([[table.virtual_stage(s, c) for c in range(v)] for s in range(p)])
    stage = [a.reshape((p * v, Lc) + a.shape[1:])[order] for a in jax.tree.leaves(layers)]
    xs, tgs = strided(x, m), strided(tg, m)
    chunk = jax.tree.unflatten(jax.tree.structure(layers), [jax.ShapeDtypeStruct(a.shape[2:], a.dtype) for a in stage])
    jaxprs = pipeline_executor.bodies_of(
        layer,
        head_fn,
        chunk,
        jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype),
        hp,
        jax.ShapeDtypeStruct(tgs.shape[1:], tgs.dtype),
    )
    bodies = pipeline_executor.callables(jaxprs)
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])

    def body(stage, hp, xs, tgs):
        return pipeline_executor.execute(bodies, table, stage, [hp], xs, [tgs], axis="pipe")

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("pipe"), P(), P(), P()),
            out_specs=(P(), P("pipe"), P(), P(), P("pipe")),
            check_vma=False,
        )
    )
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    loss, d_stage, (d_hp,), d_xs, aux = f(put(stage, P("pipe")), put(hp, P()), put(xs, P()), put(tgs, P()))
    assert aux == []  # layers that return h alone
    inverse = np.argsort(order.reshape(-1))
    d_layers = [
        np.asarray(g).reshape((p * v * Lc,) + g.shape[3:])
        if v == 1
        else np.asarray(g).reshape((p * v, Lc) + g.shape[3:])[inverse].reshape((p * v * Lc,) + g.shape[3:])
        for g in d_stage
    ]
    assert_close(
        (loss, d_layers, d_hp, np.asarray(d_xs).swapaxes(0, 1).reshape(x.shape)),
        (want[0], jax.tree.leaves(want[1][0]), want[1][1], want[1][2]),
    )


SCHEDULES = schedules.BUILTIN


@pytest.mark.slow
@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8)])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipelined_loss_and_gradients_equal_one_device(schedule, p, m):
    check(SCHEDULES[schedule](p, m))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_residual_slots_are_the_schedules_peak(schedule):
    """The executor keeps as many micro-batches' residuals as the schedule has alive at once."""
    table = SCHEDULES[schedule](4, 8)
    assert pipeline_tables.step_tables(table).n_resid == max(
        schedules.peak_live_activations(schedules.with_split_backward(table))
    )


def test_a_step_with_a_micro_batchs_b_and_w_runs_its_whole_backward():
    """Where B and W of a micro-batch share a step, the executor runs the unsplit backward:
    nothing is stashed between them (1f1b-fused: every backward so)."""
    fused = pipeline_tables.step_tables(schedules.one_f_one_b_fused(4, 8))
    assert fused.n_stash == 0 and fused.tables["bw_whole"].sum() == 4 * 8
    assert (fused.tables["w_chunk"] < 0).all()
    zb = pipeline_tables.step_tables(schedules.zb_h1(4, 8))
    assert zb.tables["bw_whole"].sum() < 4 * 8 and zb.n_stash > 0
    # zb-fused: stage s holds 2s W's, split from their B (stashed), and runs them two a step
    held = pipeline_tables.step_tables(schedules.zb_fused(4, 8))
    assert held.w_slots == 2 and held.tables["bw_whole"].sum() == 4 * 8 - sum(2 * s for s in range(4))
    assert [(held.tables["w_chunk"][:, s] >= 0).sum() for s in range(4)] == [0, 2, 4, 6]


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"pipe": 2}, {"model": 2}], ids=["pp2", "in turn"])
def test_bf16_gradients_are_summed_over_micro_batches_in_float32(axes):
    """bf16 parameters: each micro-batch's gradient is bf16, their sum over the micro-batches is
    float32 and rounded to bf16 once, as a loop accumulating into float32 master gradients
    would: within one bf16 rounding of that sum (summed in bf16, 16 roundings, it was not).
    Without a pipe axis the stages run in turn (``sequential``), the same sum."""
    m = 16
    layers, hp, x, tg = jax.tree.map(lambda a: a.astype(jnp.bfloat16), model(2 * Lc, m, seed=3))
    table = schedules.one_f_one_b(2, m)
    per_micro = [
        jax.grad(lambda l, h: plain_loss(l, h, xi, ti, 1), argnums=(0, 1))(layers, hp)
        for xi, ti in zip(strided(x, m), strided(tg, m))
    ]
    want = jax.tree.map(lambda *g: (sum(a.astype(jnp.float32) for a in g) / m).astype(jnp.bfloat16), *per_micro)
    step = sf.parallelize(
        pipelined_step(table if "pipe" in axes else schedules.one_f_one_b(1, m)),
        mesh=sf.make_mesh(axes),
        in_specs=(P("pipe") if "pipe" in axes else P(), P(), P(), P()),
    )
    _, (d_layers, d_hp, _) = step(layers, hp, x, tg)
    for got, exp in zip(jax.tree.leaves((d_layers, d_hp)), jax.tree.leaves(want)):
        assert got.dtype == jnp.bfloat16
        got, exp = np.asarray(got, np.float32), np.asarray(exp, np.float32)
        np.testing.assert_array_less(np.abs(got - exp), np.abs(exp) * 2.0**-7 + 1e-6)


def pipelined_step(table):
    p, m = table.stages, table.microbatches

    def step(layers, hp, x, tg):
        def loss(layers, hp, x):
            return sf.pipeline(
                layer, layers, x, head=head_fn, head_params=hp, head_args=tg, stages=p, microbatches=m, schedule=table
            )

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(layers, hp, x)

    return step


@pytest.mark.slow
@pytest.mark.parametrize(
    "axes,layer_spec,batch_spec",
    [
        ({"pipe": 4}, P("pipe"), P()),
        ({"pipe": 4, "data": 2}, P("pipe"), P("data")),
        ({"pipe": 2, "model": 4}, P("pipe", None, "model"), P()),
    ],
    ids=["pp4", "pp4-dp2", "pp2-tp4"],
)
@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-fused", "interleaved", "zb-h1", "zb-v", "zb-fused"])
def test_parallelize_equals_one_device(axes, layer_spec, batch_spec, schedule):
    p, m = axes["pipe"], 2 * axes["pipe"]
    table = SCHEDULES[schedule](p, m)
    layers, hp, x, tg = model(p * table.chunks * Lc, m)
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, m)
    specs = {"w": layer_spec, "b": P(*layer_spec[:2])}
    step = sf.parallelize(
        pipelined_step(table),
        mesh=sf.make_mesh(axes),
        in_specs=(specs, P(), batch_spec, batch_spec),
        out_specs=(P(), (specs, P(), batch_spec)),
    )
    assert_close(step(layers, hp, x, tg), want)


@pytest.mark.parametrize(
    "axes,layer_spec,batch_spec",
    [
        pytest.param({"pipe": 4}, P("pipe"), P(), id="pp4"),  # the fast tier's
        pytest.param({"pipe": 4, "data": 2}, P("pipe"), P("data"), id="pp4-dp2", marks=pytest.mark.slow),
        pytest.param({"pipe": 2, "model": 4}, P("pipe", None, "model"), P(), id="pp2-tp4", marks=pytest.mark.slow),
        pytest.param(
            {"data": 2, "pipe": 4}, P("pipe", None, "data"), P("data"), id="dp2-pp4-fsdp", marks=pytest.mark.slow
        ),
        pytest.param({"model": 4, "pipe": 2}, P("pipe", None, "model"), P(), id="tp4-pp2", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "schedule",
    ["1f1b", pytest.param("interleaved", marks=pytest.mark.slow), pytest.param("zb-fused", marks=pytest.mark.slow)],
)
def test_the_solver_lays_out_the_stages_with_the_program(axes, layer_spec, batch_spec, schedule):
    """passes.solve solves the five bodies with the program — one layout per value crossing
    between them, the pipeline axis whole inside the stages —: equal to one device, the
    model's optimum prices the plan as boxed (but for collectives combined beyond greedy's
    groups: ``assert_optimum_prices_the_boxed_plan``), and no dearer than greedy's layout
    (pp2 x tp4 under 1f1b: 200 us against 320, the layers' input split over `model`)."""
    p, m = axes["pipe"], 2 * axes["pipe"]
    table = SCHEDULES[schedule](p, m)
    layers, hp, x, tg = model(p * table.chunks * Lc, m)
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, m)
    specs = {"w": layer_spec, "b": P(*layer_spec[:2])}
    plans = []
    for passes in (sf.passes.DEFAULT, sf.passes.SOLVER):
        step = sf.parallelize(
            pipelined_step(table),
            mesh=sf.make_mesh(axes),
            passes=passes,
            in_specs=(specs, P(), batch_spec, batch_spec),
            out_specs=(P(), (specs, P(), batch_spec)),
        )
        plans.append(step.explain(layers, hp, x, tg))
    greedy, solved = plans
    assert solved.planner.startswith("solver (optimal") and "greedy" not in solved.planner, solved.planner
    modelled = float(re.findall(r"([\d.]+) us", solved.planner)[0]) * 1e-6
    assert_optimum_prices_the_boxed_plan(modelled, solved)
    assert solved.modelled_seconds <= greedy.modelled_seconds * (1 + 1e-9)
    assert_close(step(layers, hp, x, tg), want)


@pytest.mark.slow
def test_sf_auto_lays_out_the_head_and_the_batch_of_a_pipeline():
    """sf.AUTO arguments: the solver runs without greedy's plan first, the pipeline's stages
    laid out with the rest."""
    table = SCHEDULES["1f1b"](2, 4)
    layers, hp, x, tg = model(2 * Lc, 4)
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, 4)
    specs = {"w": P("pipe", None, "model"), "b": P("pipe")}
    step = sf.parallelize(
        pipelined_step(table),
        mesh=sf.make_mesh({"pipe": 2, "model": 4}),
        passes=sf.passes.SOLVER,
        in_specs=(specs, sf.AUTO, sf.AUTO, P()),
    )
    assert "sf.AUTO chose 2 input layouts" in step.explain(layers, hp, x, tg).planner
    assert_close(step(layers, hp, x, tg), want)


@pytest.mark.slow
@pytest.mark.parametrize("planner", ["greedy", "solver"])
def test_without_a_pipeline_axis_the_stages_run_in_turn(planner):
    passes = sf.passes.SOLVER if planner == "solver" else sf.passes.DEFAULT
    table = SCHEDULES["1f1b"](4, 8)
    layers, hp, x, tg = model(4 * Lc, 8)
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, 8)
    with pytest.raises(sf.ShardingError, match="axis 'pipe', which the mesh"):
        sf.parallelize(
            pipelined_step(table),
            mesh=sf.make_mesh({"data": 2}),
            passes=passes,
            in_specs=(P(), P(), P("data"), P("data")),
        )(layers, hp, x, tg)
    step = sf.parallelize(
        pipelined_step(SCHEDULES["1f1b"](1, 8)),
        mesh=sf.make_mesh({"data": 2}),
        passes=passes,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), (P(), P(), P("data"))),
    )
    assert_close(step(layers, hp, x, tg), want)
    assert step.explain(layers, hp, x, tg).planner.startswith(planner)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,counts",
    [
        ("1f1b", [3, 2, 2, 1]),
        ("zb-h1", [3, 2, 2, 1]),
        ("interleaved", [2, 2, 1, 1, 1, 1, 2, 2]),
        ("zb-v", [1, 2, 2, 1, 1, 1, 1, 3]),
    ],
)
def test_uneven_stages_equal_one_device(schedule, counts):
    """layers_per_stage: stages (virtual stages, with chunks) padded to the largest count, the
    padding skipped."""
    table = SCHEDULES[schedule](4, 8)
    layers, hp, x, tg = model(sum(counts), 8)
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, 8)

    def step(layers, hp, x, tg):
        def loss(layers, hp, x):
            return sf.pipeline(
                layer,
                layers,
                x,
                head=head_fn,
                head_params=hp,
                head_args=tg,
                stages=4,
                microbatches=8,
                schedule=table,
                layers_per_stage=counts,
            )

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(layers, hp, x)

    assert_close(step(layers, hp, x, tg), want)
    parallel = sf.parallelize(step, mesh=sf.make_mesh({"pipe": 4}), in_specs=(P(), P(), P(), P()))
    assert_close(parallel(layers, hp, x, tg), want)


def test_uneven_stages_are_checked():
    layers, hp, x, tg = model(8, 8)
    with pytest.raises(ValueError, match=r"layers_per_stage \[3, 3, 2, 1\] must be 4 counts"):
        sf.pipeline(
            layer,
            layers,
            x,
            head=head_fn,
            head_params=hp,
            head_args=tg,
            stages=4,
            microbatches=8,
            layers_per_stage=[3, 3, 2, 1],
        )
    with pytest.raises(ValueError, match=r"must be 8 counts of at least 1, for 4 stages x 2 chunks"):
        sf.pipeline(
            layer,
            layers,
            x,
            head=head_fn,
            head_params=hp,
            head_args=tg,
            stages=4,
            microbatches=8,
            schedule="interleaved",
            layers_per_stage=[2, 2, 2, 2],
        )


@pytest.mark.slow
def test_bf16_loss_keeps_its_dtype():
    table = SCHEDULES["1f1b"](4, 8)
    layers, hp, x, tg = jax.tree.map(lambda a: a.astype(jnp.bfloat16), model(4 * Lc, 8))
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, 8)
    got = sf.parallelize(pipelined_step(table), mesh=sf.make_mesh({"pipe": 4}), in_specs=(P("pipe"), P(), P(), P()))(
        layers, hp, x, tg
    )
    assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(lambda a: a.dtype, want)
    assert_close(
        jax.tree.map(lambda a: a.astype(jnp.float32), got),
        jax.tree.map(lambda a: a.astype(jnp.float32), want),
        tol=3e-2,
    )


@pytest.mark.slow
def test_compiled_memory_falls_with_the_schedules_live_activations():
    """XLA's temporaries for the pipelined step: 1F1B keeps p micro-batches' residuals where
    GPipe keeps m, so at m = 4p its compiled step needs less memory."""
    wide = 64
    r = np.random.default_rng(0)
    layers = {
        "w": jnp.asarray(r.standard_normal((4, wide, wide)) / 8, jnp.float32),
        "b": jnp.zeros((4, wide), jnp.float32),
    }
    hp = jnp.asarray(r.standard_normal((wide, 3)), jnp.float32)
    x, tg = jnp.ones((16 * 32, wide), jnp.float32), jnp.ones((16 * 32, 3), jnp.float32)
    temp = {}
    for name in ("gpipe", "1f1b"):
        step = sf.parallelize(
            pipelined_step(SCHEDULES[name](4, 16)), mesh=sf.make_mesh({"pipe": 4}), in_specs=(P("pipe"), P(), P(), P())
        )
        temp[name] = step.lower(layers, hp, x, tg).compile().memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] < 0.8 * temp["gpipe"], temp


@pytest.mark.slow
def test_fsdp_weights_enter_a_stage_whole_once_a_step_not_once_a_micro_batch():
    """Over an axis that splits the micro-batches the stage's weights are gathered before the
    pipeline and their gradients reduce-scattered after it, once a step; inside the bodies
    they would be gathered again for every micro-batch (and every backward)."""
    table = SCHEDULES["1f1b"](4, 8)
    layers, hp, x, tg = model(4 * Lc, 8)
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, 8)
    specs = {"w": P("pipe", "data", None), "b": P("pipe", "data")}
    step = sf.parallelize(
        pipelined_step(table),
        mesh=sf.make_mesh({"data": 2, "pipe": 4}),
        in_specs=(specs, P(), P("data"), P("data")),
        out_specs=(P(), (specs, P(), P("data"))),
    )
    on_data = [
        c
        for c in step.explain(layers, hp, x, tg).collectives
        if c.axes == ("data",) and c.kind in ("all_gather", "reduce_scatter")
    ]
    assert {c.kind for c in on_data} == {"all_gather", "reduce_scatter"}, on_data
    assert all(c.count == 1 for c in on_data), [(c.kind, c.count, c.source) for c in on_data]
    assert_close(step(layers, hp, x, tg), want)


@pytest.mark.parametrize(
    "axes,layer_spec,batch_spec",
    [
        ({"data": 2, "pipe": 4}, P("pipe", "data", None), P("data")),
        ({"model": 4, "pipe": 2}, P("pipe", None, "model"), P()),
    ],
    ids=["dp2-pp4-fsdp", "tp4-pp2"],
)
def test_the_pipeline_axis_anywhere_in_the_mesh(axes, layer_spec, batch_spec):
    """Inside a stage the pipeline axis splits nothing (each of its devices runs its own stage):
    with it after another axis, propagation once split the stage's values over it — a reshape
    that failed to lower, or collectives over all 8 devices inside one stage's branch (a hang
    on GPUs)."""
    table = SCHEDULES["1f1b"](axes["pipe"], 2 * axes["pipe"])
    layers, hp, x, tg = model(axes["pipe"] * Lc, 2 * axes["pipe"])
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, 2 * axes["pipe"])
    specs = {"w": layer_spec, "b": P(*layer_spec[:2])}
    step = sf.parallelize(
        pipelined_step(table),
        mesh=sf.make_mesh(axes),
        in_specs=(specs, P(), batch_spec, batch_spec),
        out_specs=(P(), (specs, P(), batch_spec)),
    )
    own = "sf_pipeline passes activations"
    assert all(c.reason.startswith(own) for c in step.explain(layers, hp, x, tg).collectives if "pipe" in c.axes)
    assert_close(step(layers, hp, x, tg), want)


def widening(w, h):
    return jnp.concatenate([layer(w, h), h], axis=-1)


def to_bf16(w, h):
    return layer(w, h).astype(jnp.bfloat16)


def two_outputs(w, h):
    return layer(w, h), h


def per_row_loss(hp, y, tgt):
    return jnp.mean((y @ hp - tgt) ** 2, axis=-1)


def per_row_loss_term(w, h):
    h = layer(w, h)
    return h, jnp.mean(h, axis=1), {}


def count_loss(hp, y, tgt):
    return jnp.sum(y @ hp > tgt)


@pytest.mark.parametrize(
    "layer_fn, head, message",
    [
        (
            widening,
            head_fn,
            r"layer_fn widening \(test_pipeline.py:\d+\) must map a micro-batch's activations "
            r"h float32\[4, 8\] to the same shape and dtype, or return \(h, loss term, metrics\); "
            r"it returns float32\[4, 16\]",
        ),
        (
            to_bf16,
            head_fn,
            r"layer_fn to_bf16 \(test_pipeline.py:\d+\) must map .* float32\[4, 8\] .*; "
            r"it returns bfloat16\[4, 8\]",
        ),
        (
            two_outputs,
            head_fn,
            r"layer_fn two_outputs \(test_pipeline.py:\d+\) must map .*; it returns "
            r"\(float32\[4, 8\], float32\[4, 8\]\)",
        ),
        (
            per_row_loss_term,
            head_fn,
            r"layer_fn per_row_loss_term \(test_pipeline.py:\d+\) returns \(h, loss term, metrics\) "
            r"with a loss term float32\[4\]; it must be a float scalar",
        ),
        (
            layer,
            per_row_loss,
            r"head per_row_loss \(test_pipeline.py:\d+\) must return a micro-batch's loss, a "
            r"float scalar; it returns float32\[4\] \(y float32\[4, 8\]\)",
        ),
        (
            layer,
            count_loss,
            r"head count_loss \(test_pipeline.py:\d+\) must return .* a float scalar; it returns "
            r"int32\[\]",
        ),
    ],
    ids=["shape", "dtype", "tuple", "non-scalar-loss-term", "non-scalar-loss", "integer-loss"],
)
def test_a_layer_or_head_of_the_wrong_shape_is_named(layer_fn, head, message):
    layers, hp, x, tg = model(4, 2)
    with pytest.raises(sf.ShardingError, match=r"^test_pipeline.py:\d+: sf.pipeline: " + message):
        sf.pipeline(layer_fn, layers, x, head=head, head_params=hp, head_args=tg, stages=2, microbatches=2)
