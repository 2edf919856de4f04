"""shardflow.attention.attention inside parallelize: batch- and head-split q/k/v run the kernels on
local blocks, forward and backward, and equal one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow.attention import attention


def inputs(b=4, s=16, hq=8, hkv=4, d=16, seed=0):
    r = np.random.default_rng(seed)
    q = r.standard_normal((b, s, hq, d)).astype(np.float32)
    k = r.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = r.standard_normal((b, s, hkv, d)).astype(np.float32)
    return q, k, v


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize(
    "spec", [PS("data"), PS(None, None, "model"), PS("data", None, "model")], ids=["batch", "heads", "batch+heads"]
)
def test_sharded_attention_forward_and_grads(backend, spec):
    mesh = sf.make_mesh({"data": 2, "model": 4})
    q, k, v = inputs()
    segment_ids = np.repeat(np.array([[0] * 10 + [1] * 6]), 4, 0).astype(np.int32)

    def loss(q, k, v):
        out = attention(q, k, v, causal=True, segment_ids=segment_ids, backend=backend)
        return jnp.sum(jnp.tanh(out)), out

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    expected = jax.jit(fn)(q, k, v)
    f = sf.parallelize(fn, mesh=mesh, in_specs=spec, out_specs=((PS(), spec), (spec, spec, spec)))
    actual = f(q, k, v)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)
    plan = f.explain(q, k, v)
    assert not plan.fallbacks
    # q/k/v stay split: the only collective is the scalar loss
    assert all(c.shape == () for c in plan.collectives), str(plan)


def test_attention_inside_a_differentiated_scan():
    """Partial evaluation of a scanned, differentiated attention keeps one unit per direction."""
    mesh = sf.make_mesh({"data": 8})
    q, k, v = inputs(b=8)
    w = np.stack([np.eye(16, dtype=np.float32) * (1 + i / 10) for i in range(3)])

    def loss(w, q, k, v):
        def layer(x, wi):
            y = attention(x @ wi, k, v, causal=True, backend="xla")
            return x + y, None

        x, _ = jax.lax.scan(layer, q, w)
        return jnp.mean(x**2)

    fn = jax.grad(loss)
    f = sf.parallelize(fn, mesh=mesh, in_specs=(PS(), PS("data"), PS("data"), PS("data")), out_specs=PS())
    np.testing.assert_allclose(np.asarray(f(w, q, k, v)), jax.jit(fn)(w, q, k, v), rtol=1e-5, atol=1e-6)
    assert not f.explain(w, q, k, v).fallbacks


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("traced_offsets", [False, True])
def test_sequence_split_queries_gather_keys_and_shift_the_causal_mask(backend, traced_offsets):
    mesh = sf.make_mesh({"data": 2, "model": 4})
    q, k, v = inputs(b=2, s=32)
    offsets = (jnp.int32(5), jnp.int32(5)) if traced_offsets else (5, 5)

    def loss(q, k, v):
        out, lse = attention(
            q, k, v, causal=True, q_offset=offsets[0], kv_offset=offsets[1], return_lse=True, backend=backend
        )
        return jnp.sum(jnp.tanh(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.1), out

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    seq = PS("data", "model")
    f = sf.parallelize(
        lambda q, k, v: fn(sf.constrain(q, seq), k, v),
        mesh=mesh,
        in_specs=(seq, PS("data"), PS("data")),
        out_specs=((PS(), seq), (seq, PS("data"), PS("data"))),
    )
    expected = jax.jit(fn)(q, k, v)
    for a, e in zip(jax.tree.leaves(f(q, k, v)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)
    plan = f.explain(q, k, v)
    assert not plan.fallbacks
    assert not any(c.kind == "all_to_all" for c in plan.collectives), str(plan)
