"""A fused (FlashAttention-2-style) attention backward for GPUs: measured, not used by default.

One Pallas (Triton lowering) kernel over (kv blocks, batch, kv heads). Each program holds one
kv block, loops over the q heads of its GQA group and their visible q blocks, and per tile pair
does the five matmuls the backward needs:

    s^T = k q^T        dv += p^T dout        dp^T = v dout^T        dk += ds^T q
    dq[q block] += ds k        (atomic add into an fp32 buffer shared by all kv blocks)

against seven in flash_attention_gpu's split backward, whose dq kernel recomputes s and dp.
Same conventions, padding, masking and block skipping as flash_attention_gpu, and the same
signature as its `backward`, so either can stand for the other.

Why it is not the default (H200, jax 0.11.2; benchmarks/results/attention.md, v5): at its best
tiles it takes 1.9-2.6x the split backward's time on every anchor shape. Two causes, measured
with `benchmarks/attention.py --probe-atomics`: (1) Pallas lowers `atomic_add` with acq_rel
semantics, which doubles the kernel's time; relaxed atomics (all a reduction needs) cost at
most 4% over a plain store, but Pallas offers no way to ask for them. (2) Even with dq
accumulation free (a plain store in place of the atomic), this Triton kernel is 1.1-1.4x
slower than the split pair; likely (not profiled) because dk, dv and the dq tile all live in
one program's registers and ds must be transposed for the dq matmul. dq's summation order
depends on scheduling, so dq is not bitwise deterministic.
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
from .attention_common import LOG2_E
from .flash_attention_gpu import (_Geometry, _check_head_dim, _dot, _pad, _pad_segments,
                                  _precision)


@dataclasses.dataclass(frozen=True)
class FusedBlockSizes:
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int


def default_block_sizes(head_dim: int) -> FusedBlockSizes:
  """The fastest of benchmarks/attention.py --sweep-bwd on an H200 (results/attention.md)."""
  if head_dim <= 64:
    return FusedBlockSizes(block_q=32, block_k=128, num_warps=4, num_stages=3)
  return FusedBlockSizes(block_q=64, block_k=128, num_warps=8, num_stages=3)


def _mask_t(q_block, kv_start, *, block_q, block_k, causal, offset_delta, kv_segments,
            q_segments):
  """attention_common.element_mask for one tile pair, transposed: [kv, q]."""
  mask_t = None
  if causal:
    q_index = q_block * block_q + jnp.arange(block_q)
    kv_index = kv_start + jnp.arange(block_k)
    mask_t = q_index[None, :] + offset_delta >= kv_index[:, None]
  if q_segments is not None:
    same = kv_segments[:, None] == q_segments[None, :]
    mask_t = same if mask_t is None else jnp.logical_and(mask_t, same)
  return mask_t


def _kernel(offset_ref, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref, *refs, causal,
            has_segment_ids, scale, block_q, block_k, group, precision):
  if has_segment_ids:
    q_segment_ref, kv_segment_ref, _, dk_ref, dv_ref, dq_acc_ref = refs
  else:
    _, dk_ref, dv_ref, dq_acc_ref = refs  # the first is dq_acc's input alias
  offset_delta = offset_ref[0]
  kv_start = pl.program_id(0) * block_k
  kv_head = pl.program_id(2)
  k = k_ref[...]
  v = v_ref[...]
  num_q_blocks = q_ref.shape[0] // block_q
  begin, begin_full = common.q_block_range(
      kv_start, block_q=block_q, block_k=block_k, num_q_blocks=num_q_blocks, causal=causal,
      has_segment_ids=has_segment_ids, offset_delta=offset_delta)
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
      if masked:
        q_segments = q_segment_ref[q_slice] if has_segment_ids else None
        p_t = jnp.where(
            _mask_t(q_block, kv_start, block_q=block_q, block_k=block_k, causal=causal,
                    offset_delta=offset_delta, kv_segments=kv_segments, q_segments=q_segments),
            p_t, 0.0)
      dv = dv + _dot(p_t.astype(dout.dtype), dout, precision=precision)
      dp_t = _dot(v, dout, transpose_b=True, precision=precision)
      # The logit scale, applied once here, is the factor of both dk and dq.
      ds_t = (p_t * (dp_t - delta[None, :]) * scale).astype(q.dtype)
      dk = dk + _dot(ds_t, q, precision=precision)
      dq = lax.dot_general(ds_t, k, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)  # ds k: [bq, d]
      plgpu.atomic_add(dq_acc_ref, (q_slice, head, slice(None)), dq)
      return dk, dv

    if causal or has_segment_ids:
      carry = lax.fori_loop(begin, begin_full, functools.partial(body, masked=True), carry)
    return lax.fori_loop(begin_full, num_q_blocks, functools.partial(body, masked=False),
                         carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, group, q_head_body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(q, k, v, segment_ids, offset_delta, out, lse, dout, *, causal: bool,
             scale: float, block_sizes: FusedBlockSizes | None = None,
             interpret: bool = False, dlse=None):
  """Returns (dq, dk, dv) in the dtypes of q, k, v; flash_attention_gpu.backward's contract."""
  _check_head_dim(q)
  batch, q_len, heads_q, head_dim = q.shape
  heads_kv = k.shape[2]
  bs = block_sizes or default_block_sizes(head_dim)
  bq, bk = bs.block_q, bs.block_k
  geo = _Geometry.of(q, k, bq, bk)
  dim, group = geo.head_dim_padded, geo.group
  qp = _pad(q, geo.q_len_padded, dim)
  kp = _pad(k, geo.kv_len_padded, dim)
  vp = _pad(v, geo.kv_len_padded, dim)
  doutp = _pad(dout, geo.q_len_padded, dim)
  # As in flash_attention_gpu.backward: delta = rowsum(dout * out) - dlse, and +inf lse on
  # padded query rows so that their p is 0.
  delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))
  if dlse is not None:
    delta = delta - dlse
  q_pad = geo.q_len_padded - q_len
  delta = jnp.pad(delta, ((0, 0), (0, 0), (0, q_pad)))
  lse = jnp.pad(lse, ((0, 0), (0, 0), (0, q_pad)), constant_values=jnp.inf)
  has_segment_ids = segment_ids is not None

  # Every program reads the whole q side of its batch element (all q heads, to loop over its
  # group) and one kv block.
  q_side = pl.BlockSpec((None, geo.q_len_padded, heads_q, dim), lambda j, b, h: (b, 0, 0, 0))
  rows = pl.BlockSpec((None, heads_q, geo.q_len_padded), lambda j, b, h: (b, 0, 0))
  kv_block = pl.BlockSpec((None, bk, None, dim), lambda j, b, h: (b, j, h, 0))
  in_specs = [pl.BlockSpec((1,), lambda j, b, h: (0,)), q_side, kv_block, kv_block, q_side,
              rows, rows]
  operands = [jnp.asarray(offset_delta, jnp.int32).reshape(1), qp, kp, vp, doutp, lse, delta]
  if has_segment_ids:
    in_specs += [pl.BlockSpec((None, geo.q_len_padded), lambda j, b, h: (b, 0)),
                 pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
    operands += [_pad_segments(segment_ids, geo.q_len_padded, -1),
                 _pad_segments(segment_ids, geo.kv_len_padded, -2)]
  # dq accumulates in fp32 over kv blocks, in a zeroed buffer aliased into the kernel.
  in_specs.append(q_side)
  operands.append(jnp.zeros(qp.shape, jnp.float32))
  dk, dv, dq = pl.pallas_call(
      functools.partial(_kernel, causal=causal, has_segment_ids=has_segment_ids, scale=scale,
                        block_q=bq, block_k=bk, group=group, precision=_precision(q.dtype)),
      grid=(geo.kv_len_padded // bk, batch, heads_kv),
      in_specs=in_specs,
      out_specs=[kv_block, kv_block, q_side],
      out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype),
                 jax.ShapeDtypeStruct(vp.shape, v.dtype),
                 jax.ShapeDtypeStruct(qp.shape, jnp.float32)],
      input_output_aliases={len(operands) - 1: 2},
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
      interpret=interpret,
      name="sf_flash_attention_bwd_fused",
  )(*operands)
  kv_len = geo.kv_len
  return (dq[:, :q_len, :, :head_dim].astype(q.dtype), dk[:, :kv_len, :, :head_dim],
          dv[:, :kv_len, :, :head_dim])
