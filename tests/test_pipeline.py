"""The pipeline executor (shardflow/pipeline.py) on 8 simulated CPU devices: the loss and every
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

from shardflow import pipeline as pp


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
def layer(x, w):
    return jnp.tanh(x @ w["w"] + w["b"])
def stage_fn(params, x):
    return jax.lax.scan(lambda h, w: (layer(h, w), None), x, params)[0]
def head_fn(hp, y, tgt):
    return jnp.mean((y @ hp - tgt) ** 2)

def check(table):
    p, m, v = table.stages, table.microbatches, table.chunks
    r = np.random.default_rng(0)
    nv = p * v
    params = {"w": jnp.asarray(r.standard_normal((nv, Lc, d, d)) / 3, jnp.float32), "b": jnp.asarray(r.standard_normal((nv, Lc, d)) / 3, jnp.float32)}
    hp = jnp.asarray(r.standard_normal((d, 3)), jnp.float32)
    xs = jnp.asarray(r.standard_normal((m, mbsz, d)), jnp.float32)
    tg = jnp.asarray(r.standard_normal((m, mbsz, 3)), jnp.float32)
    def ref_loss(params, hp, xs):
        def one(x, t):
            h = x
            for k in range(nv):
                h = stage_fn(jax.tree.map(lambda a: a[k], params), h)
            return head_fn(hp, h, t)
        return jnp.mean(jax.vmap(one)(xs, tg))
    rl, (rg, rh, rx) = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(params, hp, xs)
    # device layout: stage s holds virtual stages vs(s, c) for c in range(v) -> [p, v, ...]
    order = np.array([[table.virtual_stage(s, c) for c in range(v)] for s in range(p)])
    local = jax.tree.map(lambda a: a[order], params)
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    def body(lp, hp, xs, tg):
        lp = jax.tree.map(lambda a: a[0], lp)
        l, dp, dh, dx = pp.execute(stage_fn, head_fn, lp, hp, xs, tg, axis="pipe", table=table)
        return l, jax.tree.map(lambda a: a[None], dp), dh, dx
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("pipe"), P(), P(), P()), out_specs=(P(), P("pipe"), P(), P()), check_vma=False))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    l, dp, dh, dx = f(put(local, P("pipe")), put(hp, P()), put(xs, P()), put(tg, P()))
    inv = np.argsort(order.reshape(-1)); dp = jax.device_get(dp)
    dp = jax.tree.map(lambda a: a.reshape((nv,) + a.shape[2:])[inv], dp)
    errs = [float(abs(l - rl))] + [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves((dp, dh, dx)), jax.tree.leaves((rg, rh, rx)))]
    assert max(errs) < 1e-5, errs


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
