"""Model hyper-parameters and the named presets."""

from __future__ import annotations

import dataclasses

import jax
from jax.extend.core.primitives import custom_vjp_call_p

from shardflow.attention import CONTEXTS, Layout
from shardflow.experts_primitives import sf_experts_fwd_p
from shardflow.ring_attention import LAYOUTS

ROUTINGS = ("capacity", "dropless")  # a mixture of experts' (models.moe) token routing
BALANCES = ("aux_loss", "bias", "none")  # and how it balances the experts' load
GATHERED = tuple(f"{kind}-all_gather" for kind in LAYOUTS)  # a layout's ring steps on K/V gathered


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str = "llama"  # "llama" or "gpt2"
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4  # llama only (GQA); gpt2 uses n_heads
    head_dim: int = 32
    ffn_dim: int = 768
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # gpt2 always ties
    # Mistral's sliding window (llama only): a query sees at most this many tokens back. The
    # attention has no window, so sequences longer than it are refused, not approximated.
    sliding_window: int | None = None
    remat: str = "none"  # see REMAT_POLICIES
    attention_impl: str = "ops"  # "ops" (shardflow.attention.attention); "jax"/"cudnn": reference only
    # A sequence split over a mesh axis: attention by "ring", "all_gather", "ulysses" or the
    # planner's choice ("auto"); "zigzag" / "striped": a ring over tokens in that order, for a
    # ring of context_blocks devices (the trainer sets it from the mesh and permutes the data);
    # "zigzag-all_gather" / "striped-all_gather": the same order, K/V gathered by the ring's steps.
    context: str = "auto"
    context_blocks: int = 1
    init_std: float = 0.02
    # Mixture of experts (llama only; models/moe.py): n_experts > 0 makes every moe_every-th
    # layer's feed-forward routed experts, experts_per_token (k) of them per token, each a SwiGLU
    # of moe_ffn_dim (default ffn_dim), plus shared_experts always-on ones.
    n_experts: int = 0
    experts_per_token: int = 2
    moe_ffn_dim: int | None = None
    shared_experts: int = 0
    moe_every: int = 1
    routing: str = "capacity"  # "capacity" (tokens over an expert's capacity dropped) or "dropless"
    capacity_factor: float = 1.25
    routing_group: int = 0  # tokens per capacity routing group (whole sequences or a part of one); 0 = a sequence
    balance: str = "aux_loss"  # "aux_loss" (Switch), "bias" (DeepSeek's aux-loss-free) or "none"
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    bias_rate: float = 0.02
    # FP8 matmuls (models/fp8.py): attention's projections and the dense MLPs in FP8 (e4m3
    # forward, e5m2 gradients, current per-tensor scaling), each GEMM the size rule admits;
    # fp8_small_gemms: every one of them, however small (small models: tests, convergence runs).
    fp8: bool = False
    fp8_small_gemms: bool = False

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def layout(self) -> Layout | None:
        """The tokens' order along the sequence (None: natural)."""
        kind = self.context.partition("-")[0]
        return Layout(kind, self.context_blocks) if kind in LAYOUTS else None

    @property
    def attention_context(self) -> str:
        if self.context in GATHERED:
            return "all_gather"
        return "ring" if self.context in LAYOUTS else self.context

    def __post_init__(self):
        if self.family not in ("llama", "gpt2"):
            raise ValueError(f"model.family must be 'llama' or 'gpt2', got {self.family!r}")
        if self.context not in CONTEXTS + LAYOUTS + GATHERED:
            raise ValueError(
                f"model.context must be one of {list(CONTEXTS + LAYOUTS + GATHERED)}, got {self.context!r}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat must be one of {sorted(REMAT_POLICIES)}, got {self.remat!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})"
            )
        if self.sliding_window is not None and self.family != "llama":
            raise ValueError(f"model.sliding_window is a llama-family setting, not {self.family}'s")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"model.sliding_window must be a positive number of tokens (or None), got {self.sliding_window}"
            )
        if self.family == "gpt2" and self.n_heads * self.head_dim != self.d_model:
            raise ValueError("gpt2: n_heads * head_dim must equal d_model")
        if self.n_experts:
            self._check_moe()
        self._check_fp8()

    def _check_fp8(self):
        from .fp8 import MAX_SMALL_K, MAX_SMALL_N, gemm_shapes, runs_in_fp8

        for key in ("fp8", "fp8_small_gemms"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"model.{key} must be true or false, got {getattr(self, key)!r}")
        if self.fp8_small_gemms and not self.fp8:
            raise ValueError("model.fp8_small_gemms puts small GEMMs in FP8: it needs model.fp8: true")
        shapes = gemm_shapes(self)
        # the rule's M: at least one sequence's tokens (the provisional rule does not read it)
        if (
            self.fp8
            and not self.fp8_small_gemms
            and not any(runs_in_fp8(self.max_seq_len, n, k) for k, n in shapes.values())
        ):
            listed = ", ".join(f"{name} (K {k}, N {n})" for name, (k, n) in shapes.items())
            raise ValueError(
                f"model.fp8: none of this model's GEMMs is large enough for FP8 (a GEMM with K <= "
                f"{MAX_SMALL_K} and N <= {MAX_SMALL_N}, or either not a multiple of 16, stays in the compute "
                f"dtype): {listed}; model.fp8_small_gemms: true runs them in FP8 anyway"
            )

    def _check_moe(self):
        if self.family != "llama":
            raise ValueError(f"model.n_experts: mixture of experts is a llama-family setting, not {self.family}'s")
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(
                f"model.experts_per_token ({self.experts_per_token}) must be between 1 and "
                f"model.n_experts ({self.n_experts})"
            )
        if self.routing not in ROUTINGS:
            raise ValueError(f"model.routing must be one of {list(ROUTINGS)}, got {self.routing!r}")
        if self.balance not in BALANCES:
            raise ValueError(f"model.balance must be one of {list(BALANCES)}, got {self.balance!r}")
        if self.routing == "capacity" and not self.capacity_factor > 0:
            raise ValueError(
                f"model.capacity_factor must be > 0 (an expert's capacity is at least one token), "
                f"got {self.capacity_factor}"
            )
        if self.routing_group < 0:
            raise ValueError(f"model.routing_group must be a token count (or 0: a sequence), got {self.routing_group}")
        if self.moe_every < 1 or self.n_layers % self.moe_every:
            raise ValueError(
                f"model.moe_every ({self.moe_every}) must be a positive divisor of model.n_layers ({self.n_layers})"
            )


def _and_routed_experts(policy):
    """``policy``, keeping the routed experts' outputs too: they are grouped GEMMs, kept by a
    policy that keeps products, else replayed in the backward (three more GEMMs a layer). A
    policy sees them as ``sf_experts_fwd`` or as the custom_vjp call around it (as JAX has
    differentiated it before the policy is asked)."""

    def keep(prim, *avals, **params):
        if prim is custom_vjp_call_p:
            return any(eqn.primitive is sf_experts_fwd_p for eqn in params["call_jaxpr"].eqns)
        return prim is sf_experts_fwd_p or policy(prim, *avals, **params)

    return keep


# What a rematerialised layer keeps from its forward pass; "none" = no remat.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": _and_routed_experts(jax.checkpoint_policies.dots_saveable),
    "dots_no_batch": _and_routed_experts(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
}

PRESETS: dict[str, dict] = {
    # CPU tests and the no-argument `shardflow train` run (byte-level vocabulary).
    "tiny": dict(
        vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768, max_seq_len=256
    ),
    "125m": dict(
        vocab_size=32000,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        head_dim=64,
        ffn_dim=2048,
        max_seq_len=2048,
    ),
    "350m": dict(
        vocab_size=32000,
        d_model=1024,
        n_layers=24,
        n_heads=16,
        n_kv_heads=16,
        head_dim=64,
        ffn_dim=2816,
        max_seq_len=2048,
    ),
    # ../shared/ANCHORS.md "1b" and "3b": the plain-JAX baselines were measured on these.
    "1b": dict(
        vocab_size=32000,
        d_model=2048,
        n_layers=16,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=5632,
        max_seq_len=4096,
    ),
    "3b": dict(
        vocab_size=32000,
        d_model=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=8192,
        max_seq_len=4096,
    ),
    "7b": dict(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        head_dim=128,
        ffn_dim=11008,
        max_seq_len=4096,
    ),
    "gpt2-tiny": dict(
        family="gpt2",
        vocab_size=256,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=8,
        head_dim=32,
        ffn_dim=1024,
        max_seq_len=256,
    ),
    "gpt2-124m": dict(
        family="gpt2",
        vocab_size=50304,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        head_dim=64,
        ffn_dim=3072,
        max_seq_len=1024,
    ),
}

# Mixture of experts. moe-tiny: CPU tests and runs. moe-1b: fine-grained experts (DeepSeek's
# shape: many narrow experts, one shared), ~1.6B parameters, ~0.5B active. moe-8x1b: Mixtral's
# shape on the 1b (8 experts of the 1b's MLP, 2 per token), ~4.5B parameters, ~1.3B active.
PRESETS["moe-tiny"] = dict(PRESETS["tiny"], n_experts=8, experts_per_token=2, moe_ffn_dim=256)
PRESETS["moe-1b"] = dict(PRESETS["1b"], n_experts=16, experts_per_token=4, moe_ffn_dim=1408, shared_experts=1)
PRESETS["moe-8x1b"] = dict(PRESETS["1b"], n_experts=8, experts_per_token=2)


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
