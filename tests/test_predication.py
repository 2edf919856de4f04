"""sf.predicated: rows of weight zero contribute nothing, and under sf.parallelize a device whose
rows all weigh zero skips the work (a conditional on its own block) with the same results —
values and gradients — as one device; a body that would leave a skipping device out of a
collective is refused."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardflow as sf
from shardflow.predication import PredicationWarning


def per_row_loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum((h @ params["w2"]) ** 2, axis=-1)  # [rows]


def setup(seed=0, rows=16, d=8, f=32):
    r = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(r.normal(size=(d, f)) / 3, jnp.float32),
        "w2": jnp.asarray(r.normal(size=(f, d)) / 3, jnp.float32),
    }
    x = jnp.asarray(r.normal(size=(rows, d)), jnp.float32)
    weights = jnp.asarray(np.repeat([1.0, 1.0, 0.5, 0.0], rows // 4), jnp.float32)  # the last quarter padding
    return params, x, weights


def step(params, x, weights):
    return jax.value_and_grad(lambda p: jnp.sum(sf.predicated(per_row_loss, weights, p, x)))(params)


def test_padding_rows_contribute_nothing_on_one_device():
    params, x, weights = setup()
    loss, grads = jax.jit(step)(params, x, weights)
    want, want_grads = jax.value_and_grad(lambda p: jnp.sum(per_row_loss(p, x) * weights))(params)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, want_grads)


def test_devices_whose_rows_all_weigh_zero_skip_the_work_with_one_devices_results():
    """Rows over 'data' (4 blocks, the last all padding), the hidden layer over 'model' (tensor
    parallel inside the body): the loss and gradients equal one device's, and the forward and
    the backward each run under a conditional on the device's own weights."""
    params, x, weights = setup()
    mesh = sf.make_mesh({"data": 4, "model": 2})
    specs = ({"w1": P(None, "model"), "w2": P("model", None)}, P("data"), P("data"))
    sharded = sf.parallelize(step, mesh=mesh, in_specs=specs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PredicationWarning)
        loss, grads = sharded(params, x, weights)
    want, want_grads = jax.jit(step)(params, x, weights)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads)
    hlo = sharded.lower(params, x, weights).compile().as_text()
    assert len(re.findall(r"^\s*%\S+ = .* conditional\(", hlo, re.M)) >= 2, (
        "a conditional for the forward and the backward"
    )


def test_the_solvers_plan_is_exact_even_where_it_cannot_skip():
    """Partial: the solver may reduce the weights' gradients over 'data' inside the backward's
    body, which no device may then skip; the results stay one device's."""
    params, x, weights = setup()
    mesh = sf.make_mesh({"data": 4, "model": 2})
    specs = ({"w1": P(None, "model"), "w2": P("model", None)}, P("data"), P("data"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PredicationWarning)
        loss, grads = sf.parallelize(step, mesh=mesh, in_specs=specs, passes=sf.passes.SOLVER)(params, x, weights)
    want, want_grads = jax.jit(step)(params, x, weights)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads)


def test_a_body_that_gathers_over_the_row_axis_runs_everywhere_and_says_so():
    """FSDP: the weights split over 'data', which splits the rows too: the body all-gathers them
    over 'data', so no device may skip (it would leave the others waiting): every device runs
    it, the results are exact, and a warning names the line."""
    params, x, weights = setup()
    mesh = sf.make_mesh({"data": 4, "model": 2})
    specs = ({"w1": P("data", "model"), "w2": P("model", "data")}, P("data"), P("data"))
    with pytest.warns(
        PredicationWarning, match=r"test_predication.py:\d+: predicated: its body moves data over .*'data'"
    ):
        loss, grads = sf.parallelize(step, mesh=mesh, in_specs=specs)(params, x, weights)
    want, want_grads = jax.jit(step)(params, x, weights)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads)
