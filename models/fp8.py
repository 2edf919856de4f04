"""FP8 matmuls for the models' projections and MLPs: e4m3 operands forward, e5m2 gradients.

The recipe is torchao's default ("tensorwise", current scaling). Each operand of a GEMM is
scaled by one number computed from the tensor itself in the same step — its amax over the whole
tensor divided by the largest finite value of the FP8 format — then cast to FP8:

- forward: ``y = dot(q(x, e4m3), q(w, e4m3)) * sx * sw``, the dot taking FP8 operands and
  accumulating into the compute dtype;
- backward: the output gradient ``g`` cast to ``q(g, e5m2)`` (more range, less precision),
  then ``dx = dot(q(g), q(w)) * sg * sw`` and ``dw = dot(q(x), q(g)) * sx * sg``, both from the
  operands the forward quantised (kept as the residuals: FP8, half a bf16 activation's bytes).

The scales are state-free: nothing is carried from one step to the next, so there is nothing
for ``scan`` over the layers, remat, the pipeline's schedule or gradient accumulation's
micro-batches to carry, and nothing for the optimizer to see. Delayed scaling (scales from an
amax history of earlier steps, Transformer Engine's default) is not built. Scales rounded up to
powers of two (torchao's ``round_scales_to_power_of_2``: scaling and unscaling exact in bf16)
were tried and trained worse: the tiny preset's 300-step loss +1.22 % over bf16's against
+0.11 % with these (benchmarks/results/fp8.md).

The dot takes the FP8 operands directly, as flax's ``fp8_ops.fp8_scaled_dot_general`` emits it
(``dot_general(f8, f8, preferred_element_type=bf16)`` times the two scales), a pattern XLA's GPU
GEMM rewriter turns into a cuBLASLt FP8 GEMM with the scales in its epilogue. The alternative
(convert each operand back to bf16, scale it, dot) is rewritten too, but keeping the FP8 dtype
on the dot's operands lets shardflow's compiler see it: a weight FSDP gathers for the dot moves
as FP8 bytes, and ``explain`` lists each FP8 GEMM. Under ``sf.parallelize`` an amax is a plain
``jnp.max``; the compiler reduces it over every mesh axis the tensor is split on (an all-reduce
max of one float), so each scale is the whole tensor's, as on one device (torchao under DDP or
FSDP scales activations by each rank's local amax instead).

Which GEMMs: attention's q/k/v/o projections and the SwiGLU (Llama) or GELU (GPT-2) MLP's,
each where :func:`runs_in_fp8` admits its size. The mixture of experts' grouped GEMMs, the
router, the output projection inside the fused cross-entropy and attention's own matmuls stay
in the compute dtype. The numeric helpers are flax's (``flax.linen.fp8_ops``); this module is in
``models`` because the compiler package imports no flax.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax.extend import source_info_util

# Like JAX's own einsum, this file is never "your line": explain names the model's line calling it.
source_info_util.register_exclusion(os.path.abspath(__file__))

E4M3 = jnp.float8_e4m3fn  # the forward's operands: activations and weights
E5M2 = jnp.float8_e5m2  # the backward's output gradients


def scale(x, fp8_dtype):
    """The current (tensorwise) scale of ``x`` for ``fp8_dtype``: amax(|x|) / the format's
    largest value (float32); 1 where x is all zeros or not finite."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return fp8_ops.compute_scale(amax, jnp.float32(1.0), fp8_ops.get_fp8_max(fp8_dtype, jnp.float32))


def quantize(x, fp8_dtype):
    """(x / s cast to ``fp8_dtype``, s): the tensor in FP8 and its scale (float32 scalar)."""
    s = scale(x, fp8_dtype)
    return fp8_ops.quantize(x, fp8_dtype, s, jnp.float32), s


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_dot(dimension_numbers, dtypes, x, w):
    return _fp8_dot_fwd(dimension_numbers, dtypes, x, w)[0]


def _fp8_dot_fwd(dimension_numbers, dtypes, x, w):
    out_dtype = dtypes[2]
    qx, sx = quantize(x, E4M3)
    qw, sw = quantize(w, E4M3)
    y = jax.lax.dot_general(qx, qw, dimension_numbers, preferred_element_type=out_dtype)
    return fp8_ops.dequantize(y, out_dtype, sx * sw), (qx, sx, qw, sw)


def _fp8_dot_bwd(dimension_numbers, dtypes, residuals, g):
    x_dtype, w_dtype, _ = dtypes
    qx, sx, qw, sw = residuals
    qg, sg = quantize(g, E5M2)
    dims = {"dimension_numbers": dimension_numbers, "precision": None}
    dx = fp8_ops.dot_general_transpose_lhs(qg, qx, qw, **dims, preferred_element_type=x_dtype)
    dw = fp8_ops.dot_general_transpose_rhs(qg, qx, qw, **dims, preferred_element_type=w_dtype)
    return fp8_ops.dequantize(dx, x_dtype, sg * sw), fp8_ops.dequantize(dw, w_dtype, sx * sg)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """``lax.dot_general`` with both operands quantised to e4m3 and the output's gradient to
    e5m2 (the module docstring's recipe), whatever their sizes; its signature is dot_general's,
    so it can be ``jnp.einsum``'s ``_dot_general`` or an ``nnx.Linear``'s ``dot_general``.
    ``precision`` is ignored (an FP8 GEMM has one) and ``out_sharding`` must be None."""
    del precision
    if out_sharding is not None:
        raise ValueError("fp8_dot_general: out_sharding is not supported (shardflow places the output)")
    (lc, rc), (lb, rb) = dimension_numbers
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    return _fp8_dot(dims, (lhs.dtype, rhs.dtype, out_dtype), lhs, rhs)


# The size rule: which GEMMs are worth FP8. PROVISIONAL, until benchmarks/fp8.py measures bf16
# against FP8 per (M, N, K) on our GPUs: for now torchao's auto-filter for its tensorwise recipe
# (``_auto_filter_for_tensorwise``, from its H100 measurements): a GEMM stays in bf16 where its
# weight has at most 1024 input features (K) and at most 4096 output features (N), or where K or
# N is not a multiple of 16 (FP8 tensor cores' alignment). torchao's rule reads the weight alone;
# M (the tokens) is an argument so that the measured rule can use it.
MAX_SMALL_K = 1024
MAX_SMALL_N = 4096


def runs_in_fp8(m: int, n: int, k: int) -> bool:
    """Whether a GEMM of [m, k] activations by a [k, n] weight runs in FP8 (provisional: see
    MAX_SMALL_K)."""
    del m  # not used by the provisional rule
    if k % 16 or n % 16:
        return False
    return not (k <= MAX_SMALL_K and n <= MAX_SMALL_N)


@dataclasses.dataclass(frozen=True)
class Matmuls:
    """How a model's projections multiply: ``fp8`` (``ModelConfig.fp8``) puts those that
    :func:`runs_in_fp8` admits in FP8, ``small`` (``ModelConfig.fp8_small_gemms``) all of them
    (for small models: tests and convergence checks); the rest run in the compute dtype. A
    module keeps one as a static attribute and calls its ``einsum`` or ``dot_general``."""

    fp8: bool = False
    small: bool = False

    @classmethod
    def of(cls, cfg) -> Matmuls:
        return cls(cfg.fp8, cfg.fp8_small_gemms)

    def admits(self, m: int, n: int, k: int) -> bool:
        return self.fp8 and (self.small or runs_in_fp8(m, n, k))

    def einsum(self, spec: str, x, w):
        """``jnp.einsum(spec, x, w)`` with ``x`` the activations and ``w`` the weight: in FP8
        where admitted (K: w's dimensions contracted with x's, N: w's others, M: x's others)."""
        inputs, out = spec.replace(" ", "").split("->")
        xs, ws = inputs.split(",")
        k = math.prod(d for label, d in zip(ws, w.shape) if label in xs and label not in out)
        n = math.prod(d for label, d in zip(ws, w.shape) if label not in xs)
        if not self.admits(x.size // k, n, k):
            return jnp.einsum(spec, x, w)
        return jnp.einsum(spec, x, w, _dot_general=fp8_dot_general)

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, **kwargs):
        """An ``nnx.Linear``'s dot_general (inputs by a [k, n] kernel): in FP8 where admitted."""
        k, n = rhs.shape
        dot = fp8_dot_general if self.admits(lhs.size // k, n, k) else jax.lax.dot_general
        return dot(lhs, rhs, dimension_numbers, precision, **kwargs)


def gemm_shapes(cfg) -> dict[str, tuple[int, int]]:
    """The (K, N) of each projection a dense layer of ``cfg`` multiplies by its weight."""
    d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    if cfg.family == "gpt2":
        return {"q/k/v": (d, d), "proj": (d, d), "fc": (d, f), "fc_proj": (f, d)}
    shapes = {"wq": (d, h * hd), "wk/wv": (d, kv * hd), "wo": (h * hd, d)}
    if not cfg.n_experts or cfg.moe_every > 1:
        shapes |= {"w_gate/w_up": (d, f), "w_down": (f, d)}
    if cfg.n_experts and cfg.shared_experts:
        fs = cfg.shared_experts * cfg.expert_ffn_dim
        shapes |= {"shared w_gate/w_up": (d, fs), "shared w_down": (fs, d)}
    return shapes
