"""shardflow.attention.attention: kernels in interpret mode and the XLA path against a dense fp32
reference (forward, lse, dq/dk/dv), fully masked rows, and the jaxpr contract with the
compiler passes. GPU-only checks skip without a GPU."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from fast_tier import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardflow.attention import attention

# Relative L2 error bounds against the fp32 reference.
TOLERANCE = {jnp.float32: 1e-3, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}


def reference_attention(q, k, v, *, causal, scale, segment_ids, q_offset, kv_offset):
    """Dense fp32 attention, returns (out, lse); fully masked rows give 0 and -inf."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    mask = jnp.ones(s.shape[-2:], bool)[None, None]
    if causal:
        q_pos = q_offset + jnp.arange(q.shape[1])
        kv_pos = kv_offset + jnp.arange(k.shape[1])
        mask = mask & (q_pos[:, None] >= kv_pos[None, :])[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")
    return out, lse


def rel_err(x, ref):
    """‖x - ref‖ / ‖ref‖, with ‖ref‖ floored at an RMS of 1e-3 per element: a reference that is
    exactly zero (dq with a single visible key) is met by rounding noise, not by zero."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(x)), "non-finite values"
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-3 * np.sqrt(ref.size))


def make_inputs(seed, batch, q_len, kv_len, heads_kv, group, head_dim, dtype, num_segments=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (batch, q_len, heads_kv * group, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, kv_len, heads_kv, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, kv_len, heads_kv, head_dim), jnp.float32)
    dout = jax.random.normal(keys[3], q.shape, jnp.float32)
    segment_ids = None
    if num_segments:
        # Sorted random segment ids: packed documents of random lengths.
        segment_ids = jnp.sort(jax.random.randint(keys[4], (batch, q_len), 0, num_segments), -1)
    cast = lambda x: x.astype(dtype)
    return cast(q), cast(k), cast(v), cast(dout), segment_ids


def check_against_reference(
    backend,
    *,
    seed=0,
    batch=1,
    q_len=33,
    kv_len=33,
    heads_kv=2,
    group=1,
    head_dim=32,
    dtype=jnp.float32,
    causal=False,
    num_segments=0,
    q_offset=0,
    kv_offset=0,
    check_grads=True,
):
    q, k, v, dout, segment_ids = make_inputs(seed, batch, q_len, kv_len, heads_kv, group, head_dim, dtype, num_segments)
    scale = 0.7 / np.sqrt(head_dim)
    kwargs = dict(causal=causal, scale=scale, segment_ids=segment_ids, q_offset=q_offset, kv_offset=kv_offset)

    def ours(q, k, v):
        return attention(q, k, v, return_lse=True, backend=backend, **kwargs)

    def ref(q, k, v):
        return reference_attention(q, k, v, **kwargs)

    (out, lse), vjp = jax.vjp(ours, q, k, v)
    f32 = functools.partial(jax.tree.map, lambda x: x.astype(jnp.float32))
    (out_ref, lse_ref), vjp_ref = jax.vjp(ref, *f32((q, k, v)))
    tol = TOLERANCE[dtype]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, q.shape[2], q_len) and lse.dtype == jnp.float32
    assert rel_err(out, out_ref) < tol
    finite = np.isfinite(np.asarray(lse_ref))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_ref)[finite], rtol=tol, atol=tol)
    if check_grads:
        # The lse cotangent is zero here; test_lse_gradient covers a non-zero one.
        grads = vjp((dout, jnp.zeros_like(lse)))
        grads_ref = vjp_ref((dout.astype(jnp.float32), jnp.zeros_like(lse_ref)))
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            assert g.dtype == dtype
            assert rel_err(g, g_ref) < tol, name


# "interpret": the GPU (Triton-lowering) kernels; "interpret_tpu": the Mosaic TPU kernels.
KERNEL_BACKENDS = ["interpret", "interpret_tpu", "xla"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [80, 256])  # 256: whole blocks, where nothing may be masked
def test_matches_reference(backend, dtype, causal, seq):
    check_against_reference(backend, dtype=dtype, causal=causal, q_len=seq, kv_len=seq, head_dim=64, group=2)


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    backend=st.sampled_from(KERNEL_BACKENDS),
    q_len=st.one_of(st.integers(1, 70), st.integers(120, 300)),  # one block / several
    kv_extra=st.integers(-20, 40),
    group=st.sampled_from([1, 2, 4, 8]),
    heads_kv=st.integers(1, 2),
    head_dim=st.sampled_from([16, 40, 64]),
    causal=st.booleans(),
    use_segments=st.booleans(),
    offsets=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(backend, q_len, kv_extra, group, heads_kv, head_dim, causal, use_segments, offsets, dtype, seed):
    kv_len = max(1, q_len + kv_extra)
    if use_segments:
        kv_len = q_len  # segment ids are shared by queries and keys
    check_against_reference(
        backend,
        seed=seed,
        q_len=q_len,
        kv_len=kv_len,
        heads_kv=heads_kv,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        causal=causal,
        num_segments=3 if use_segments else 0,
        q_offset=offsets[0],
        kv_offset=offsets[1],
    )


@settings(max_examples=examples(200), deadline=None)
@given(
    block_q=st.sampled_from([16, 32, 64]),
    block_k=st.sampled_from([16, 32, 64]),
    num_q_blocks=st.integers(1, 6),
    num_kv_blocks=st.integers(1, 6),
    kv_pad=st.integers(0, 15),
    offset_delta=st.integers(-200, 200),
    causal=st.booleans(),
)
def test_block_ranges_agree_with_the_element_mask(
    block_q, block_k, num_q_blocks, num_kv_blocks, kv_pad, offset_delta, causal
):
    """The skip/no-mask/mask classification of blocks that every kernel relies on."""
    from shardflow.kernels import attention_common as common

    kv_len = max(num_kv_blocks * block_k - kv_pad, 1)
    for qb in range(num_q_blocks):
        num_full, end = common.kv_block_range(
            qb * block_q,
            block_q=block_q,
            block_k=block_k,
            num_kv_blocks=num_kv_blocks,
            kv_len=kv_len,
            causal=causal,
            has_segment_ids=False,
            offset_delta=offset_delta,
        )
        for kb in range(num_kv_blocks):
            mask = np.asarray(
                common.element_mask(
                    jnp.arange(qb * block_q, (qb + 1) * block_q),
                    jnp.arange(kb * block_k, (kb + 1) * block_k),
                    causal=causal,
                    kv_len=kv_len,
                    offset_delta=offset_delta,
                )
            )
            if kb < num_full:
                assert mask.all()
            if kb >= end:
                assert not mask.any()
            begin_q, begin_full_q = common.q_block_range(
                kb * block_k,
                block_q=block_q,
                block_k=block_k,
                num_q_blocks=num_q_blocks,
                causal=causal,
                has_segment_ids=False,
                offset_delta=offset_delta,
            )
            # The dk/dv kernel ignores kv padding (those rows are sliced off), so compare causally.
            causal_mask = np.asarray(
                common.element_mask(
                    jnp.arange(qb * block_q, (qb + 1) * block_q),
                    jnp.arange(kb * block_k, (kb + 1) * block_k),
                    causal=causal,
                    kv_len=None,
                    offset_delta=offset_delta,
                )
            )
            causal_mask = np.ones((block_q, block_k), bool) if causal_mask.ndim == 0 else causal_mask
            if qb < begin_q:
                assert not causal_mask.any()
            if qb >= begin_full_q:
                assert causal_mask.all()


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_fully_masked_rows_are_zero_with_minus_inf_lse(backend):
    # Queries at positions 0..15 against keys at 20..51: causal hides every key from rows < 20.
    q, k, v, dout, _ = make_inputs(1, 1, 40, 32, 1, 2, 32, jnp.float32)

    def loss(q, k, v):
        out, lse = attention(q, k, v, causal=True, q_offset=0, kv_offset=20, return_lse=True, backend=backend)
        return jnp.sum(out * dout), (out, lse)

    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert np.all(np.asarray(out[:, :20]) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :20])))
    assert np.all(np.isfinite(np.asarray(lse[:, :, 20:])))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0][:, :20]) == 0.0)
    check_against_reference(backend, q_len=40, kv_len=32, group=2, causal=True, kv_offset=20)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_traced_offsets(backend):
    q, k, v, dout, _ = make_inputs(2, 1, 48, 48, 1, 1, 32, jnp.float32)

    @jax.jit
    def f(q, k, v, q_offset, kv_offset):
        return attention(q, k, v, causal=True, q_offset=q_offset, kv_offset=kv_offset, backend=backend)

    for q_offset, kv_offset in [(48, 0), (0, 10), (5, 30)]:
        ref, _ = reference_attention(
            q, k, v, causal=True, scale=32**-0.5, segment_ids=None, q_offset=q_offset, kv_offset=kv_offset
        )
        assert rel_err(f(q, k, v, q_offset, kv_offset), ref) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_lse_gradient(backend):
    # A loss that uses lse, as ring attention's combination of partial results does.
    q, k, v, dout, segment_ids = make_inputs(3, 2, 24, 24, 1, 2, 16, jnp.float32, 2)
    weights = jax.random.normal(jax.random.key(9), (2, 2, 24))

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * weights)

        return f

    kwargs = dict(causal=True, segment_ids=segment_ids, scale=0.25, q_offset=0, kv_offset=0)
    ours = loss(lambda q, k, v: attention(q, k, v, return_lse=True, backend=backend, **kwargs))
    ref = loss(lambda q, k, v: reference_attention(q, k, v, **kwargs))
    for g, g_ref in zip(jax.grad(ours, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v)):
        assert rel_err(g, g_ref) < 1e-3


@pytest.mark.slow
def test_fp16_interpret():
    check_against_reference(
        "interpret", dtype=jnp.float16, causal=True, q_len=40, kv_len=40, group=4, heads_kv=1, head_dim=64
    )


# ------------------------------------------------------------------------------------------
# The jaxpr contract with the compiler passes.


def _units(jaxpr, name):
    """All eqns of the primitive `name`, searching nested jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _units(sub.jaxpr, name)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _units(sub, name)
    return found


def _operand_shapes(eqn):
    return [tuple(var.aval.shape) for var in eqn.invars]


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("with_segments", [False, True])
@pytest.mark.parametrize("traced_offsets", [False, True])
def test_jaxpr_contract(backend, with_segments, traced_offsets):
    q, k, v, dout, segment_ids = make_inputs(4, 2, 16, 16, 2, 2, 16, jnp.float32, 2 if with_segments else 0)
    q_shape, kv_shape = q.shape, k.shape

    def f(q, k, v, q_offset, kv_offset):
        if not traced_offsets:
            q_offset, kv_offset = 3, 0
        return attention(
            q, k, v, causal=True, segment_ids=segment_ids, q_offset=q_offset, kv_offset=kv_offset, backend=backend
        )

    args = (q, k, v, jnp.int32(3), jnp.int32(0))
    extra_shapes = ([(2, 16)] if with_segments else []) + ([(), ()] if traced_offsets else [])

    fwd_jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    [fwd] = _units(fwd_jaxpr, "sf_attention_fwd")
    assert not _units(fwd_jaxpr, "sf_attention_bwd")
    assert _operand_shapes(fwd) == [q_shape, kv_shape, kv_shape] + extra_shapes
    assert [tuple(v.aval.shape) for v in fwd.outvars] == [q_shape, (2, 4, 16)]
    assert [v.aval.dtype for v in fwd.outvars] == [q.dtype, jnp.float32]

    loss = lambda *a: jnp.sum(f(*a) * dout)
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr
    [fwd] = _units(grad_jaxpr, "sf_attention_fwd")
    [bwd] = _units(grad_jaxpr, "sf_attention_bwd")
    assert _operand_shapes(fwd) == [q_shape, kv_shape, kv_shape] + extra_shapes
    assert _operand_shapes(bwd) == ([q_shape, kv_shape, kv_shape, q_shape, (2, 4, 16), q_shape] + extra_shapes)
    assert [tuple(v.aval.shape) for v in bwd.outvars] == [q_shape, kv_shape, kv_shape]
    # The kernels run inside the named calls: no pallas_call outside them.
    outside = [e for e in grad_jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert not outside


@pytest.mark.parametrize("q_len,kv_len", [(0, 8), (8, 0), (0, 0)])
def test_empty_sequences(q_len, kv_len):
    """No query, or no key to see: zeros and lse = -inf (a row that sees no key), zero grads."""
    q, k = jnp.ones((2, q_len, 4, 16)), jnp.ones((2, kv_len, 2, 16))
    f = lambda q, k, v: attention(q, k, v, causal=True, return_lse=True, backend="interpret")
    out, lse = f(q, k, k)
    assert out.shape == q.shape and not np.asarray(out).any()
    assert lse.shape == (2, 4, q_len) and np.all(np.isneginf(np.asarray(lse)))
    grads = jax.grad(lambda *a: jnp.sum(f(*a)[0]), argnums=(0, 1, 2))(q, k, k)
    assert all(g.shape == x.shape and not np.asarray(g).any() for g, x in zip(grads, (q, k, k)))


def test_rejects_bad_shapes():
    q = jnp.zeros((1, 8, 3, 16))
    k = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="heads_q=3"):
        attention(q, k, k, backend="xla")
    with pytest.raises(ValueError, match="segment_ids"):
        attention(
            q,
            jnp.zeros((1, 4, 3, 16)),
            jnp.zeros((1, 4, 3, 16)),
            segment_ids=jnp.zeros((1, 8), jnp.int32),
            backend="xla",
        )
    with pytest.raises(ValueError, match="backend"):
        attention(q, q, q, backend="flash")
    with pytest.raises(ValueError, match="segment_ids must be integers, got float32"):
        attention(
            q,
            jnp.zeros((1, 8, 3, 16)),
            jnp.zeros((1, 8, 3, 16)),
            segment_ids=jnp.zeros((1, 8), jnp.float32),
            backend="xla",
        )
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="backend='cudnn' needs an NVIDIA GPU"):
            attention(q, q, q, backend="cudnn")
    wide = jnp.zeros((1, 8, 1, 256), jnp.float32)  # fp32 rows of 1 KB: beyond the GPU tiles
    with pytest.raises(ValueError, match="head_dim up to 128"):
        attention(wide, wide, wide, backend="interpret")


# ------------------------------------------------------------------------------------------
# GPU only: the compiled kernels (benchmarks/attention.py --check covers more).

requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [300, 512])  # 300: the Triton kernels; 512: Mosaic on Hopper
@pytest.mark.parametrize("head_dim", [128, 48, 80, 96])  # 48, 80, 96: Mosaic zero-padded on Hopper
def test_gpu_kernels(causal, seq, head_dim):
    check_against_reference(
        "pallas",
        dtype=jnp.bfloat16,
        causal=causal,
        batch=2,
        q_len=seq,
        kv_len=seq,
        heads_kv=2,
        group=4,
        head_dim=head_dim,
    )


# The Mosaic kernels' masks beyond the plain causal one: a striped ring's later blocks attend with
# q_offset - kv_offset = -1 (every query sees the keys strictly before it, so the first sees none:
# output 0, lse -inf); packed documents give segment ids (every step masked).
MOSAIC_MASKS = {
    "shifted_diagonal": dict(causal=True, q_offset=0, kv_offset=1),
    "segment_ids": dict(causal=False, num_segments=5),
    "causal_segment_ids": dict(causal=True, num_segments=5),
}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("mask", list(MOSAIC_MASKS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_kernels_mosaic_masks(head_dim, mask):
    check_against_reference(
        "pallas",
        dtype=jnp.bfloat16,
        batch=2,
        q_len=512,
        kv_len=512,
        heads_kv=2,
        group=2,
        head_dim=head_dim,
        **MOSAIC_MASKS[mask],
    )


# What the Mosaic kernels are built for and dispatch does not yet send them
# (flash_attention_mgpu.GPU_TESTED_CAUSAL_SHIFTS): a shift whose diagonal crosses two K/V blocks
# per tile, queries at the end of longer keys, keys past the queries (the first 300 queries see
# none), and a ring's block: segment ids of queries and keys apart. (q_len, kv_len, shift, ids apart)
MOSAIC_UNDISPATCHED = {
    "diagonal_across_two_blocks": (512, 512, 70, False),
    "queries_at_the_keys_end": (512, 1024, 512, False),
    "keys_past_the_queries": (1024, 512, -300, False),
    "segment_ids_apart": (512, 1024, 384, True),
}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", list(MOSAIC_UNDISPATCHED))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_mosaic_kernels_beyond_what_dispatch_sends_them(head_dim, case):
    """The Mosaic kernels, called directly, equal the XLA attention (fp32) on the causal masks
    dispatch does not send them yet; once these pass on a GPU, GPU_TESTED_CAUSAL_SHIFTS and the
    ids-apart check in why_unsupported can go."""
    from shardflow.kernels import attention_xla
    from shardflow.kernels import flash_attention_mgpu as mgpu

    q_len, kv_len, shift, apart = MOSAIC_UNDISPATCHED[case]
    r = np.random.default_rng(head_dim)
    q, dout = (jnp.asarray(r.standard_normal((2, q_len, 4, head_dim)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(r.standard_normal((2, kv_len, 2, head_dim)), jnp.bfloat16) for _ in range(2))
    ids = tuple(jnp.asarray(np.sort(r.integers(0, 3, (2, n)), axis=1), jnp.int32) for n in (q_len, kv_len))
    ids = ids if apart else None
    kw = dict(causal=True, scale=head_dim**-0.5)
    out, lse = mgpu.forward(q, k, v, offset_delta=shift, segment_ids=ids, **kw)
    grads = mgpu.backward(q, k, v, out, lse, dout, offset_delta=shift, segment_ids=ids, **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    want_out, want_lse = attention_xla.forward(*f32[:3], ids, shift, **kw)
    want = attention_xla.backward(*f32[:3], ids, shift, want_out, want_lse, f32[3], **kw)
    assert rel_err(out, want_out) < 1e-2
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=1e-2, atol=1e-2)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert rel_err(g, w) < 1e-2, name


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("per_q_head", [False, True])
def test_gpu_kernels_on_slices_of_stacked_layers(per_q_head, monkeypatch):
    """q, k, v sliced from stacked arrays inside one jit, as a model's layers are: XLA fuses the
    slicing into the kernel call. Per q head the backward's dk, dv sums once shared a buffer there
    (dk, dv off by 56-179 % on an H100, jax 0.11.2) while the same call on fresh arrays was right."""
    from shardflow.kernels import flash_attention_mgpu as mgpu

    def forced(batch, kv_len, heads_q, heads_kv, head_dim, **kw):
        heads = heads_q if per_q_head else heads_kv
        return per_q_head, dict(
            grid=(heads, kv_len // (2 * mgpu.BWD_BLOCK_KV), batch), grid_names=("heads", "kv_seq", "batch")
        )

    monkeypatch.setattr(mgpu, "backward_grid", forced)
    r = np.random.default_rng(0)
    b, s, hq, hk, d = 4, 256, 4, 2, 64
    q, k, v = (jnp.asarray(r.standard_normal((2, b, s, h, d)), jnp.bfloat16) for h in (hq, hk, hk))
    w = jnp.cos(jnp.arange(b * s * hq * d, dtype=jnp.float32).reshape(b, s, hq, d))

    def grads(backend):
        def loss(q, k, v):
            return sum(
                jnp.sum(attention(q[i], k[i], v[i], causal=True, backend=backend).astype(jnp.float32) * w)
                for i in range(2)
            )

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for name, got, want in zip(("dq", "dk", "dv"), grads("pallas"), grads("xla")):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max(), name


# ------------------------------------------------------------------------------------------
# Mosaic GPU has no interpret mode; on CPU its kernels still trace and lower for CUDA, which
# checks shapes, register layouts, barrier and TMA arguments and the shared-memory budget (not
# values: benchmarks/attention.py --check runs them on the GPU).


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal,offset_delta", [(False, 0), (True, 0), (True, -1)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("batch,seq", [(2, 512), (2, 4352), (8, 4352)])  # GQA per q / kv head
@pytest.mark.parametrize("segments", [False, True])
def test_mosaic_gpu_kernels_lower_for_cuda(head_dim, causal, offset_delta, group, batch, seq, segments):
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    q = jax.ShapeDtypeStruct((batch, seq, 4 * group, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, 4, head_dim), jnp.bfloat16)
    segment_ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32) if segments else None
    assert_mosaic_kernels_lower(q, kv, segment_ids, causal=causal, offset_delta=offset_delta)


def assert_mosaic_kernels_lower(q, kv, segment_ids, **kw):
    """The Mosaic forward and backward at these shapes lower for CUDA."""
    from shardflow.kernels import flash_attention_mgpu

    kw = dict(scale=q.shape[-1] ** -0.5, **kw)
    lse = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    def forward(q, k, v, segment_ids):
        return flash_attention_mgpu.forward(q, k, v, segment_ids=segment_ids, **kw)

    def backward(q, k, v, out, lse, dout, segment_ids):
        return flash_attention_mgpu.backward(q, k, v, out, lse, dout, segment_ids=segment_ids, **kw)

    for fn, args in ((forward, (q, kv, kv, segment_ids)), (backward, (q, kv, kv, q, lse, q, segment_ids))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "q_len,kv_len,offset_delta,segments",
    [(512, 1024, 512, False), (512, 1024, 500, True), (1024, 512, -300, False), (512, 768, 7, True)],
)
def test_mosaic_gpu_kernels_lower_for_unequal_lengths_and_any_causal_shift(
    head_dim, q_len, kv_len, offset_delta, segments
):
    """Causal with q_len != kv_len and a shift whose diagonal crosses two K/V blocks per tile
    (the forward's masked steps in a loop, the backward's masked q blocks counted per CTA), with
    a pair of segment ids of different lengths."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    q = jax.ShapeDtypeStruct((2, q_len, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), jnp.bfloat16)
    ids = (jax.ShapeDtypeStruct((2, q_len), jnp.int32), jax.ShapeDtypeStruct((2, kv_len), jnp.int32))
    assert_mosaic_kernels_lower(q, kv, ids if segments else None, causal=True, offset_delta=offset_delta)


# (batch, seq, heads_q, heads_kv) -> per q head for (non-causal, causal) x (head_dim 64, 128).
BACKWARD_PER_Q_HEAD = {
    (4, 4096, 16, 16): {(False, 64): False, (False, 128): False, (True, 64): False, (True, 128): False},  # MHA: never
    (2, 4096, 32, 8): {
        (False, 64): False,
        (False, 128): False,
        (True, 64): False,
        (True, 128): True,
    },  # the anchor: L2 at head_dim 128 only (measured)
    (8, 4096, 32, 8): {(False, 64): False, (False, 128): False, (True, 64): False, (True, 128): True},
    (4, 4096, 16, 8): dict.fromkeys(
        [(False, 64), (False, 128), (True, 64), (True, 128)], False
    ),  # the 1b model: groups of 2 per kv head (measured)
    (4, 2048, 16, 2): dict.fromkeys(
        [(False, 64), (False, 128), (True, 64), (True, 128)], True
    ),  # 128 CTAs per kv head: SMs idle
    (1, 4096, 24, 6): dict.fromkeys([(False, 64), (False, 128), (True, 64), (True, 128)], True),  # 192 CTAs: 1.5 waves
    (1, 384, 6, 3): dict.fromkeys([(False, 64), (False, 128), (True, 64), (True, 128)], True),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", list(BACKWARD_PER_Q_HEAD))
def test_backward_grid(shape, head_dim, causal):
    """The Mosaic backward's grid: one CTA per (head, kv block, batch), a head being a q head for
    causal GQA of groups above 2 at head_dim 128 and wherever per kv head would leave SMs idle
    (< 2 CTAs per SM); causal per-kv-head GQA of groups above 2 launches its long CTAs first,
    everything else keeps a head together."""
    from shardflow.kernels.flash_attention_mgpu import BWD_BLOCK_KV, backward_grid

    batch, seq, heads_q, heads_kv = shape
    per_q_head, grid = backward_grid(batch, seq, heads_q, heads_kv, head_dim, causal=causal, sm_count=132)
    assert per_q_head == BACKWARD_PER_Q_HEAD[shape][causal, head_dim]
    sizes = dict(zip(grid["grid_names"], grid["grid"]))
    assert sizes == dict(heads=heads_q if per_q_head else heads_kv, kv_seq=seq // (2 * BWD_BLOCK_KV), batch=batch)
    long_first = causal and heads_q > 2 * heads_kv and not per_q_head
    assert grid["grid_names"][0] == ("kv_seq" if long_first else "heads")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "batch,heads,q_tiles,kv_blocks",
    [(4, 16, 32, 32), (1, 16, 128, 128), (8, 32, 16, 16), (3, 3, 3, 3), (1, 1, 5, 5), (2, 1, 1, 1), (1, 2, 40, 33)],
)
def test_forward_work_covers_every_tile_once(batch, heads, q_tiles, kv_blocks, causal):
    """The Mosaic forward's CTAs (at most one per SM) attend every (batch, head, q tile) exactly
    once, with its K/V block count; causal, they are balanced."""
    from shardflow.kernels.flash_attention_mgpu import ForwardWork

    work = ForwardWork.plan(batch, heads, q_tiles, kv_blocks, causal, sm_count=132)
    ctas = jnp.arange(work.num_ctas, dtype=jnp.int32)
    counts = np.asarray(work.tiles_of(ctas))
    cta, i = np.nonzero(np.arange(counts.max())[None, :] < counts[:, None])
    b, h, t, unmasked, steps = (
        np.broadcast_to(np.asarray(x), cta.shape)
        for x in work.tile(jnp.asarray(cta, jnp.int32), jnp.asarray(i, jnp.int32))
    )
    assert sorted(zip(b, h, t)) == [(x, y, z) for x in range(batch) for y in range(heads) for z in range(q_tiles)]
    np.testing.assert_array_equal(steps, np.minimum(t + 1, kv_blocks) if causal else kv_blocks)
    np.testing.assert_array_equal(unmasked, np.minimum(t, kv_blocks) if causal else kv_blocks)
    assert work.num_ctas == min(132, len(t) // work.tiles_per_unit)
    if causal and len(t) % 2 == 0:  # pairs of q_tiles + 1 steps
        load = np.bincount(cta, weights=steps)
        assert load.max() - load.min() <= q_tiles + 1


def visibility(q_len, kv_len, offset_delta):
    """[q_len, kv_len] causal visibility: query i sees key j where j <= i + offset_delta."""
    return np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + offset_delta


@pytest.mark.parametrize("offset_delta", [0, -1, 1, 7, 64, 127, 128, 200, -64, -127, -128, -129, -300, 1000, -1000])
@pytest.mark.parametrize("q_tiles,kv_blocks", [(4, 4), (2, 6), (6, 2)])
def test_causal_forward_tiles_attend_the_keys_they_see(offset_delta, q_tiles, kv_blocks):
    """A causal forward tile attends K/V blocks [0, blocks): every block it sees a key of, the
    first `unmasked` of them seen whole by every query (those run without the mask), the others
    seen in part; one block at least, masked whole where the tile sees no key."""
    from shardflow.kernels.flash_attention_mgpu import BLOCK_KV, BLOCK_Q, ForwardWork

    rows = 2 * BLOCK_Q
    work = ForwardWork.plan(1, 1, q_tiles, kv_blocks, True, sm_count=1, offset_delta=offset_delta)
    seen = visibility(q_tiles * rows, kv_blocks * BLOCK_KV, offset_delta)
    seen = seen.reshape(q_tiles, rows, kv_blocks, BLOCK_KV)
    for i in range(q_tiles):
        _, _, t, unmasked, blocks = (int(x) for x in work.tile(jnp.int32(0), jnp.int32(i)))
        any_key, every_key = seen[t].any(axis=(0, 2)), seen[t].all(axis=(0, 2))
        assert blocks == max(1, np.flatnonzero(any_key).max(initial=-1) + 1), (t, blocks)
        assert unmasked == np.flatnonzero(~every_key).min(initial=kv_blocks), (t, unmasked)


@pytest.mark.parametrize("offset_delta", [0, -1, 1, 63, 64, 65, 127, 128, 129, -64, -65, -128, -129, 700, -700])
@pytest.mark.parametrize("bq", [64, 128])
@pytest.mark.parametrize("q_len,kv_len", [(512, 512), (256, 768), (768, 256)])
def test_causal_backward_ctas_step_over_the_queries_that_see_their_keys(offset_delta, bq, q_len, kv_len):
    """A causal backward CTA (2 * BWD_BLOCK_KV keys) steps over q blocks [first, num_q_blocks):
    every block with a query that sees one of its keys, masked up to the first block whose
    queries all see all of them."""
    from shardflow.kernels.attention_common import q_block_range
    from shardflow.kernels.flash_attention_mgpu import BWD_BLOCK_KV

    keys = 2 * BWD_BLOCK_KV
    seen = visibility(q_len, kv_len, offset_delta).reshape(q_len // bq, bq, kv_len // keys, keys)
    kw = dict(block_q=bq, block_k=keys, num_q_blocks=q_len // bq, causal=True, has_segment_ids=False)
    for c in range(kv_len // keys):
        first, unmasked_from = (int(x) for x in q_block_range(jnp.int32(c * keys), offset_delta=offset_delta, **kw))
        any_query, every_query = seen[:, :, c].any(axis=(1, 2)), seen[:, :, c].all(axis=(1, 2))
        assert first == np.flatnonzero(any_query).min(initial=q_len // bq), (c, first)
        assert not any_query[:first].any() and every_query[unmasked_from:].all()
        assert unmasked_from == first + np.flatnonzero(~every_query[first:]).max(initial=-1) + 1, (c, unmasked_from)


@pytest.mark.parametrize("causal,segments", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("head_dim,group,seq", [(128, 1, 512), (64, 4, 300)])
def test_tpu_kernels_lower_for_tpu(monkeypatch, causal, segments, head_dim, group, seq):
    """No TPU here: lowering for one (a v5e's sizes) still runs Pallas' Mosaic TPU checks —
    block shapes, layouts, memory spaces — that interpret mode skips."""
    from shardflow._compat import tpu_info as _tpu_info

    tpu_info = _tpu_info()
    from shardflow.kernels import flash_attention_tpu as tpu

    monkeypatch.setitem(
        tpu_info.registry,
        jax.devices()[0].device_kind,
        lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1),
    )
    q = jax.ShapeDtypeStruct((2, seq, 2 * group, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, seq, 2, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((2, 2 * group, seq), jnp.float32)
    segment_ids = jax.ShapeDtypeStruct((2, seq), jnp.int32) if segments else None
    kw = dict(causal=causal, scale=head_dim**-0.5)
    fwd = lambda q, k, v, s: tpu.forward(q, k, v, s, 0, **kw)
    bwd = lambda q, k, v, s, o, l, do: tpu.backward(q, k, v, s, 0, o, l, do, **kw)
    for fn, args in ((fwd, (q, kv, kv, segment_ids)), (bwd, (q, kv, kv, segment_ids, q, lse, q))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text


@pytest.mark.parametrize("head_dim, wide", [(80, 128), (96, 128), (48, 64), (32, 64), (16, 64)])
def test_a_head_dim_below_128_runs_the_mosaic_kernels_zero_padded(head_dim, wide, monkeypatch):
    """On Hopper a head of 80, 96, 48, 32 or 16 goes to the Mosaic kernels padded to 128 or 64
    with zeros, the padding sliced off: forward and gradients equal the unpadded reference. On
    CPU the reference stands in for the kernels, which see the padding."""
    from shardflow.kernels import attention_xla, flash_attention_gpu
    from shardflow.kernels import flash_attention_mgpu as mgpu

    seen = []

    def forward(q, k, v, *, causal, scale, offset_delta=0, segment_ids=None):
        seen.append(q.shape[-1])
        return attention_xla.forward(q, k, v, segment_ids, offset_delta, causal=causal, scale=scale)

    def backward(q, k, v, out, lse, dout, *, causal, scale, dlse=None, offset_delta=0, segment_ids=None):
        seen.append(q.shape[-1])
        return attention_xla.backward(
            q, k, v, segment_ids, offset_delta, out, lse, dout, causal=causal, scale=scale, dlse=dlse
        )

    monkeypatch.setattr(mgpu, "on_hopper", lambda: True)
    monkeypatch.setattr(mgpu, "forward", forward)
    monkeypatch.setattr(mgpu, "backward", backward)
    r = np.random.default_rng(head_dim)
    q, k, v, dout = (jnp.asarray(r.standard_normal((1, 256, 2, head_dim)), jnp.bfloat16) for _ in range(4))
    kw = dict(causal=True, scale=head_dim**-0.5)
    out, lse = flash_attention_gpu.forward(q, k, v, None, 0, **kw)
    grads = flash_attention_gpu.backward(q, k, v, None, 0, out, lse, dout, **kw)
    want_out, want_lse = attention_xla.forward(q, k, v, None, 0, **kw)
    want = attention_xla.backward(q, k, v, None, 0, want_out, want_lse, dout, **kw)
    assert seen == [wide, wide]
    for a, b in zip((out, lse, *grads), (want_out, want_lse, *want)):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)


def test_a_gpu_other_than_hopper_runs_the_xla_attention_and_says_so(monkeypatch):
    """backend='auto' on a GPU without the Mosaic kernels (pre-Hopper, or newer) runs the XLA
    blockwise attention, never the deprecated Triton kernels, and warns once per device kind;
    backend='pallas' still asks for the Pallas GPU kernels."""
    import warnings

    from shardflow import attention_primitives as ap

    class Ampere:
        device_kind = "NVIDIA A100-SXM4-80GB"

    monkeypatch.setattr(ap.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(ap.jax, "devices", lambda *a: [Ampere()])
    monkeypatch.setattr(ap, "on_hopper", lambda: False)
    ap._warn_off_hopper.cache_clear()
    with pytest.warns(UserWarning, match="A100-SXM4-80GB is not one: backend='auto' runs the XLA"):
        assert ap.implementation_of("auto") == "xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ap.implementation_of("auto") == "xla"  # once
    assert ap.implementation_of("pallas") == "pallas_gpu"
    monkeypatch.setattr(ap, "on_hopper", lambda: True)
    assert ap.implementation_of("auto") == "mosaic_gpu"
    ap._warn_off_hopper.cache_clear()


@pytest.mark.parametrize(
    "case",
    [
        dict(dtype=jnp.float32, reason="float32"),
        dict(head_dim=256, reason="head_dim 256"),
        dict(q_len=300, kv_len=300, reason="q_len 300"),
        dict(q_offset=jnp.int32(3), reason="a traced causal offset"),
    ],
    ids=["fp32", "head256", "seq300", "traced_offset"],
)
def test_hopper_runs_what_the_mosaic_kernels_do_not_take_in_xla_and_says_why(case, monkeypatch):
    """backend='auto' on Hopper: the Mosaic kernels where they apply, else the XLA blockwise
    attention (never the deprecated Triton kernels), with one warning naming what they do not
    take; forward and gradients equal the reference. On CPU the XLA path is what runs."""
    import importlib

    from shardflow import attention_primitives as ap
    from shardflow.kernels import attention_xla
    from shardflow.kernels import flash_attention_mgpu as mgpu

    attention_module = importlib.import_module("shardflow.attention")
    case = dict(case)
    reason = case.pop("reason")
    monkeypatch.setattr(mgpu, "on_hopper", lambda: True)

    def no_mosaic(*args, **kwargs):
        raise AssertionError("the Mosaic kernel ran")

    monkeypatch.setattr(mgpu, "forward", no_mosaic)
    monkeypatch.setattr(mgpu, "backward", no_mosaic)
    ran_xla, xla_forward = [], attention_xla.forward
    monkeypatch.setattr(attention_xla, "forward", lambda *a, **kw: ran_xla.append(1) or xla_forward(*a, **kw))
    monkeypatch.setattr(attention_module, "implementation_of", lambda backend: "mosaic_gpu")
    ap._warn_off_mosaic.cache_clear()
    dtype, head_dim = case.pop("dtype", jnp.bfloat16), case.pop("head_dim", 64)
    q_len, kv_len = case.pop("q_len", 256), case.pop("kv_len", 256)
    q, k, v, dout, _ = make_inputs(0, 1, q_len, kv_len, 2, 2, head_dim, dtype, 0)
    config = dict(causal=True, scale=head_dim**-0.5, **case)
    with pytest.warns(UserWarning, match=f"attention: {reason}.*backend='auto' runs the XLA blockwise"):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **config), q, k, v)
        grads = vjp(dout)
    reference = functools.partial(reference_attention, segment_ids=None, kv_offset=0, **{"q_offset": 0, **config})
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    want, want_vjp = jax.vjp(lambda q, k, v: reference(q, k, v)[0], *f32[:3])
    tol = TOLERANCE[dtype]
    assert ran_xla and rel_err(out, want) < tol
    for g, w in zip(grads, want_vjp(f32[3])):
        assert rel_err(g, w) < tol
    ap._warn_off_mosaic.cache_clear()


@pytest.mark.gpu
@requires_gpu
def test_no_attention_call_of_the_models_reaches_triton_on_hopper():
    """backend='auto' on Hopper never runs the Triton kernels, forward or backward: jax's
    deprecation of the Pallas Triton lowering never fires. The models' attention (bf16, causal,
    head dims 64, 80 and 128, GQA), a striped ring's shifted diagonal and packed documents run the
    Mosaic kernels; keys longer than the queries, float32, a head of 256, a sequence of 300 and a
    traced offset the XLA attention."""
    import warnings

    from shardflow.kernels import on_hopper

    if not on_hopper():
        pytest.skip("not a Hopper GPU")
    r = np.random.default_rng(0)
    ids = jnp.asarray(np.repeat(np.arange(4), 128)[None], jnp.int32)
    cases = [
        (64, jnp.bfloat16, 512, 512, {}),
        (64, jnp.bfloat16, 512, 512, dict(segment_ids=ids)),
        (80, jnp.bfloat16, 512, 512, {}),
        (128, jnp.bfloat16, 512, 512, {}),
        (128, jnp.bfloat16, 512, 512, dict(segment_ids=ids)),
        (128, jnp.bfloat16, 512, 512, dict(q_offset=0, kv_offset=1)),
        (128, jnp.bfloat16, 256, 512, dict(q_offset=256, kv_offset=0)),
        (64, jnp.float32, 512, 512, {}),
        (256, jnp.bfloat16, 512, 512, {}),
        (64, jnp.bfloat16, 300, 300, {}),
        (64, jnp.bfloat16, 512, 512, dict(q_offset=jnp.int32(3), kv_offset=jnp.int32(0))),
    ]
    for head_dim, dtype, q_len, kv_len, extra in cases:
        q = jnp.asarray(r.standard_normal((1, q_len, 4, head_dim)), dtype)
        k = jnp.asarray(r.standard_normal((1, kv_len, 2, head_dim)), dtype)

        def loss(q, k, v):
            out = attention(q, k, v, causal=True, **extra)
            return jnp.sum(out.astype(jnp.float32))

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, k))
        # jax's deprecation; shardflow's own warnings ("attention: ...") name Triton as an option
        messages = [str(w.message) for w in caught]
        triton = [m for m in messages if "triton" in m.lower() and not m.startswith("attention: ")]
        assert not triton, (head_dim, dtype, q_len, kv_len, list(extra), triton)


def test_mosaic_gpu_dispatch_takes_only_what_the_kernels_handle(monkeypatch):
    """Everything the Mosaic kernels were not built for must go elsewhere: a wrong predicate
    would give wrong masks, not an error."""
    from shardflow.kernels import flash_attention_mgpu as mgpu

    bf16 = lambda b, s, h, d, dtype=jnp.bfloat16: jax.ShapeDtypeStruct((b, s, h, d), dtype)

    def takes(q, k, segment_ids=None, offset_delta=0, causal=True, scale=0.1):
        args = (q, k, segment_ids, offset_delta)
        fwd = mgpu.supports(*args, causal=causal, scale=scale)
        bwd = mgpu.supports_backward(*args, causal=causal, scale=scale)
        assert bwd <= fwd
        return fwd, bwd

    assert takes(bf16(2, 512, 8, 128), bf16(2, 512, 2, 128)) == (False, False)  # not on Hopper
    monkeypatch.setattr(mgpu, "on_hopper", lambda: True)
    q, k = bf16(2, 512, 8, 128), bf16(2, 512, 2, 128)
    assert takes(q, k) == (True, True)
    assert takes(bf16(1, 1024, 4, 64, jnp.float16), bf16(1, 1024, 4, 64, jnp.float16), causal=False) == (True, True)
    assert takes(q, bf16(2, 1024, 2, 128), causal=False) == (True, True)  # cross attention
    assert takes(q, k, offset_delta=-1) == (True, True)  # the diagonal hidden: a striped ring's later blocks
    assert takes(q, k, segment_ids=jnp.zeros((2, 512), jnp.int32)) == (True, True)  # packed documents
    ids = (jnp.zeros((2, 512), jnp.int32), jnp.zeros((2, 1024), jnp.int32))
    rejected = [
        dict(q=bf16(2, 512, 8, 128, jnp.float32), k=bf16(2, 512, 2, 128, jnp.float32)),
        dict(q=bf16(2, 512, 8, 96), k=bf16(2, 512, 2, 96)),  # head_dim
        dict(k=bf16(2, 1024, 2, 128), causal=False, segment_ids=jnp.zeros((2, 512), jnp.int32)),  # Sq != Skv
        # Built and lowered, not yet run on a GPU: other shifts, unequal lengths, ids apart
        dict(offset_delta=7),
        dict(offset_delta=-300),
        dict(k=bf16(2, 1024, 2, 128), offset_delta=512),
        dict(k=bf16(2, 1024, 2, 128), segment_ids=ids),
        dict(offset_delta=True),
        dict(offset_delta=jnp.int32(0)),  # traced offset
        dict(q=bf16(2, 300, 8, 128), k=bf16(2, 300, 2, 128)),  # not x128
        dict(q=bf16(2, 128, 8, 128), k=bf16(2, 128, 2, 128)),  # < 2 kv blocks
        dict(scale=-1.0),
    ]
    for change in rejected:
        case = {"q": q, "k": k, **change}
        assert takes(case.pop("q"), case.pop("k"), **case) == (False, False), change
