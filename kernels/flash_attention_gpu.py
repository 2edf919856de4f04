"""Flash attention forward and backward for GPUs, in Pallas with the Triton lowering.

Three kernels, each a grid of independent programs over (block, batch, head):

* forward, grid (q blocks, batch, heads_q): one q block against its visible kv blocks with an
  online softmax (base-2 exponentials, scale folded into log2(e)); writes out and lse.
* dq, grid (q blocks, batch, heads_q): recomputes p from lse, accumulates dq.
* dk/dv, grid (kv blocks, batch, heads_kv): loops over the q heads of the kv head's group and
  their visible q blocks, accumulating dk and dv in registers. GQA therefore never repeats K/V
  and never writes per-q-head dk/dv; each output block is written once, without atomics.

The dk/dv kernel works in transposed form (s^T = k q^T) so that no register tile needs a
transpose. Each kernel runs the kv (or q) blocks that are visible in full without any mask and
only the boundary blocks with the element mask; fully masked blocks are skipped
(attention_common gives the ranges). Sequences are padded to the block sizes and head_dim to a
power of two (zeros change neither q.k nor the output's real columns); the padding is sliced off.
On Hopper, `forward` and `backward` hand what flash_attention_mgpu takes to its Mosaic GPU
(FlashAttention-3-style) kernels, a head_dim below 128 zero-padded to 64 or 128. jax deprecates
the Triton lowering: backend="auto" runs these kernels nowhere (`shardflow.attention_primitives`),
backend="pallas" still does.
Conventions: see attention_common.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import attention_common as common
from . import flash_attention_mgpu
from .attention_common import LN_2, LOG2_E


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tile sizes and Triton launch parameters of the three kernels."""

    fwd_block_q: int
    fwd_block_k: int
    fwd_num_warps: int
    fwd_num_stages: int
    dq_block_q: int
    dq_block_k: int
    dq_num_warps: int
    dq_num_stages: int
    dkv_block_q: int
    dkv_block_k: int
    dkv_num_warps: int
    dkv_num_stages: int


# Shared memory per block is ~227 KB on Hopper; the default tiles assume rows of at most
# 256 bytes (bf16/fp16 with head_dim <= 128), the small ones rows of at most 512 bytes.
_MAX_ROW_BYTES = 512


def default_block_sizes(head_dim: int, causal: bool, dtype=jnp.bfloat16) -> GpuBlockSizes:
    """Best of the sweep in benchmarks/attention.py on an H200 (results/attention.md)."""
    row_bytes = _pow2_at_least(head_dim) * jnp.dtype(dtype).itemsize
    if row_bytes > 256:  # fp32 with head_dim 128, bf16 with head_dim 256
        return GpuBlockSizes(
            fwd_block_q=64,
            fwd_block_k=32,
            fwd_num_warps=4,
            fwd_num_stages=2,
            dq_block_q=64,
            dq_block_k=32,
            dq_num_warps=4,
            dq_num_stages=2,
            dkv_block_q=32,
            dkv_block_k=64,
            dkv_num_warps=4,
            dkv_num_stages=2,
        )
    if head_dim <= 64:
        return GpuBlockSizes(
            fwd_block_q=128 if causal else 64,
            fwd_block_k=64,
            fwd_num_warps=4,
            fwd_num_stages=3,
            dq_block_q=64,
            dq_block_k=64,
            dq_num_warps=4,
            dq_num_stages=3,
            dkv_block_q=64,
            dkv_block_k=64,
            dkv_num_warps=4,
            dkv_num_stages=3,
        )
    return GpuBlockSizes(
        fwd_block_q=128,
        fwd_block_k=128 if causal else 64,
        fwd_num_warps=8,
        fwd_num_stages=3,
        dq_block_q=128,
        dq_block_k=64,
        dq_num_warps=8,
        dq_num_stages=3,
        dkv_block_q=64,
        dkv_block_k=128,
        dkv_num_warps=8,
        dkv_num_stages=3,
    )


def supports_head_dim(head_dim: int, dtype) -> bool:
    return _pow2_at_least(head_dim) * jnp.dtype(dtype).itemsize <= _MAX_ROW_BYTES


def _check_head_dim(q):
    if not supports_head_dim(q.shape[-1], q.dtype):
        raise ValueError(
            f"attention: the GPU kernel takes head_dim up to {_MAX_ROW_BYTES // q.dtype.itemsize} "
            f"for {q.dtype} (q shape {q.shape}); use backend='xla' for larger heads"
        )


def _dot(a, b, *, transpose_b=False, precision):
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Sizes of one call before and after padding to the tiles."""

    q_len: int
    kv_len: int
    q_len_padded: int
    kv_len_padded: int
    head_dim: int
    head_dim_padded: int
    group: int

    @classmethod
    def of(cls, q, k, multiple_q: int, multiple_k: int):
        head_dim = q.shape[-1]
        return cls(
            q_len=q.shape[1],
            kv_len=k.shape[1],
            q_len_padded=common.round_up(q.shape[1], multiple_q),
            kv_len_padded=common.round_up(k.shape[1], multiple_k),
            head_dim=head_dim,
            head_dim_padded=max(_pow2_at_least(head_dim), 16),
            group=q.shape[2] // k.shape[2],
        )


def _pad(x, seq_len, head_dim):
    return jnp.pad(x, ((0, 0), (0, seq_len - x.shape[1]), (0, 0), (0, head_dim - x.shape[3])))


def _pad_segments(segment_ids, geo):
    """(q ids, kv ids) padded to the tiles, with ids that match nothing."""
    q_ids, kv_ids = common.segment_pair(segment_ids)
    return (
        jnp.pad(q_ids, ((0, 0), (0, geo.q_len_padded - q_ids.shape[1])), constant_values=-1),
        jnp.pad(kv_ids, ((0, 0), (0, geo.kv_len_padded - kv_ids.shape[1])), constant_values=-2),
    )


# --------------------------------------------------------------------------------------------
# Forward


def _forward_kernel(
    offset_ref, q_ref, k_ref, v_ref, *refs, causal, has_segment_ids, scale, block_q, block_k, kv_len, precision
):
    if has_segment_ids:
        q_segment_ref, kv_segment_ref, out_ref, lse_ref = refs
    else:
        out_ref, lse_ref = refs
    offset_delta = offset_ref[0]
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]
    num_kv_blocks = k_ref.shape[0] // block_k
    num_full, end = common.kv_block_range(
        q_start,
        block_q=block_q,
        block_k=block_k,
        num_kv_blocks=num_kv_blocks,
        kv_len=kv_len,
        causal=causal,
        has_segment_ids=has_segment_ids,
        offset_delta=offset_delta,
    )
    q_segments = q_segment_ref[...] if has_segment_ids else None
    logit_scale = scale * LOG2_E

    def body(kv_block, carry, *, masked):
        acc, row_max, row_sum = carry
        kv_slice = pl.ds(kv_block * block_k, block_k)
        k = k_ref[kv_slice, :]
        s = _dot(q, k, transpose_b=True, precision=precision) * logit_scale
        if masked:
            mask = common.element_mask(
                q_start + jnp.arange(block_q),
                kv_block * block_k + jnp.arange(block_k),
                causal=causal,
                kv_len=kv_len if kv_len % block_k else None,
                offset_delta=offset_delta,
                q_segment_ids=q_segments,
                kv_segment_ids=kv_segment_ref[kv_slice] if has_segment_ids else None,
            )
            s = jnp.where(mask, s, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
        if masked:  # a row may have seen no key yet
            new_max_safe = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        else:
            new_max_safe = new_max
        correction = jnp.exp2(row_max - new_max_safe)
        p = jnp.exp2(s - new_max_safe[:, None])
        row_sum = row_sum * correction + jnp.sum(p, axis=1)
        v = v_ref[kv_slice, :]
        acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v, precision=precision)
        return acc, new_max, row_sum

    carry = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = lax.fori_loop(0, num_full, functools.partial(body, masked=False), carry)
    if not (isinstance(num_full, int) and num_full == end):
        carry = lax.fori_loop(num_full, end, functools.partial(body, masked=True), carry)
    acc, row_max, row_sum = carry
    empty = row_sum == 0.0
    safe_sum = jnp.where(empty, 1.0, row_sum)
    out_ref[...] = (acc / safe_sum[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (row_max + jnp.log2(safe_sum)) * LN_2)


def forward(
    q,
    k,
    v,
    segment_ids,
    offset_delta,
    *,
    causal: bool,
    scale: float,
    block_sizes: GpuBlockSizes | None = None,
    interpret: bool = False,
    allow_mosaic: bool = True,
):
    """Returns (out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] float32).

    On Hopper, the shapes flash_attention_mgpu supports go to that (faster) kernel unless
    allow_mosaic is False or a block_sizes override is given.
    """
    if allow_mosaic and not interpret and block_sizes is None:
        mosaic = flash_attention_mgpu.attend(q, k, v, segment_ids, offset_delta, causal=causal, scale=scale)
        if mosaic is not None:
            return mosaic
    _check_head_dim(q)
    batch, q_len, heads_q, head_dim = q.shape
    bs = block_sizes or default_block_sizes(head_dim, causal, q.dtype)
    block_q, block_k = bs.fwd_block_q, bs.fwd_block_k
    geo = _Geometry.of(q, k, block_q, block_k)
    qp = _pad(q, geo.q_len_padded, geo.head_dim_padded)
    kp = _pad(k, geo.kv_len_padded, geo.head_dim_padded)
    vp = _pad(v, geo.kv_len_padded, geo.head_dim_padded)
    group, dim = geo.group, geo.head_dim_padded

    grid = (geo.q_len_padded // block_q, batch, heads_q)
    in_specs = [
        pl.BlockSpec((1,), lambda i, b, h: (0,)),
        pl.BlockSpec((None, block_q, None, dim), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, geo.kv_len_padded, None, dim), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, geo.kv_len_padded, None, dim), lambda i, b, h: (b, 0, h // group, 0)),
    ]
    operands = [jnp.asarray(offset_delta, jnp.int32).reshape(1), qp, kp, vp]
    if segment_ids is not None:
        in_specs += [
            pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, geo.kv_len_padded), lambda i, b, h: (b, 0)),
        ]
        operands += list(_pad_segments(segment_ids, geo))
    kernel = functools.partial(
        _forward_kernel,
        causal=causal,
        has_segment_ids=segment_ids is not None,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        kv_len=geo.kv_len,
        precision=_precision(q.dtype),
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, block_q, None, dim), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(qp.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads_q, geo.q_len_padded), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=bs.fwd_num_warps, num_stages=bs.fwd_num_stages),
        interpret=interpret,
        name="sf_flash_attention_fwd",
    )(*operands)
    return out[:, :q_len, :, :head_dim], lse[:, :, :q_len]


# --------------------------------------------------------------------------------------------
# Backward


def _dq_kernel(
    offset_ref,
    q_ref,
    k_ref,
    v_ref,
    dout_ref,
    lse_ref,
    delta_ref,
    *refs,
    causal,
    has_segment_ids,
    scale,
    block_q,
    block_k,
    kv_len,
    precision,
):
    if has_segment_ids:
        q_segment_ref, kv_segment_ref, dq_ref = refs
    else:
        (dq_ref,) = refs
    offset_delta = offset_ref[0]
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]
    dout = dout_ref[...]
    lse2 = lse_ref[...] * LOG2_E
    delta = delta_ref[...]
    num_full, end = common.kv_block_range(
        q_start,
        block_q=block_q,
        block_k=block_k,
        num_kv_blocks=k_ref.shape[0] // block_k,
        kv_len=kv_len,
        causal=causal,
        has_segment_ids=has_segment_ids,
        offset_delta=offset_delta,
    )
    q_segments = q_segment_ref[...] if has_segment_ids else None
    logit_scale = scale * LOG2_E

    def body(kv_block, dq, *, masked):
        kv_slice = pl.ds(kv_block * block_k, block_k)
        k = k_ref[kv_slice, :]
        v = v_ref[kv_slice, :]
        s = _dot(q, k, transpose_b=True, precision=precision) * logit_scale
        p = jnp.exp2(s - lse2[:, None])
        if masked:
            mask = common.element_mask(
                q_start + jnp.arange(block_q),
                kv_block * block_k + jnp.arange(block_k),
                causal=causal,
                kv_len=kv_len if kv_len % block_k else None,
                offset_delta=offset_delta,
                q_segment_ids=q_segments,
                kv_segment_ids=kv_segment_ref[kv_slice] if has_segment_ids else None,
            )
            p = jnp.where(mask, p, 0.0)
        dp = _dot(dout, v, transpose_b=True, precision=precision)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, precision=precision)

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = lax.fori_loop(0, num_full, functools.partial(body, masked=False), dq)
    if not (isinstance(num_full, int) and num_full == end):
        dq = lax.fori_loop(num_full, end, functools.partial(body, masked=True), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    offset_ref,
    q_ref,
    k_ref,
    v_ref,
    dout_ref,
    lse_ref,
    delta_ref,
    *refs,
    causal,
    has_segment_ids,
    scale,
    block_q,
    block_k,
    group,
    precision,
):
    if has_segment_ids:
        q_segment_ref, kv_segment_ref, dk_ref, dv_ref = refs
    else:
        dk_ref, dv_ref = refs
    offset_delta = offset_ref[0]
    kv_start = pl.program_id(0) * block_k
    kv_head = pl.program_id(2)
    k = k_ref[...]
    v = v_ref[...]
    num_q_blocks = q_ref.shape[0] // block_q
    begin, begin_full = common.q_block_range(
        kv_start,
        block_q=block_q,
        block_k=block_k,
        num_q_blocks=num_q_blocks,
        causal=causal,
        has_segment_ids=has_segment_ids,
        offset_delta=offset_delta,
    )
    kv_segments = kv_segment_ref[...] if has_segment_ids else None
    logit_scale = scale * LOG2_E

    def q_head_body(member, carry):
        head = kv_head * group + member

        def body(q_block, carry, *, masked):
            dk, dv = carry
            q_slice = pl.ds(q_block * block_q, block_q)
            q = q_ref[q_slice, head, :]
            dout = dout_ref[q_slice, head, :]
            lse2 = lse_ref[head, q_slice] * LOG2_E
            delta = delta_ref[head, q_slice]
            s_t = _dot(k, q, transpose_b=True, precision=precision) * logit_scale  # [bk, bq]
            p_t = jnp.exp2(s_t - lse2[None, :])
            if masked:  # the element mask, transposed: [kv, q]
                mask_t = None
                if causal:
                    q_index = q_block * block_q + jnp.arange(block_q)
                    kv_index = kv_start + jnp.arange(block_k)
                    mask_t = q_index[None, :] + offset_delta >= kv_index[:, None]
                if has_segment_ids:
                    same = kv_segments[:, None] == q_segment_ref[q_slice][None, :]
                    mask_t = same if mask_t is None else jnp.logical_and(mask_t, same)
                p_t = jnp.where(mask_t, p_t, 0.0)
            dv = dv + _dot(p_t.astype(dout.dtype), dout, precision=precision)
            dp_t = _dot(v, dout, transpose_b=True, precision=precision)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = dk + _dot(ds_t.astype(q.dtype), q, precision=precision)
            return dk, dv

        if causal or has_segment_ids:
            carry = lax.fori_loop(begin, begin_full, functools.partial(body, masked=True), carry)
        return lax.fori_loop(begin_full, num_q_blocks, functools.partial(body, masked=False), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, q_head_body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(
    q,
    k,
    v,
    segment_ids,
    offset_delta,
    out,
    lse,
    dout,
    *,
    causal: bool,
    scale: float,
    block_sizes: GpuBlockSizes | None = None,
    interpret: bool = False,
    dlse=None,
    allow_mosaic: bool = True,
):
    """Returns (dq, dk, dv) in the dtypes of q, k, v.

    On Hopper, the shapes flash_attention_mgpu.supports_backward takes go to its fused Mosaic GPU
    backward unless allow_mosaic is False or a block_sizes override is given.
    """
    if allow_mosaic and not interpret and block_sizes is None:
        mosaic = flash_attention_mgpu.attend_backward(
            q, k, v, segment_ids, offset_delta, out, lse, dout, causal=causal, scale=scale, dlse=dlse
        )
        if mosaic is not None:
            return mosaic
    _check_head_dim(q)
    batch, q_len, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    bs = block_sizes or default_block_sizes(head_dim, causal, q.dtype)
    multiple_q = max(bs.dq_block_q, bs.dkv_block_q)
    multiple_k = max(bs.dq_block_k, bs.dkv_block_k)
    geo = _Geometry.of(q, k, multiple_q, multiple_k)
    dim, group = geo.head_dim_padded, geo.group
    qp = _pad(q, geo.q_len_padded, dim)
    kp = _pad(k, geo.kv_len_padded, dim)
    vp = _pad(v, geo.kv_len_padded, dim)
    doutp = _pad(dout, geo.q_len_padded, dim)
    delta = common.softmax_delta(out, dout, dlse)  # one cheap fused XLA pass
    q_pad = geo.q_len_padded - q_len
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, q_pad)))
    # +inf makes p = 0 on padded query rows.
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, q_pad)), constant_values=jnp.inf)
    offsets = jnp.asarray(offset_delta, jnp.int32).reshape(1)
    has_segment_ids = segment_ids is not None
    precision = _precision(q.dtype)

    # dq: grid over (q blocks, batch, q heads).
    bq, bk = bs.dq_block_q, bs.dq_block_k
    in_specs = [
        pl.BlockSpec((1,), lambda i, b, h: (0,)),
        pl.BlockSpec((None, bq, None, dim), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, geo.kv_len_padded, None, dim), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, geo.kv_len_padded, None, dim), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, bq, None, dim), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
    ]
    operands = [offsets, qp, kp, vp, doutp, lse, delta]
    if has_segment_ids:
        in_specs += [
            pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, geo.kv_len_padded), lambda i, b, h: (b, 0)),
        ]
        operands += list(_pad_segments(segment_ids, geo))
    dq = pl.pallas_call(
        functools.partial(
            _dq_kernel,
            causal=causal,
            has_segment_ids=has_segment_ids,
            scale=scale,
            block_q=bq,
            block_k=bk,
            kv_len=geo.kv_len,
            precision=precision,
        ),
        grid=(geo.q_len_padded // bq, batch, heads_q),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, None, dim), lambda i, b, h: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.dq_num_warps, num_stages=bs.dq_num_stages),
        interpret=interpret,
        name="sf_flash_attention_dq",
    )(*operands)

    # dk, dv: grid over (kv blocks, batch, kv heads); each program loops over its group.
    bq, bk = bs.dkv_block_q, bs.dkv_block_k
    in_specs = [
        pl.BlockSpec((1,), lambda j, b, h: (0,)),
        pl.BlockSpec((None, geo.q_len_padded, heads_q, dim), lambda j, b, h: (b, 0, 0, 0)),
        pl.BlockSpec((None, bk, None, dim), lambda j, b, h: (b, j, h, 0)),
        pl.BlockSpec((None, bk, None, dim), lambda j, b, h: (b, j, h, 0)),
        pl.BlockSpec((None, geo.q_len_padded, heads_q, dim), lambda j, b, h: (b, 0, 0, 0)),
        pl.BlockSpec((None, heads_q, geo.q_len_padded), lambda j, b, h: (b, 0, 0)),
        pl.BlockSpec((None, heads_q, geo.q_len_padded), lambda j, b, h: (b, 0, 0)),
    ]
    operands = [offsets, qp, kp, vp, doutp, lse, delta]
    if has_segment_ids:
        in_specs += [
            pl.BlockSpec((None, geo.q_len_padded), lambda j, b, h: (b, 0)),
            pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
        ]
        operands += list(_pad_segments(segment_ids, geo))
    kv_block_spec = pl.BlockSpec((None, bk, None, dim), lambda j, b, h: (b, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkv_kernel,
            causal=causal,
            has_segment_ids=has_segment_ids,
            scale=scale,
            block_q=bq,
            block_k=bk,
            group=group,
            precision=precision,
        ),
        grid=(geo.kv_len_padded // bk, batch, heads_kv),
        in_specs=in_specs,
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype), jax.ShapeDtypeStruct(vp.shape, v.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=bs.dkv_num_warps, num_stages=bs.dkv_num_stages),
        interpret=interpret,
        name="sf_flash_attention_dkv",
    )(*operands)
    kv_len = geo.kv_len
    return (dq[:, :q_len, :, :head_dim], dk[:, :kv_len, :, :head_dim], dv[:, :kv_len, :, :head_dim])
