"""split_vjp cuts a backward into B (input gradient + stash) and W (weight gradient): together
they compute the backward's numbers, and no equation runs twice — W holds only the weight
gradients' matmuls, B only the input gradient's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_tier import examples
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.extend.core import jaxpr_as_fun

from shardflow.split_vjp import split_vjp

d = 16


def mlp(w, h):
    return jnp.tanh(h @ w["w"] + w["b"]) @ w["v"]


def gated(w, h):  # two matmuls sharing an input, a norm scale: Llama's MLP in small
    n = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * w["scale"]
    return h + (jax.nn.silu(n @ w["w"]) * (n @ w["b"])) @ w["v"]


def remat(w, h):
    return jax.checkpoint(gated)(w, h)


def masked(w, h):  # an uneven stage's padding layer: predication by lax.cond
    return jax.lax.cond(w["b"][0] > -10, lambda: mlp(w, h), lambda: h)


def nested(w, h):  # a layer that is itself a scan over two sub-steps
    return jax.lax.scan(lambda h, _: (mlp(w, h), None), h, None, length=2)[0]


SHARED = jnp.full((d, d), 0.1, jnp.float32)


def closes_over(w, h):  # a weight shared by every layer: its gradient sums in a scan carry
    return mlp(w, h) @ SHARED + h


# name: (layer, matmuls per layer in W, in B). W: one per weight. B: one per matmul the input
# gradient passes; under remat also the two of the forward it recomputes (n @ w, n @ b); a layer
# under lax.cond is cut like the others, in both conds' branches.
LAYERS = dict(
    mlp=(mlp, 2, 2),
    gated=(gated, 3, 3),
    remat=(remat, 3, 3 + 2),
    masked=(masked, 2, 2),
    nested=(nested, 4, 4),
    closes_over=(closes_over, 2, 3),
)


def params(n_layers, seed=0):
    r = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(r.standard_normal((n_layers,) + shape) / 4, jnp.float32)
    return {"w": normal(d, 2 * d), "b": normal(d, 2 * d), "v": normal(2 * d, d), "scale": 1 + normal(d)}


def backward_of(layer, stack, x):
    """backward(stack leaves, residuals, dy) -> (d stack leaves, dx) as pipelining traces it."""
    return backward_of_fn(lambda stack, x: jax.lax.scan(lambda h, w: (layer(w, h), None), x, stack)[0], stack, x)


def backward_of_fn(f, w, x):
    """backward(residuals, dy) -> (d leaves of w, dx) of ``f(w, x)``."""
    leaves, tree = jax.tree.flatten(w)

    def stage(leaves, x):
        return f(jax.tree.unflatten(tree, leaves), x)

    y, vjp = jax.vjp(stage, leaves, x)
    residuals, vjp_tree = jax.tree.flatten(vjp)

    def backward(residuals, dy):
        d_leaves, dx = jax.tree.unflatten(vjp_tree, residuals)(dy)
        return list(d_leaves), dx

    return jax.make_jaxpr(backward)(residuals, y), residuals, y, len(leaves)


def count(jaxpr, name, trips=1):
    """How many times primitive ``name`` runs, scans counted per iteration."""
    n = 0
    for e in jaxpr.eqns:
        n += trips * (e.primitive.name == name)
        inner_trips = trips * e.params["length"] if e.primitive.name == "scan" else trips
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            n += count(sub, name, inner_trips)
    return n


@pytest.mark.parametrize("name", list(LAYERS))
def test_b_then_w_is_the_backward_and_nothing_runs_twice(name):
    layer, w_dots, b_dots = LAYERS[name]
    stack = params(3)
    if name not in ("gated", "remat"):
        stack = {"w": stack["w"], "b": stack["b"][:, 0], "v": stack["v"]}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, d)), jnp.float32)
    backward, residuals, y, n = backward_of(layer, stack, x)
    split = split_vjp(backward, shared=len(residuals), weights=n)
    dy = jnp.asarray(np.random.default_rng(2).standard_normal(y.shape), jnp.float32)

    want = jaxpr_as_fun(backward)(*residuals, dy)
    dx, *stash = jaxpr_as_fun(split.b)(*residuals, dy)
    d_leaves = jaxpr_as_fun(split.w)(*residuals, *stash)
    assert len(stash) == split.n_stash > 0
    for a, b in zip(want, list(d_leaves) + [dx]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)

    dots = {j: count(x.jaxpr, "dot_general") for j, x in (("all", backward), ("b", split.b), ("w", split.w))}
    assert dots["b"] + dots["w"] == dots["all"]
    assert (dots["w"], dots["b"]) == (3 * w_dots, 3 * b_dots)


def split_equals_backward(backward, residuals, y, n, seed=2):
    """split_vjp's B then W on (residuals, a random dy) against the backward; the split."""
    split = split_vjp(backward, shared=len(residuals), weights=n)
    dy = jnp.asarray(np.random.default_rng(seed).standard_normal(y.shape), jnp.float32)
    want = jaxpr_as_fun(backward)(*residuals, dy)
    dx, *stash = jaxpr_as_fun(split.b)(*residuals, dy)
    d_leaves = jaxpr_as_fun(split.w)(*residuals, *stash)
    for a, b in zip(want, list(d_leaves) + [dx]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    return split


def cond_matmuls(jaxpr, in_cond=False):
    """The result shapes of the matmuls in ``jaxpr``'s conds' branches (inside scans too), each
    once, sorted: [4, ...] the input gradient's, weight-shaped the weight gradients'."""
    shapes = [e.outvars[0].aval.shape for e in jaxpr.eqns if in_cond and e.primitive.name == "dot_general"]
    for e in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            shapes += cond_matmuls(sub, in_cond or e.primitive.name == "cond")
    return sorted(shapes)


@pytest.mark.slow
@pytest.mark.parametrize("active", [True, False])
def test_a_cond_is_cut_into_a_b_cond_and_a_w_cond(active):
    """lax.cond(pred, layer, identity), an uneven stage's padding layer: B's cond runs the two
    input-gradient matmuls, W's cond the two weight-gradient ones (not B's: a whole layer's
    backward in B would leave W nothing to fill the bubbles with)."""
    w = {k: v[0] for k, v in params(1).items() if k in ("w", "v")}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, d)), jnp.float32)
    flag = jnp.float32(active)

    def f(w, x):
        return jax.lax.cond(flag > 0, lambda: jnp.tanh(x @ w["w"]) @ w["v"], lambda: x)

    backward, residuals, y, n = backward_of_fn(f, w, x)
    split = split_equals_backward(backward, residuals, y, n)
    assert count(split.b.jaxpr, "cond") == count(split.w.jaxpr, "cond") == 1
    assert cond_matmuls(split.b.jaxpr) == [(4, d), (4, 2 * d)]
    assert cond_matmuls(split.w.jaxpr) == [(d, 2 * d), (2 * d, d)]
    assert len(cond_matmuls(backward.jaxpr)) == 4


def test_a_scan_of_padded_layers_cuts_its_cond():
    """The pipeline's uneven stage: a scan over stacked layers, each under lax.cond on its
    ``active`` flag. B's scan stashes the cond's values per layer; W's runs the weight matmuls."""
    stack = {k: v for k, v in params(4).items() if k in ("w", "v")}
    stack["active"] = jnp.asarray([1, 0, 1, 0], jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, d)), jnp.float32)

    def padded(w, h):
        return jax.lax.cond(w["active"] > 0, lambda: jnp.tanh(h @ w["w"]) @ w["v"] + h, lambda: h)

    backward, residuals, y, n = backward_of(padded, stack, x)
    split = split_equals_backward(backward, residuals, y, n)
    assert split.n_stash > 0
    dots = [count(j.jaxpr, "dot_general") for j in (backward, split.b, split.w)]
    assert dots == [4 * 4, 4 * 2, 4 * 2]  # per layer: 2 in B's true branch, 2 in W's
    assert cond_matmuls(split.b.jaxpr) == [(4, d), (4, 2 * d)]
    assert cond_matmuls(split.w.jaxpr) == [(d, 2 * d), (2 * d, d)]


def test_a_switch_shares_stash_slots_between_its_branches():
    """lax.switch of branches with different stashes: B's cond returns one list of slots (values
    of one shape and dtype in different branches share one), each branch zero-filling the slots
    it does not use; each index gives the backward's numbers."""
    w = {k: v[0] for k, v in params(1).items() if k in ("w", "v")}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, d)), jnp.float32)
    branches = [
        lambda w, x: jnp.tanh(x @ w["w"]) @ w["v"],  # stashes d(x @ w): [4, 2d]
        lambda w, x: x @ w["w"][:, :d] * 2,  # stashes 2 dy: [4, d]
        lambda w, x: jnp.sin(x @ w["w"]) @ w["v"],  # stashes d(x @ w): [4, 2d]
        lambda w, x: x,
    ]  # stashes nothing
    for i in range(len(branches)):
        backward, residuals, y, n = backward_of_fn(lambda w, x: jax.lax.switch(i, branches, w, x), w, x)
        split = split_equals_backward(backward, residuals, y, n)
        (b_cond,) = [e for e in split.b.jaxpr.eqns if e.primitive.name == "cond"]
        assert [v.aval.shape for v in b_cond.outvars[1:]] == [(4, 2 * d), (4, d)]
        assert [len(cond_matmuls(j.jaxpr)) for j in (split.b, split.w)] == [2 + 1 + 2, 2 + 1 + 2]
        assert {s[0] for s in cond_matmuls(split.b.jaxpr)} == {4}


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_a_llama_block_splits_into_its_seven_input_and_seven_weight_matmuls(remat):
    """The model's own layer as sf.pipeline traces it: W runs the 7 weight-gradient matmuls
    of each block (q, k, v, o, gate, up, down) and nothing of the input gradient."""
    from test_models import SMALL_LLAMA

    from shardflow import models, pipeline_executor
    from shardflow.models.pipeline import layer_step

    fields = {k: v for k, v in SMALL_LLAMA.items() if k not in ("preset", "n_layers")}
    cfg = models.preset(SMALL_LLAMA["preset"], **fields, n_layers=2, remat=remat)
    model = models.build(cfg)
    graphdef, layers = nnx.split(model.layers)
    cos, sin = models.llama.rope_tables(8, cfg.head_dim, cfg.rope_theta)
    step = layer_step(graphdef, remat, cos, sin)
    x = jax.ShapeDtypeStruct((2, 8, cfg.d_model), jnp.float32)
    bodies = pipeline_executor.bodies_of(
        lambda layer, h: step(h, layer)[0], lambda hp, y, a: jnp.sum(y), layers, x, (), ()
    )
    w_dots, b_dots = count(bodies.backward_w.jaxpr, "dot_general"), count(bodies.backward_x.jaxpr, "dot_general")
    assert w_dots == 2 * 7
    assert b_dots + w_dots == count(bodies.backward.jaxpr, "dot_general")


# Random layers: a chain of steps over h [4, d], each a weight matmul, a nonlinearity, a
# residual add, a product of two branches or a norm-like scale, then an output scale (so every
# layer has a weight), optionally under remat.
STEPS = ("matmul", "tanh", "residual", "gate", "scale")


def random_layer(steps, remat):
    def layer(w, h):
        x = h
        for i, step in enumerate(steps):
            if step == "matmul":
                x = x @ w[f"m{i}"]
            elif step == "tanh":
                x = jnp.tanh(x)
            elif step == "residual":
                x = x + h
            elif step == "gate":
                x = jax.nn.sigmoid(x @ w[f"m{i}"]) * x
            else:
                x = x * w[f"s{i}"]
        return x * w["out"]

    return jax.checkpoint(layer) if remat else layer


def random_stack(steps, n_layers, seed):
    r = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(r.standard_normal((n_layers,) + shape) / 4, jnp.float32)  # noqa: E731
    stack = {"out": 1 + normal(d)}
    for i, step in enumerate(steps):
        if step in ("matmul", "gate"):
            stack[f"m{i}"] = normal(d, d)
        elif step == "scale":
            stack[f"s{i}"] = 1 + normal(d)
    return stack


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(st.sampled_from(STEPS), min_size=1, max_size=6),
    remat=st.booleans(),
    n_layers=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_random_layers_split_exactly(steps, remat, n_layers, seed):
    """B then W computes the backward's numbers; no matmul runs twice; W holds one matmul per
    weight matmul per layer (and, under remat, recomputation that only W reads)."""
    stack = random_stack(steps, n_layers, seed)
    x = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((4, d)), jnp.float32)
    backward, residuals, y, n = backward_of(random_layer(steps, remat), stack, x)
    split = split_vjp(backward, shared=len(residuals), weights=n)
    dy = jnp.asarray(np.random.default_rng(seed + 2).standard_normal(y.shape), jnp.float32)
    want = jaxpr_as_fun(backward)(*residuals, dy)
    dx, *stash = jaxpr_as_fun(split.b)(*residuals, dy)
    d_leaves = jaxpr_as_fun(split.w)(*residuals, *stash)
    for a, b in zip(want, list(d_leaves) + [dx]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    dots = [count(j.jaxpr, "dot_general") for j in (backward, split.b, split.w)]
    assert dots[1] + dots[2] == dots[0]
    weight_dots = n_layers * sum(s in ("matmul", "gate") for s in steps)
    # under remat W also runs the recomputed forward matmuls only it reads (for a scale's gradient)
    assert dots[2] >= weight_dots if remat else dots[2] == weight_dots
