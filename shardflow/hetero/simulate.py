"""Predict a training step's time and per-device memory on a (heterogeneous) cluster.

A plan is a set of pipelines, each a replica of the model cut into stages; a stage runs on
``tp`` devices of one kind (tensor parallel within a node), holds some consecutive layers, and
every pipeline runs ``microbatches`` micro-batches of ``micro_batch`` sequences under 1F1B.
Stage ``s`` of every pipeline holds the same layers (its replicas), so their gradients are
all-reduced after the pipelines drain. Uneven micro-batch counts across pipelines are how a
slower replica gets less of the batch.

Costs are shardflow's: a device's work is ``LinkModel.compute_seconds`` (flops at the kind's
peak times the framework's sustained fraction, bytes at its memory bandwidth) and each
collective the α-β price of its bytes on the link it crosses (``Cluster``). What a framework
does beyond the arithmetic — how much of peak its matmuls reach, its attention (fused or not),
the bytes its element-wise ops move, what it holds beside the model state — is a
:class:`Framework`, fitted to measurements (``benchmarks/hetero_validate.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shardflow.hetero.cluster import Cluster
from shardflow.links import LinkModel

BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape."""

    n_layers: int
    d_model: int
    n_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    kv_heads: int | None = None  # grouped-query attention; None: n_heads
    gated: bool = False  # SwiGLU (three MLP matrices) rather than two

    @property
    def layer_params(self) -> int:
        d, q, kv = self.d_model, self.n_heads * self.head_dim, (self.kv_heads or self.n_heads) * self.head_dim
        return d * (2 * q + 2 * kv) + (3 if self.gated else 2) * d * self.ffn_dim

    def layer_flops(self, sequences: int) -> float:
        """Forward flops of one layer on ``sequences`` sequences: its matmuls and attention's
        two products over every query-key pair."""
        tokens = sequences * self.seq_len
        return 2 * tokens * self.layer_params + 4 * sequences * self.seq_len**2 * self.n_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class Framework:
    """What a training framework adds to the arithmetic, fitted per framework.

    ``efficiency``: per device kind, the fraction of peak matmul flop/s sustained (a default
    under the key "*"). ``elementwise``: bytes each token moves per d_model per layer in the
    forward (norms, activations, residuals, dropout), in units of the compute dtype.
    ``unfused_attention``: attention materialises its [heads, seq, seq] scores (read and
    written ``unfused_attention`` times). ``state_bytes``: bytes of weights, gradients and
    optimizer state per parameter. ``activation``: Megatron's activation bytes per token per
    d_model per layer (34 for fp16 without recomputation) at the compute dtype's width over 2.
    ``overhead``: bytes a device holds beyond the model (context, communication buffers,
    allocator). ``memory_efficiency``: fraction of memory bandwidth streams reach."""

    efficiency: Mapping[str, float]
    elementwise: float = 40.0
    unfused_attention: float = 0.0
    state_bytes: float = 16.0
    activation: float = 34.0
    overhead: float = 2e9
    memory_efficiency: float = 0.7

    def sustained(self, kind: str) -> float:
        return self.efficiency.get(kind, self.efficiency["*"])


@dataclasses.dataclass(frozen=True)
class Stage:
    kind: str
    tp: int
    layers: int


@dataclasses.dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]
    microbatches: int


@dataclasses.dataclass(frozen=True)
class Plan:
    pipelines: tuple[Pipeline, ...]
    micro_batch: int  # sequences per micro-batch
    precision: str = "bf16"  # matmul precision ("fp32" runs at the kind's tf32 rate)
    remat: bool = False

    @property
    def global_batch(self) -> int:
        return self.micro_batch * sum(p.microbatches for p in self.pipelines)


@dataclasses.dataclass(frozen=True)
class Prediction:
    seconds: float
    memory: tuple[tuple[float, ...], ...]  # bytes per device, per pipeline and stage
    pipeline_seconds: tuple[float, ...]
    sync_seconds: float


def _all_reduce(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


class _Costs:
    """One stage's forward and backward seconds per micro-batch and its memory, on ``cluster``."""

    def __init__(self, model: Transformer, cluster: Cluster, plan: Plan, framework: Framework):
        self.model, self.cluster, self.plan, self.fw = model, cluster, plan, framework
        self.nodes = {n.kind.name: n for n in cluster.nodes}
        self.width = BYTES[plan.precision]

    def device(self, kind: str) -> LinkModel:
        node = self.nodes[kind]
        precision = self.plan.precision
        if precision == "fp32" and node.kind.peak.get("tf32"):  # fp32 matmuls run as TF32 where they can
            precision = "tf32"
        return LinkModel(
            flops=node.kind.flops(precision) * self.fw.sustained(kind),
            memory_bandwidth=node.kind.memory_bandwidth * self.fw.memory_efficiency,
        )

    def forward(self, stage: Stage, first: bool, last: bool) -> float:
        m, b, t, w = self.model, self.plan.micro_batch, stage.tp, self.width
        tokens = b * m.seq_len
        moved = self.fw.elementwise * tokens * m.d_model * w
        moved += self.fw.unfused_attention * b * m.n_heads * m.seq_len**2 * w
        layer = self.device(stage.kind).compute_seconds(m.layer_flops(b) / t, moved / t)
        node = self.nodes[stage.kind]
        tp_comm = 2 * _all_reduce(tokens * m.d_model * w, t, node.intra, self.cluster.intra_latency)
        seconds = stage.layers * (layer + tp_comm)
        if last:  # the output projection and the loss over the vocabulary
            head = 2 * tokens * m.d_model * m.vocab_size / t
            seconds += self.device(stage.kind).compute_seconds(head, 3 * tokens * m.vocab_size * 4 / t)
        return seconds

    def backward(self, stage: Stage, first: bool, last: bool) -> float:
        forward = self.forward(stage, first, last)
        return 2 * forward + (forward if self.plan.remat else 0.0)

    def hop(self, stage: Stage) -> float:
        """An activation sent on to the next stage (on another node: its network)."""
        m = self.model
        nbytes = self.plan.micro_batch * m.seq_len * m.d_model * self.width
        node = self.nodes[stage.kind]
        return self.cluster.inter_latency + nbytes / node.inter

    def params(self, stage: Stage, first: bool, last: bool) -> float:
        m = self.model
        extra = m.vocab_size * m.d_model * (first + last)
        return (stage.layers * m.layer_params + extra) / stage.tp

    def memory(self, stage: Stage, index: int, pipeline: Pipeline) -> float:
        m, fw, p = self.model, self.fw, len(pipeline.stages)
        first, last = index == 0, index == p - 1
        in_flight = min(pipeline.microbatches, p - index)
        per_layer = fw.activation * self.plan.micro_batch * m.seq_len * m.d_model * self.width / 2 / stage.tp
        layers_kept = 1 if self.plan.remat else stage.layers
        activations = in_flight * per_layer * layers_kept
        return fw.overhead + fw.state_bytes * self.params(stage, first, last) + activations


def simulate(model: Transformer, cluster: Cluster, plan: Plan, framework: Framework) -> Prediction:
    """The step's predicted seconds and each device's memory under ``plan`` (see the module)."""
    costs = _Costs(model, cluster, plan, framework)
    pipeline_seconds = []
    for pipe in plan.pipelines:
        p = len(pipe.stages)
        work = [
            costs.forward(s, i == 0, i == p - 1) + costs.backward(s, i == 0, i == p - 1) + 2 * costs.hop(s) * (p > 1)
            for i, s in enumerate(pipe.stages)
        ]
        pipeline_seconds.append(sum(work) + (pipe.microbatches - 1) * max(work))
    sync = 0.0
    depth = {len(p.stages) for p in plan.pipelines}
    if len(depth) != 1:
        raise ValueError(f"simulate: pipelines of {sorted(depth)} stages; every pipeline holds the same stages")
    for s in range(depth.pop()):
        replicas = [pipe.stages[s] for pipe in plan.pipelines]
        grads = max(costs.params(r, s == 0, False) for r in replicas) * 4  # all-reduced in fp32
        nodes = {r.kind for r in replicas}
        devices = sum(r.tp for r in replicas)
        slowest = min(costs.nodes[k].inter / max(1, costs.nodes[k].devices) for k in nodes)
        one_node = len(nodes) == 1 and devices <= costs.nodes[replicas[0].kind].devices
        bandwidth = costs.nodes[replicas[0].kind].intra if one_node else slowest
        latency = cluster.intra_latency if one_node else cluster.inter_latency
        update = max(
            costs.device(r.kind).compute_seconds(0, framework.state_bytes * 2 * costs.params(r, s == 0, False))
            for r in replicas
        )
        sync = max(sync, _all_reduce(grads, len(replicas), bandwidth, latency) + update)
    memory = tuple(tuple(costs.memory(s, i, pipe) for i, s in enumerate(pipe.stages)) for pipe in plan.pipelines)
    return Prediction(max(pipeline_seconds) + sync, memory, tuple(pipeline_seconds), sync)


def uniform_plan(kind: str, *, dp: int, tp: int, pp: int, layers: int, microbatches: int, micro_batch: int, **kw):
    """A homogeneous plan: ``dp`` pipelines of ``pp`` stages of ``tp`` devices of ``kind``, the
    layers split as evenly as they go (earlier stages one more)."""
    per, extra = divmod(layers, pp)
    stages = tuple(Stage(kind, tp, per + (i < extra)) for i in range(pp))
    return Plan(tuple(Pipeline(stages, microbatches) for _ in range(dp)), micro_batch, **kw)


__all__ = ["Framework", "Pipeline", "Plan", "Prediction", "Stage", "Transformer", "simulate", "uniform_plan"]
