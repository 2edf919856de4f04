"""Throughput accounting (FLOPs, MFU) and metric sinks (metrics.jsonl, TensorBoard)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Dense bf16 peak per device, FLOP/s, by a substring of jax's device_kind.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v4": 275e12,
}


def peak_flops(device, override: float | None = None) -> float | None:
    """Per-device peak; None when unknown (CPU), in which case MFU is reported as n/a."""
    if override:
        return float(override)
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops
    return None


def flops_per_token(model_cfg, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N for the weights plus the attention score/value matmuls.

    N excludes the input embedding table when it is not tied to the output head (a gather is
    not a matmul). Attention: QKᵀ and AV are 2·2·S·H·D FLOPs per token forward, halved for the
    causal mask, ×3 for forward + backward → 6·L·S·H·D.
    """
    n = n_params
    if model_cfg.family == "llama" and not model_cfg.tie_embeddings:
        n -= model_cfg.vocab_size * model_cfg.d_model
    if model_cfg.family == "gpt2":
        n -= model_cfg.max_seq_len * model_cfg.d_model  # learned positions: a gather too
    if model_cfg.n_experts:  # the experts a token does not visit do no work for it
        idle = model_cfg.n_experts - model_cfg.experts_per_token
        n -= model_cfg.n_layers // model_cfg.moe_every * idle * 3 * model_cfg.d_model * model_cfg.expert_ffn_dim
    attn = 6 * model_cfg.n_layers * seq_len * model_cfg.n_heads * model_cfg.head_dim
    return 6 * n + attn


def routing_scalars(metrics) -> dict:
    """An MoE step's routing, as logged scalars: per MoE layer i, ``moe/load_max_mean/i`` (the
    busiest expert's token choices over the mean expert's) and ``moe/dropped/i`` (the fraction of
    choices dropped by capacity); ``expert_load_max_mean`` and ``dropped_fraction`` the worst
    layer's; the cross-entropy and the balance losses summed over layers. {} for a dense step."""
    if "load" not in metrics:
        return {}
    load, dropped = np.asarray(metrics["load"]), np.asarray(metrics["dropped"])
    imbalance = load.max(-1) / load.mean(-1)
    dropped = dropped / load.sum(-1)
    scalars = {f"moe/load_max_mean/{i}": float(v) for i, v in enumerate(imbalance)}
    scalars |= {f"moe/dropped/{i}": float(v) for i, v in enumerate(dropped)}
    return scalars | {
        "expert_load_max_mean": float(imbalance.max()),
        "dropped_fraction": float(dropped.max()),
        "cross_entropy": float(metrics["cross_entropy"]),
        "aux_loss": float(np.sum(metrics["aux_loss"])),
        "z_loss": float(np.sum(metrics["z_loss"])),
    }


class MetricsLog:
    """Appends one JSON object per logged step to DIR/metrics.jsonl and mirrors scalars to
    TensorBoard event files in DIR/tb. Only process 0 writes.

    A run that continues from ``start_step`` (a resume) first drops the rows an earlier attempt
    logged after that step, and has TensorBoard hide its events there, so each shows one curve
    with every step once.
    """

    def __init__(self, out: str | Path, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(out) / "metrics.jsonl"
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._truncate(start_step)
            from tensorboardX import SummaryWriter

            # TensorBoard hides the events of earlier files from purge_step on.
            self._tb = SummaryWriter(str(Path(out) / "tb"), purge_step=start_step + 1)

    def _truncate(self, start_step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= start_step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                pass  # a line cut short by a crash
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)

    def log(self, step: int, **scalars) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in scalars.items() if v is not None}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for name, value in record.items():
            if name != "step":
                self._tb.add_scalar(f"train/{name}", value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
