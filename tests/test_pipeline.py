"""Pipeline parallelism (shardflow/pipelining.py) on 8 simulated CPU devices: the loss and every
gradient of a pipelined stack of layers plus a head equal plain autodiff of the same model on
one device, for GPipe, 1F1B (whole and split backward), an interleaved and a V-shaped order.

The tables here are built from per-stage action orders by ``from_orders`` (each stage runs its
next action once its dependency ran at an earlier tick); shardflow.schedules' built-in tables
replace them when that module lands."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import shardflow as sf
from shardflow import pipelining as pp


def from_orders(orders, p, m, v, vs, split):
    """Tick-by-tick: each stage runs its next action once its dependency ran at an earlier tick."""
    where = {vs(s, c): (s, c) for s in range(p) for c in range(v)}
    last = p * v - 1
    done, pos, rows = {}, [0] * p, []
    t = 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row = [None] * p
        for s in range(p):
            if pos[s] >= len(orders[s]): continue
            a = orders[s][pos[s]]
            k = vs(s, a.chunk)
            if a.kind == "F":
                dep = ("F", a.microbatch, k - 1) if k > 0 else None
            elif a.kind == "B":
                dep = ("B", a.microbatch, k + 1) if k < last else ("F", a.microbatch, k)
            else:
                dep = ("B", a.microbatch, k)
            if dep is None or done.get(dep, t) < t:
                row[s] = a
        for s, a in enumerate(row):
            if a is not None:
                done[(a.kind, a.microbatch, vs(s, a.chunk))] = t
                pos[s] += 1
        rows.append(tuple(row)); t += 1
        assert t < 1000
    return pp.Table(tuple(rows), p, m, v, vs, split)

A = pp.Action
def gpipe(p, m):
    return from_orders([[A("F", i) for i in range(m)] + [A("B", i) for i in range(m)] for s in range(p)], p, m, 1, lambda s, c: s, False)
def one_f_one_b(p, m, split=False):
    orders = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        o = [A("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m: o.append(A("F", f)); f += 1
            o.append(A("B", b));
            if split: o.append(A("W", b))
            b += 1
        orders.append(o)
    return from_orders(orders, p, m, 1, lambda s, c: s, split)
def interleaved(p, m, v):
    # simple order: all F chunk-major per group of p microbatches then B reversed (GPipe-like but interleaved)
    orders = []
    for s in range(p):
        o = []
        for g in range(0, m, p):
            for c in range(v):
                o += [A("F", i, c) for i in range(g, g + p)]
        for g in range(0, m, p):
            for c in reversed(range(v)):
                o += [A("B", i, c) for i in range(g, g + p)]
        orders.append(o)
    return from_orders(orders, p, m, v, lambda s, c: c * p + s, False)
def vshape(p, m):
    orders = []
    for s in range(p):
        o = [A("F", i, c) for i in range(m) for c in (0, 1)]
        o += [A("B", i, c) for i in range(m) for c in (1, 0)]
        o2 = [A("F", i, 0) for i in range(m)] + [A("F", i, 1) for i in range(m)] + [A("B", i, 1) for i in range(m)] + [A("B", i, 0) for i in range(m)]
        orders.append(o2)
    return from_orders(orders, p, m, 2, lambda s, c: s if c == 0 else 2 * p - 1 - s, False)

d, Lc, mbsz = 8, 2, 4


def layer(w, h):
    return jnp.tanh(h @ w["w"] + w["b"])


def head_fn(hp, y, tgt):
    return jnp.mean((y @ hp - tgt) ** 2)


def model(n_layers, m, seed=0):
    r = np.random.default_rng(seed)
    layers = {"w": jnp.asarray(r.standard_normal((n_layers, d, d)) / 3, jnp.float32),
              "b": jnp.asarray(r.standard_normal((n_layers, d)) / 3, jnp.float32)}
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
    got = jax.value_and_grad(lambda *a: sf.pipeline(layer, a[0], a[2], head=head_fn, head_params=a[1],
                                                    head_args=a[3], stages=p, microbatches=m, schedule=table),
                             argnums=(0, 1, 2))(layers, hp, x, tg)
    assert_close(got, want)          # the primitive bound outside parallelize: micro-batches in turn

    # the per-device program, in a shard_map over the pipeline axis
    order = np.array([[table.virtual_stage(s, c) for c in range(v)] for s in range(p)])
    stage = [a.reshape((p * v, Lc) + a.shape[1:])[order] for a in jax.tree.leaves(layers)]
    xs, tgs = strided(x, m), strided(tg, m)
    chunk = jax.tree.unflatten(jax.tree.structure(layers), [jax.ShapeDtypeStruct(a.shape[2:], a.dtype) for a in stage])
    jaxprs = pp.bodies_of(layer, head_fn, chunk, jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype), hp,
                          jax.ShapeDtypeStruct(tgs.shape[1:], tgs.dtype))[0]
    bodies = pp.callables(jaxprs)
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])

    def body(stage, hp, xs, tgs):
        return pp.execute(bodies, table, stage, [hp], xs, [tgs], axis="pipe")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("pipe"), P(), P(), P()),
                              out_specs=(P(), P("pipe"), P(), P()), check_vma=False))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    loss, d_stage, (d_hp,), d_xs = f(put(stage, P("pipe")), put(hp, P()), put(xs, P()), put(tgs, P()))
    inverse = np.argsort(order.reshape(-1))
    d_layers = [np.asarray(g).reshape((p * v * Lc,) + g.shape[3:]) if v == 1 else
                np.asarray(g).reshape((p * v, Lc) + g.shape[3:])[inverse].reshape((p * v * Lc,) + g.shape[3:])
                for g in d_stage]
    assert_close((loss, d_layers, d_hp, np.asarray(d_xs).swapaxes(0, 1).reshape(x.shape)),
                 (want[0], jax.tree.leaves(want[1][0]), want[1][1], want[1][2]))


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "1f1b-split": lambda p, m: one_f_one_b(p, m, split=True),
             "interleaved": lambda p, m: interleaved(p, m, 2), "v-shape": vshape}


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8)])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipelined_loss_and_gradients_equal_one_device(schedule, p, m):
    check(SCHEDULES[schedule](p, m))


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16)])
def test_residual_slots_are_what_the_schedule_keeps_alive(p, m):
    """GPipe keeps every micro-batch's activations; 1F1B at most p on the first stage."""
    assert pp.plan(gpipe(p, m)).n_resid == m
    assert pp.plan(one_f_one_b(p, m)).n_resid == p
    assert pp.plan(one_f_one_b(p, m, split=True)).n_resid == p


def test_a_table_that_sends_past_a_neighbour_is_refused():
    scrambled = from_orders([[A("F", 0), A("B", 0)]] * 4, 4, 1, 1, lambda s, c: (0, 2, 1, 3)[s], False)
    with pytest.raises(ValueError, match="stage 0 sends F0 to stage 2, not a neighbour"):
        pp.plan(scrambled)


def test_a_table_without_an_action_is_refused():
    no_backward = pp.Table(((A("F", 0), None), (None, A("F", 0))), 2, 1, 1, lambda s, c: s, False)
    with pytest.raises(ValueError, match="has no B0 of virtual stage 0"):
        pp.plan(no_backward)


def pipelined_step(table):
    p, m = table.stages, table.microbatches

    def step(layers, hp, x, tg):
        def loss(layers, hp, x):
            return sf.pipeline(layer, layers, x, head=head_fn, head_params=hp, head_args=tg,
                               stages=p, microbatches=m, schedule=table)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(layers, hp, x)
    return step


@pytest.mark.parametrize("axes,layer_spec,batch_spec", [
    ({"pipe": 4}, P("pipe"), P()),
    ({"pipe": 4, "data": 2}, P("pipe"), P("data")),
    ({"pipe": 2, "model": 4}, P("pipe", None, "model"), P()),
], ids=["pp4", "pp4-dp2", "pp2-tp4"])
@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-split", "interleaved"])
def test_parallelize_equals_one_device(axes, layer_spec, batch_spec, schedule):
    p, m = axes["pipe"], 2 * axes["pipe"]
    table = SCHEDULES[schedule](p, m)
    layers, hp, x, tg = model(p * table.chunks * Lc, m)
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, m)
    specs = {"w": layer_spec, "b": P(*layer_spec[:2])}
    step = sf.parallelize(pipelined_step(table), mesh=sf.make_mesh(axes),
                          in_specs=(specs, P(), batch_spec, batch_spec),
                          out_specs=(P(), (specs, P(), batch_spec)))
    assert_close(step(layers, hp, x, tg), want)


def test_without_a_pipeline_axis_the_stages_run_in_turn():
    table = SCHEDULES["1f1b"](4, 8)
    layers, hp, x, tg = model(4 * Lc, 8)
    want = jax.value_and_grad(plain_loss, argnums=(0, 1, 2))(layers, hp, x, tg, 8)
    with pytest.raises(sf.ShardingError, match="axis 'pipe', which the mesh"):
        sf.parallelize(pipelined_step(table), mesh=sf.make_mesh({"data": 2}),
                       in_specs=(P(), P(), P("data"), P("data")))(layers, hp, x, tg)
    step = sf.parallelize(pipelined_step(SCHEDULES["1f1b"](1, 8)), mesh=sf.make_mesh({"data": 2}),
                          in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), (P(), P(), P("data"))))
    assert_close(step(layers, hp, x, tg), want)
