"""Programs, meshes and helpers the solver's tests share (tests/test_solve*.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import shardflow as sf
import shardflow.attention  # noqa: F401  (sf.attention: the attention primitive)
from shardflow.passes import inline
from shardflow.passes.propagate import reduced
from shardflow.program import Program, is_literal


@functools.cache
def mesh(name):
    data, model = (int(n) for n in name.split("x"))
    return sf.make_mesh({"data": data, "model": model})


def inlined(fn, args, mesh, in_sbp, out_sbp) -> Program:
    closed = jax.make_jaxpr(fn)(*args)
    return inline.inline(Program(closed, mesh, tuple(in_sbp), tuple(out_sbp)))


def model_cost(prop, jaxpr, out_sbp, assignment, memo) -> float:
    """The solver's objective for one strategy per equation, computed directly."""

    def seconds(v, a, r):
        key = (v, a, r)
        if key not in memo:
            memo[key] = prop.seconds(v.aval, a, r)
        return memo[key]

    at, wants, cost = dict(prop.sbp), {}, 0.0
    for eqn, (decision, own) in zip(jaxpr.eqns, assignment):
        cost += own
        for x, r in zip(eqn.invars, decision.ins):
            if not is_literal(x):
                wants.setdefault(x, set()).add(r)
        at.update(zip(eqn.outvars, decision.outs))
    for v, want in zip(jaxpr.outvars, out_sbp):
        if want is not None:
            wants.setdefault(v, set()).add(want)
        else:
            cost += seconds(v, at[v], reduced(at[v]))
    return cost + sum(seconds(v, at[v], r) for v, rs in wants.items() for r in rs if r != at[v])


CHAIN_OPS = ("add", "mul", "tanh", "matmul", "T", "sum0", "sum1")


def chain(ops):
    """A program of a few primitives on (a [8, 16], b [16, 8]), each op one equation on the
    latest value (and a same-shaped input where it takes two)."""

    def fn(a, b):
        x = a
        for op in ops:
            other = {a.shape: a, b.shape: b}.get(x.shape, x)
            if op == "add":
                x = x + other
            elif op == "mul":
                x = x * other
            elif op == "tanh":
                x = jnp.tanh(x)
            elif op == "matmul" and x.ndim == 2:
                x = x @ (b if x.shape[1] == 16 else a)
            elif op == "T" and x.ndim == 2:
                x = x.T
            elif op in ("sum0", "sum1") and x.ndim == 2:
                x = jnp.sum(x, axis=int(op[-1]))
        return x

    return fn


def mlp_grad(w1, w2, x):
    return jax.grad(lambda w1, w2: jnp.sum(jnp.tanh(x @ w1) @ w2) ** 2, argnums=(0, 1))(w1, w2)


MLP_ARGS = tuple(
    np.random.default_rng(0).standard_normal(s).astype(np.float32) / 4 for s in ((16, 32), (32, 16), (16, 16))
)


def attention_grad(wq, wo, x):
    """An attention block's weight gradients: q = k = v = x·wq per head, softmax attention, wo."""

    def loss(wq, wo):
        q = jnp.einsum("bsd,dhe->bshe", x, wq)
        p = jax.nn.softmax(jnp.einsum("bqhe,bkhe->bhqk", q, q) / 4.0, axis=-1)
        return jnp.sum(jnp.einsum("bhqk,bkhe,hed->bqd", p, q, wo) ** 2)

    return jax.grad(loss, argnums=(0, 1))(wq, wo)


def sf_attention_grad(wq, wo, x):
    """``attention_grad`` with shardflow's causal attention primitive (its forward and backward
    equations solved like the rest)."""

    def loss(wq, wo):
        q = jnp.einsum("bsd,dhe->bshe", x, wq)
        o = sf.attention.attention(q, q, q, causal=True, backend="xla")
        return jnp.sum(jnp.einsum("bqhe,hed->bqd", o, wo) ** 2)

    return jax.grad(loss, argnums=(0, 1))(wq, wo)


ATTENTION_ARGS = tuple(
    np.random.default_rng(1).standard_normal(s).astype(np.float32) / 4 for s in ((16, 4, 8), (4, 8, 16), (8, 8, 16))
)


def layers_grad(ws, x):
    def loss(ws):
        h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
        return jnp.sum(h * h)

    return jax.grad(loss)(ws)


def train_config(strategy="tp", mesh=None, batch_size=16, preset="tiny", seq=128):
    """The trainer's config of a preset (tiny unless said) under the solver, ``batch_size`` x
    ``seq`` tokens, tensor-parallel on {data: 2, model: 4} unless said."""
    from shardflow.train import config

    mesh = {"data": 2, "model": 4} if mesh is None else mesh
    cfg = config.Config(engine="shardflow", strategy=strategy, mesh=mesh, planner="solver", batch_size=batch_size)
    cfg.model = {"preset": preset}
    cfg.data.seq_len = seq
    return cfg


def train_step_shapes(strategy="tp", mesh=None, batch_size=16, preset="tiny", seq=128):
    """(config, run, state shapes, batch shapes) of ``train_config``'s train step."""
    from shardflow import train

    cfg = train_config(strategy, mesh, batch_size, preset, seq)
    run = train.setup(cfg)
    state = jax.eval_shape(lambda: train.init_state(run))
    tokens = jax.ShapeDtypeStruct((1, batch_size, seq), np.int32)
    return cfg, run, state, {"inputs": tokens, "targets": tokens}


@functools.cache
def tiny_tp_plan():
    """The solver's explain plan of ``train_step_shapes`` (one solve per test process)."""
    _, run, state, batch = train_step_shapes()
    return run.train_step().explain(*state, batch)


def assert_optimum_prices_the_boxed_plan(optimum: float, plan, rel: float = 1e-3):
    """The solver's model ``optimum`` (seconds) against its ``plan`` priced as boxed: the model
    charges a combinable collective 1/n of its latency only in groups greedy's plan runs
    together, so it may miss combinations explain finds (an upper bound), by at most the
    latencies the combined collectives do not pay."""
    links = sf.LinkModel()
    saved = sum(links.latency(c.axes) * c.count for c in plan.collectives if c.combined)
    boxed = plan.modelled_seconds
    assert boxed <= optimum * (1 + rel), (optimum, boxed)
    assert optimum - boxed <= saved + rel * optimum, (optimum, boxed, saved)
