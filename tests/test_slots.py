"""shardflow.slots: a jaxpr's stacked inputs read from, and its stacked results written into or
added to, rows of a buffer by the scans themselves."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardflow import slots

L, D = 5, 3


def layers(w, x):
    """A scan over stacked layers: ys are per-layer values (a gradient's shape), the carry x."""

    def body(h, wi):
        return jnp.tanh(h * wi), (h * wi).astype(jnp.bfloat16)

    return lax.scan(body, x, w, reverse=True)


def top_level_shapes(fn, *args):
    return [(e.primitive.name, tuple(v.aval.shape)) for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns for v in e.outvars]


def test_results_are_added_to_their_row_by_the_scan_that_makes_them():
    r = np.random.default_rng(0)
    w, x = jnp.asarray(r.standard_normal((L, D)), jnp.float32), jnp.asarray(r.standard_normal(D), jnp.float32)
    jaxpr = jax.make_jaxpr(layers)(w, x)
    buf = jnp.asarray(r.standard_normal((2, L, D)), jnp.float32)  # [slots, layers, ...], float32
    slot = jnp.int32(1)

    def run(buf, w, x):
        return slots.run(jaxpr, [w, x], adds={1: (buf, slot)})

    h, summed = run(buf, w, x)
    want_h, ys = layers(w, x)
    np.testing.assert_allclose(h, want_h, rtol=1e-6)
    np.testing.assert_array_equal(summed[0], buf[0])
    np.testing.assert_allclose(summed[1], buf[1] + ys.astype(jnp.float32), rtol=1e-6)
    assert summed.dtype == jnp.float32
    # added row by row inside the scan: nothing of the buffer's shape is added outside it
    assert ("add", buf.shape) not in top_level_shapes(run, buf, w, x)


def test_a_result_no_scan_makes_is_added_whole():
    jaxpr = jax.make_jaxpr(lambda w: w * 2.0)(jnp.ones((L, D)))
    buf = jnp.ones((3, L, D))
    (out,) = slots.run(jaxpr, [jnp.full((L, D), 0.5)], adds={0: (buf, jnp.int32(2))})
    np.testing.assert_array_equal(out[2], 2.0)
    np.testing.assert_array_equal(out[:2], 1.0)


def test_a_scan_over_rows_runs_unrolled_each_layer_reading_its_own_array():
    r = np.random.default_rng(1)
    w, x = jnp.asarray(r.standard_normal((L, D)), jnp.float32), jnp.asarray(r.standard_normal(D), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda w, x: (*layers(w, x), w.sum()))(w, x)  # a reverse scan, and one other use
    buf = jnp.zeros((2, L, D), jnp.float32)

    def run(w, x):
        rows = slots.Rows(w[i] for i in range(L))
        return slots.run(jaxpr, [rows, x], writes={1: (buf, jnp.int32(0))})

    h, written, total = run(w, x)
    want_h, ys = layers(w, x)
    np.testing.assert_allclose(h, want_h, rtol=1e-6)
    np.testing.assert_allclose(written[0], ys.astype(jnp.float32), rtol=1e-6)
    np.testing.assert_allclose(total, w.sum(), rtol=1e-6)
    # no loop is left, so no row of w is sliced from the stack inside one
    assert not any(e.primitive.name in ("scan", "while") for e in jax.make_jaxpr(run)(w, x).jaxpr.eqns)


def test_a_result_no_scan_makes_is_added_to_rows_row_by_row():
    jaxpr = jax.make_jaxpr(lambda w: w * 2.0)(jnp.ones((L, D)))
    rows = slots.Rows(jnp.full((D,), float(i)) for i in range(L))
    (out,) = slots.run(jaxpr, [jnp.full((L, D), 0.5)], adds={0: (rows, None)})
    assert isinstance(out, slots.Rows) and len(out) == L
    np.testing.assert_array_equal(jnp.stack(out), jnp.arange(L, dtype=jnp.float32)[:, None] + 1.0 + jnp.zeros((L, D)))
