# Adapted from jax/experimental/pallas/ops/gpu/attention_mgpu.py (jax 0.11.2),
# Copyright 2024 The JAX Authors, Licensed under the Apache License, Version 2.0.
"""FlashAttention-3-style forward for Hopper in Pallas with the Mosaic GPU lowering.

The fast path of `flash_attention_gpu.forward`. Each CTA has three warpgroups: two compute
warpgroups, each owning 64 query rows (wgmma into register accumulators, with a schedule
barrier that lets one warpgroup's softmax overlap the other's matmuls), and one memory
warpgroup that streams K/V blocks through shared memory with TMA, `max_concurrent_steps` deep.

Changes from JAX's kernel: the logit scale (JAX's applies none), shared-memory buffers in the
input dtype (JAX's are float16 only, so bfloat16 failed), lse in natural log, and a `supports`
predicate; the pipeline itself is JAX's. It takes only what it was built for: bfloat16/float16,
head_dim 64 or 128, no segment ids, non-causal or causal with q_offset == kv_offset and
seq_q == seq_kv, sequences that are multiples of 128. Everything else goes to the Triton kernel.
Mosaic GPU has no interpret mode: benchmarks/attention.py --check tests this kernel on the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .attention_common import LN_2, LOG2_E

BLOCK_Q = 64  # rows per compute warpgroup; a CTA covers 2 * BLOCK_Q rows
BLOCK_KV = 128
MAX_CONCURRENT_STEPS = 2


def supports(q, k, segment_ids, offset_delta, *, causal: bool, scale: float) -> bool:
  batch, q_len, _, head_dim = q.shape
  kv_len = k.shape[1]
  if jax.default_backend() != "gpu" or q.dtype not in (jnp.bfloat16, jnp.float16):
    return False
  if head_dim not in (64, 128) or segment_ids is not None or scale <= 0:
    return False
  if q_len % (2 * BLOCK_Q) or kv_len % BLOCK_KV or kv_len < MAX_CONCURRENT_STEPS * BLOCK_KV:
    return False
  if causal and not (isinstance(offset_delta, int) and offset_delta == 0 and q_len == kv_len):
    return False
  try:
    device = jax.devices()[0]
    return getattr(device, "compute_capability", "") == "9.0"
  except RuntimeError:
    return False


def forward(q, k, v, *, causal: bool, scale: float):
  """Returns (out [B, S, Hq, D] in q's dtype, lse [B, Hq, S] float32, natural log)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # needs a CUDA build of jaxlib

  batch_size, q_seq_len, num_q_heads, head_dim = q.shape
  kv_seq_len, num_kv_heads = k.shape[1], k.shape[2]
  q_heads_per_kv_head = num_q_heads // num_kv_heads
  dtype = q.dtype
  block_q, block_kv = BLOCK_Q, BLOCK_KV
  max_concurrent_steps = min(MAX_CONCURRENT_STEPS, kv_seq_len // block_kv)
  logit_scale = scale * LOG2_E  # m_i is kept in this scaled base-2 domain

  def kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped):
    batch = lax.axis_index("batch")
    q_head = lax.axis_index("heads")
    smem_buffers, buffer_barriers, consumed_barriers, schedule_barrier = scoped
    wg_idx = lax.axis_index("wg")
    qo_smem2, k_smem, v_smem, lse_smem2 = smem_buffers
    k_barriers, v_barriers, q_barriers = buffer_barriers
    k_consumed_barriers, v_consumed_barriers = consumed_barriers

    def perform_schedule_barrier():
      plgpu.barrier_arrive(schedule_barrier)
      plgpu.barrier_wait(schedule_barrier)

    if causal:
      block_q_end = (lax.axis_index("q_seq") + 1) * (2 * block_q)
      block_max_kv_steps = pl.cdiv(block_q_end, jnp.array(block_kv, jnp.int32))
    else:
      block_max_kv_steps = kv_seq_len // block_kv

    @pl.when(wg_idx < 2)
    def _compute_wg():
      plgpu.set_max_registers(232, action="increase")
      qo_smem = qo_smem2.at[wg_idx]
      lse_smem = lse_smem2.at[wg_idx]
      q_seq_base = lax.axis_index("q_seq") * (2 * block_q) + wg_idx * block_q

      if causal:
        kv_steps = pl.cdiv(q_seq_base + block_q, jnp.array(block_kv, jnp.int32))
      else:
        kv_steps = block_max_kv_steps

      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_seq_base, block_q), q_head], qo_smem,
                              q_barriers.at[wg_idx])
      plgpu.barrier_wait(q_barriers.at[wg_idx])

      m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, dtype=jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.full((block_q,), 0, dtype=jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0, dtype=jnp.float32),
                              plgpu.Layout.WGMMA)

      @pl.when(kv_steps > 0)
      def _():
        plgpu.barrier_wait(k_barriers.at[0])

      pl.when(wg_idx == 1)(perform_schedule_barrier)

      def kv_loop(kv_step, carry, masked: bool = False):
        acc, m_i, l_i = carry
        slot = lax.rem(kv_step, jnp.array(max_concurrent_steps, kv_step.dtype))

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
          perform_schedule_barrier()
          return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_consumed_barriers.at[slot])

        if masked:
          q_ids = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0,
                                         layout=plgpu.Layout.WGMMA)
          kv_ids = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1,
                                          layout=plgpu.Layout.WGMMA)
          mask = (q_ids + q_seq_base) >= (kv_ids + kv_step * block_kv)
          qk = jnp.where(mask, qk, -jnp.inf)

        # m is kept scaled by logit_scale so that p is one FMA and an exp2.
        m_ij = jnp.maximum(m_i, qk.max(axis=1) * logit_scale)
        alpha = jnp.exp2(m_i - m_ij)
        m_i = m_ij
        p = jnp.exp2(qk * logit_scale - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i *= alpha
        p16 = p.astype(dtype)

        def end_softmax_barriers():
          plgpu.barrier_arrive(schedule_barrier)  # done with softmax
          plgpu.barrier_wait(v_barriers.at[slot])
          plgpu.barrier_wait(schedule_barrier)  # wait until the tensor cores are free

        # JAX's kernel: this ordering measured fastest for head_dim <= 128.
        l_i += p.sum(axis=1)
        acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
        end_softmax_barriers()

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
          wait_step = kv_step + 1
          wait_slot = lax.rem(wait_step, jnp.array(max_concurrent_steps, kv_step.dtype))

          @pl.when(wait_step < kv_steps)
          def _wait():
            plgpu.barrier_wait(k_barriers.at[wait_slot])

        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed_barriers.at[slot])
        return acc, m_i, l_i

      if not causal:
        acc, m_i, l_i = lax.fori_loop(0, block_max_kv_steps, kv_loop, (acc, m_i, l_i))
      else:
        def epilogue_kv_loop(kv_step, _):
          # Consume the pipelined K/V blocks this warpgroup does not need (the other compute
          # warpgroup of the CTA needs one more block under the causal mask).
          slot = lax.rem(kv_step, jnp.array(max_concurrent_steps, kv_step.dtype))
          plgpu.barrier_arrive(k_consumed_barriers.at[slot])
          plgpu.barrier_arrive(v_consumed_barriers.at[slot])
          perform_schedule_barrier()
          perform_schedule_barrier()

        full_kv_steps = lax.div(q_seq_base, jnp.array(block_kv, jnp.int32))
        acc, m_i, l_i = lax.fori_loop(0, full_kv_steps, kv_loop, (acc, m_i, l_i))
        acc, m_i, l_i = lax.fori_loop(full_kv_steps, kv_steps,
                                      functools.partial(kv_loop, masked=True),
                                      (acc, m_i, l_i))
        lax.fori_loop(kv_steps, block_max_kv_steps, epilogue_kv_loop, None)
      pl.when(wg_idx == 0)(perform_schedule_barrier)

      acc /= lax.broadcast_in_dim(l_i, (block_q, head_dim), [0])
      qo_smem[...] = acc.astype(dtype)
      # Every row sees at least its own key (causal) or all keys, so l_i > 0.
      lse_smem[...] = m_i * LN_2 + jnp.log(l_i)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_seq_base, block_q), q_head])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(q_seq_base, block_q)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg_idx == 2)
    def _memory_wg():
      plgpu.set_max_registers(40, action="decrease")
      kv_head = lax.div(q_head, jnp.array(q_heads_per_kv_head, q_head.dtype))
      for i in range(max_concurrent_steps):
        s = (batch, pl.ds(i * block_kv, block_kv), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[i], k_barriers.at[i])
        plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[i], v_barriers.at[i])

      @pl.loop(0, block_max_kv_steps - max_concurrent_steps)
      def _kv_loop(kv_step):
        tma_step = kv_step + max_concurrent_steps
        tma_slot = lax.rem(kv_step, jnp.array(max_concurrent_steps, kv_step.dtype))
        s = (batch, pl.ds(tma_step * block_kv, block_kv), kv_head)
        plgpu.barrier_wait(k_consumed_barriers.at[tma_slot])
        plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[tma_slot], k_barriers.at[tma_slot])
        plgpu.barrier_wait(v_consumed_barriers.at[tma_slot])
        plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[tma_slot], v_barriers.at[tma_slot])

  def entry(q_ref, k_ref, v_ref, out_ref, lse_ref):
    compute_wgs = 2
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((compute_wgs, block_q, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((compute_wgs, block_q), jnp.float32),
    ]
    pl.run_scoped(
        lambda *args: kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, args),
        scratch,
        (plgpu.Barrier(num_barriers=max_concurrent_steps),
         plgpu.Barrier(num_barriers=max_concurrent_steps),
         plgpu.Barrier(num_barriers=compute_wgs)),
        (plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=max_concurrent_steps),) * 2,
        plgpu.Barrier(num_arrivals=compute_wgs),
        collective_axes="wg",
    )

  out, lse = plgpu.kernel(
      entry,
      out_type=[q, jax.ShapeDtypeStruct((batch_size, num_q_heads, q_seq_len), jnp.float32)],
      grid=(num_q_heads, q_seq_len // (2 * block_q), batch_size),
      grid_names=("heads", "q_seq", "batch"),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(q, k, v)
  return out, lse
