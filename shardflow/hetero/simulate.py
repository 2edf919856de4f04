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
    dropout: bool = True  # Megatron's GPT: dropout after attention, the MLP and on the attention probabilities
    fp32_norms: bool = False  # the norms compute in float32 (upcast input, normalised value), as Llama's RMSNorm

    @property
    def layer_params(self) -> int:
        d, q, kv = self.d_model, self.n_heads * self.head_dim, (self.kv_heads or self.n_heads) * self.head_dim
        return d * (2 * q + 2 * kv) + (3 if self.gated else 2) * d * self.ffn_dim

    def layer_flops(self, sequences: int) -> float:
        """Forward flops of one layer on ``sequences`` sequences: its matmuls and attention's
        two products over every query-key pair."""
        return self.matmul_flops(sequences) + self.attention_flops(sequences)

    def matmul_flops(self, sequences: int) -> float:
        """Forward flops of one layer's weight matmuls."""
        return 2 * sequences * self.seq_len * self.layer_params

    def attention_flops(self, sequences: int) -> float:
        """Forward flops of attention's two products over every query-key pair."""
        return 4 * sequences * self.seq_len**2 * self.n_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class Framework:
    """What a training framework adds to the arithmetic, fitted per framework.

    ``efficiency``: per device kind, the largest fraction of peak matmul flop/s sustained (a
    default under the key "*"). ``half_tokens``: the size, in tokens per micro-batch per
    tensor-parallel device (tokens / tp), at which matmuls reach half of that: small micro-batches
    and wide tensor parallelism make small GEMMs and leave launch, tail and framework costs bare.
    (Per layer this is a fixed cost of flops-per-token · n_half at the sustained rate, the same
    however the tokens are split: what tensor parallelism cannot divide.)
    ``elementwise``: bytes each token moves per d_model per layer in the forward (norms,
    activations, residuals, dropout), in units of the compute dtype. ``fused_attention``: attention
    is one kernel (flash attention) that keeps no [heads, seq, seq] scores, neither in memory nor
    in traffic; otherwise attention materialises its scores, read and written
    ``unfused_attention`` times (fitted; it must be 0 when fused). ``network_efficiency``: the
    fraction of a node's nominal network bandwidth its collectives and sends reach;
    ``intra_efficiency`` the fraction of the links within a node that the tensor-parallel
    all-reduces reach (small messages, PCIe through the host on GeForce and T4 nodes).
    ``state_bytes``: bytes of weights, gradients and optimizer state per parameter.
    ``activation``: a multiplier on the activation bytes a layer keeps (see
    :func:`activation_bytes`: Megatron's for its GPT). ``overhead``: bytes a device holds beyond the model (CUDA
    context, NCCL buffers, the caching allocator's slack). ``memory_efficiency``: fraction of
    memory bandwidth streams reach. ``rolled_loop``: the layers run as a rolled loop (``lax.scan``
    as XLA lowers it) that writes what each layer keeps into stacked buffers, zero-filled first
    (one more write of the kept bytes), and holds the stacks whole beside each trip's slices (a
    second copy of the kept bytes in memory, see :meth:`StageCosts.memory`). The copies of the
    matmul and attention outputs into and out of the stacks are not priced apart: the fitted
    element-wise bytes carry them (pricing them, 4× the matmul outputs' bytes, fitted worse).
    ``spmd_pipeline``: a pipeline is one SPMD program (shardflow's executor), so every device
    allocates the busiest stage's buffers (see :meth:`StageCosts.memory`) and every pipeline
    runs the busiest pipeline's micro-batch count (:func:`simulate`)."""

    efficiency: Mapping[str, float]
    half_tokens: float = 0.0
    elementwise: float = 40.0
    unfused_attention: float = 0.0
    fused_attention: bool = False
    network_efficiency: float = 1.0
    intra_efficiency: float = 1.0
    state_bytes: float = 16.0
    activation: float = 1.0
    overhead: float = 2e9
    memory_efficiency: float = 0.7
    rolled_loop: bool = False
    spmd_pipeline: bool = False

    def __post_init__(self):
        if self.fused_attention and self.unfused_attention:
            raise ValueError(f"Framework: fused attention moves no scores, unfused_attention={self.unfused_attention}")

    def sustained(self, kind: str, tokens: float = float("inf")) -> float:
        """The fraction of peak a matmul over ``tokens`` rows sustains on ``kind``:
        e_max · n / (n + n_half)."""
        top = self.efficiency.get(kind, self.efficiency["*"])
        return top if self.half_tokens <= 0 or tokens == float("inf") else top * tokens / (tokens + self.half_tokens)


REMAT = ("none", "dots", "full")


def activation_bytes(
    model: Transformer,
    micro_batch: int,
    tp: int,
    width: int,
    *,
    fused: bool = False,
    remat: str = "none",
    materialised: bool = False,
) -> float:
    """Bytes one layer keeps for its backward per micro-batch on each of ``tp`` devices (tensor
    parallel without sequence parallelism), values at the compute dtype's ``width``.

    ``remat="none"``: per token, the two norms' inputs and outputs (4·h, on every device), the
    1-byte dropout masks after attention and the MLP (h at 2 bytes, where the model has dropout),
    then split over tp: Q, K, V and attention's output (2·q + 2·kv) and the MLP's up (and gate)
    outputs and the down projection's input (3·f gated, 2·f not); an unfused attention also keeps
    its [heads, s, s] probabilities (with dropout their mask and dropped copy: 2.5 values each).
    For Megatron's GPT (q = kv = h, f = 4·h, dropout) this is Korthikanti et al. 2022's
    s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes at 2 bytes a value. A fused attention keeps no scores.

    ``remat="dots"`` (save matmul outputs, recompute the rest): the layer's input (h), the
    Q, K, V projections, the attention and MLP output projections (h each, their partial sums on
    every device) and the up (and gate) outputs; an unfused attention's score and probability
    products are matmuls too (a·s + q). A fused attention kernel is not a matmul: recomputed.

    ``remat="full"`` (keep the layer's input only): h.

    ``materialised`` (``remat="none"`` only): every residual the layer's vjp saves, as a pipeline
    executor's slots hold them between a micro-batch's forward and backward, where no fusion
    into the backward can drop one. Each norm keeps its output and, computing in float32, its
    upcast input and normalised value at 4 bytes; SwiGLU keeps six [tokens, f] values (what
    jax's linearisation of silu(gate) · up and the down projection saves, where one program
    keeps the gate and up outputs and their product). For shardflow's 1b Llama layer this is
    121.9 kB a token, jax.vjp's residuals counted by shape (the fused count: 62.5 kB)."""
    if remat not in REMAT:
        raise ValueError(f"activation_bytes: remat must be one of {REMAT}, got {remat!r}")
    s, h, a, t = model.seq_len, model.d_model, model.n_heads, tp
    q, kv, f = model.n_heads * model.head_dim, (model.kv_heads or model.n_heads) * model.head_dim, model.ffn_dim
    if remat == "full":
        values = h
    elif remat == "dots":
        values = 3 * h + (q + 2 * kv + (2 if model.gated else 1) * f) / t + (0 if fused else (a * s + q) / t)
    else:
        scores = 0 if fused else (2.5 if model.dropout else 1.0) * a * s / t
        mlp = (6 if materialised and model.gated else 3 if model.gated else 2) * f
        norms = 2 * h * (1 + 2 * 4 / width) if materialised and model.fp32_norms else 4 * h
        values = norms + (h if model.dropout else 0) + (2 * q + 2 * kv + mlp) / t + scores
    return s * micro_batch * values * width


def all_reduce_seconds(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` members: each sends 2(n-1)/n of the bytes
    through its slowest link, in 2(n-1) steps of ``latency``."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


_all_reduce = all_reduce_seconds


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
    # What a layer keeps for its backward: False / "none" everything, "dots" its matmul outputs
    # (the rest recomputed), True / "full" its input (its forward recomputed). "none" and "full"
    # are stored as False and True, so plans compare equal however they were written.
    remat: bool | str = False

    def __post_init__(self):
        remat = {"none": False, "full": True}.get(self.remat, self.remat)
        if remat not in (False, True, "dots"):
            raise ValueError(f"Plan: remat must be False/True or one of {REMAT}, got {self.remat!r}")
        object.__setattr__(self, "remat", remat)

    @property
    def remat_level(self) -> str:
        """ "none", "dots" or "full"."""
        return {False: "none", True: "full"}.get(self.remat, self.remat)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * sum(p.microbatches for p in self.pipelines)

    def draw(self, ax=None):
        """The plan as a matplotlib picture: one row per pipeline, its stages as boxes along the
        model's layers (a box spans its stage's layers, colored by device kind, labeled with the
        kind, its tensor-parallel width and its layer count), each pipeline's micro-batches at
        its right. Draws on ``ax`` (a new Figure, no pyplot, when None); returns the figure."""
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle

        layers = sum(s.layers for s in self.pipelines[0].stages)
        if ax is None:
            ax = Figure(figsize=(8.0, 0.7 * len(self.pipelines) + 1.6), layout="constrained").add_subplot()
        kinds = list(dict.fromkeys(s.kind for p in self.pipelines for s in p.stages))
        colors = {kind: f"C{i}" for i, kind in enumerate(kinds)}
        for row, pipeline in enumerate(self.pipelines):
            start = 0
            for stage in pipeline.stages:
                box = Rectangle((start, row + 0.1), stage.layers, 0.8, facecolor=colors[stage.kind], edgecolor="white")
                ax.add_patch(box)
                label = f"{stage.kind}\ntp {stage.tp}\n{stage.layers} layers"
                ax.text(start + stage.layers / 2, row + 0.5, label, ha="center", va="center", fontsize=7, color="white")
                start += stage.layers
            ax.text(layers * 1.01, row + 0.5, f"{pipeline.microbatches} micro-batches", va="center", fontsize=8)
        ax.set_xlim(0, layers * 1.18)
        ax.set_ylim(len(self.pipelines), 0)
        ax.set_yticks(
            [r + 0.5 for r in range(len(self.pipelines))], [f"pipeline {r}" for r in range(len(self.pipelines))]
        )
        ax.set_xlabel("layer")
        ax.set_title(
            f"{len(self.pipelines)} pipelines, micro-batches of {self.micro_batch} "
            f"sequence{'s' * (self.micro_batch != 1)}, remat {self.remat_level}",
            fontsize=9,
        )
        handles = [Patch(color=colors[k], label=k) for k in kinds]
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(kinds), fontsize=7)
        return ax.figure


@dataclasses.dataclass(frozen=True)
class Prediction:
    seconds: float
    memory: tuple[tuple[float, ...], ...]  # bytes per device, per pipeline and stage
    pipeline_seconds: tuple[float, ...]
    sync_seconds: float


class StageCosts:
    """One stage's forward and backward seconds per micro-batch, its sends, its gradient
    all-reduce and its memory, on ``cluster``."""

    def __init__(self, model: Transformer, cluster: Cluster, plan: Plan, framework: Framework):
        self.model, self.cluster, self.plan, self.fw = model, cluster, plan, framework
        self.nodes = {n.kind.name: n for n in cluster.nodes}
        self.width = BYTES[plan.precision]

    def device(self, kind: str, tokens: float = float("inf")) -> LinkModel:
        """``kind`` running matmuls over ``tokens`` rows: its peak in the plan's precision (fp32
        matmuls as TF32 where the kind has it) at the framework's sustained fraction."""
        node = self.nodes[kind]
        precision = self.plan.precision
        if precision == "fp32" and node.kind.peak.get("tf32"):
            precision = "tf32"
        return LinkModel(
            flops=node.kind.flops(precision) * self.fw.sustained(kind, tokens),
            memory_bandwidth=node.kind.memory_bandwidth * self.fw.memory_efficiency,
        )

    def inter(self, kind: str) -> float:
        """A node's network bandwidth as collectives reach it."""
        return self.nodes[kind].inter * self.fw.network_efficiency

    def layer(self, stage: Stage) -> float:
        """One transformer layer's forward on a micro-batch: its matmuls and attention at the
        sustained rate for each device's share of the micro-batch's tokens, the element-wise and
        (unfused) attention score traffic at memory bandwidth, each of the tp devices doing 1/tp
        of both; under a rolled layer loop, the zero fill of the stacks the layer's kept bytes go
        to; then Megatron's two tensor-parallel all-reduces of the [tokens, d_model]
        output (attention and MLP) over the node's links."""
        return self._layer(stage, copies=self.fw.rolled_loop)

    def _layer(self, stage: Stage, copies: bool) -> float:
        m, b, t = self.model, self.plan.micro_batch, stage.tp
        flops = m.layer_flops(b) / t
        moved = self._elementwise_bytes(stage) + self._scores_bytes(stage)
        if copies:  # the stacks' zero fill
            moved += self._kept(stage, self.plan.remat_level)
        return self.device(stage.kind, b * m.seq_len / t).compute_seconds(flops, moved) + self._tp_all_reduces(stage)

    def _elementwise_bytes(self, stage: Stage) -> float:
        m = self.model
        return self.fw.elementwise * self.plan.micro_batch * m.seq_len * m.d_model * self.width / stage.tp

    def _scores_bytes(self, stage: Stage) -> float:
        """An unfused attention's [heads, s, s] score traffic on each device (none when fused)."""
        if self.fw.fused_attention:
            return 0.0
        m = self.model
        return self.fw.unfused_attention * self.plan.micro_batch * m.n_heads * m.seq_len**2 * self.width / stage.tp

    def _tp_all_reduces(self, stage: Stage) -> float:
        m, t = self.model, stage.tp
        intra = self.nodes[stage.kind].intra * self.fw.intra_efficiency
        nbytes = self.plan.micro_batch * m.seq_len * m.d_model * self.width
        return 2 * all_reduce_seconds(nbytes, t, intra, self.cluster.intra_latency)

    def _kept(self, stage: Stage, remat: str, materialised: bool = False) -> float:
        """Bytes one layer keeps per micro-batch on each device of ``stage`` at ``remat``."""
        fused = self.fw.fused_attention
        return self.fw.activation * activation_bytes(
            self.model, self.plan.micro_batch, stage.tp, self.width, fused=fused, remat=remat, materialised=materialised
        )

    def recompute(self, stage: Stage) -> float:
        """One layer's recomputation in the backward. ``full``: the whole forward. ``dots``: what
        is not a matmul: the element-wise traffic, an unfused attention's softmax over its kept
        scores, a fused attention kernel's forward (its output is no matmul output) and the
        tensor-parallel all-reduces (their results are not saved either)."""
        level = self.plan.remat_level
        if level == "none":
            return 0.0
        if level == "full":
            return self._layer(stage, copies=False)
        m, b, t = self.model, self.plan.micro_batch, stage.tp
        flops = m.attention_flops(b) / t if self.fw.fused_attention else 0.0
        moved = self._elementwise_bytes(stage) + self._scores_bytes(stage)
        return self.device(stage.kind, b * m.seq_len / t).compute_seconds(flops, moved) + self._tp_all_reduces(stage)

    def head(self, stage: Stage) -> float:
        """The last stage's output projection over the vocabulary and the loss (softmax and
        cross entropy over fp32 logits, read and written about three times)."""
        m, b, t = self.model, self.plan.micro_batch, stage.tp
        tokens = b * m.seq_len
        flops = 2 * tokens * m.d_model * m.vocab_size / t
        return self.device(stage.kind, tokens / t).compute_seconds(flops, 3 * tokens * m.vocab_size * 4 / t)

    def forward(self, stage: Stage, first: bool, last: bool) -> float:
        return stage.layers * self.layer(stage) + (self.head(stage) if last else 0.0)

    def backward(self, stage: Stage, first: bool, last: bool) -> float:
        """Twice the forward's flops and traffic (gradients of inputs and of weights), plus each
        layer's recomputation under remat (the output head is not recomputed)."""
        return 2 * self.forward(stage, first, last) + stage.layers * self.recompute(stage)

    def hop(self, stage: Stage) -> float:
        """An activation (or its gradient) sent on to the neighbouring stage, over the node's
        network: DeepSpeed's pipeline sends and receives block, so each is on the critical path."""
        m = self.model
        nbytes = self.plan.micro_batch * m.seq_len * m.d_model * self.width
        return self.cluster.inter_latency + nbytes / self.inter(stage.kind)

    def params(self, stage: Stage, first: bool, last: bool) -> float:
        """Parameters on each device of the stage: its layers, the embedding on the first, the
        output projection on the last (tied: each of the two holds a copy), split over tp."""
        m = self.model
        extra = m.vocab_size * m.d_model * (first + last)
        return (stage.layers * m.layer_params + extra) / stage.tp

    def gradient_sync(self, replicas: list[Stage], first: bool, last: bool) -> float:
        """The data-parallel all-reduce of one stage's fp32 gradients over its replicas, after
        the pipelines drain (DeepSpeed's pipeline engine does not overlap it). Replicas within
        one node ring over its links, each device its 1/tp shard. Across nodes each node's tp
        devices run their rings at once through the node's one network interface, so the node
        sends 2(n-1)/n of a whole replica's gradients: the slowest node's network sets the pace."""
        kinds = {r.kind for r in replicas}
        devices = sum(r.tp for r in replicas)
        node = self.nodes[replicas[0].kind]
        if len(kinds) == 1 and devices <= node.devices:
            shard = max(self.params(r, first, last) for r in replicas) * 4
            return all_reduce_seconds(shard, len(replicas), node.intra, self.cluster.intra_latency)
        whole = self.params(replicas[0], first, last) * replicas[0].tp * 4  # the same whatever a replica's tp
        slowest = min(self.inter(k) for k in kinds)
        return all_reduce_seconds(whole, len(replicas), slowest, self.cluster.inter_latency)

    def update(self, stage: Stage, first: bool, last: bool) -> float:
        """The optimizer step: memory-bound, reading and writing each parameter's state once."""
        nbytes = self.fw.state_bytes * 2 * self.params(stage, first, last)
        return self.device(stage.kind).compute_seconds(0, nbytes)

    def memory(self, stage: Stage, index: int, pipeline: Pipeline) -> float:
        """The framework's overhead, the stage's model state, and the activations of the
        micro-batches 1F1B keeps in flight: stage s of p holds min(m, p - s) of them (the
        first stage's warm-up is p deep, the last runs each backward right after its forward),
        each keeping what its remat level keeps of every layer (twice under a rolled layer loop:
        the stacks and the slices), plus, under remat, what one layer recomputes in the backward
        (the rest of that layer's activations, for one micro-batch); the last stage also holds
        the head's logits. Under ``spmd_pipeline`` see :meth:`spmd_memory`."""
        p, first, last = len(pipeline.stages), index == 0, index == len(pipeline.stages) - 1
        if self.fw.spmd_pipeline and p > 1:
            return self.spmd_memory(stage, pipeline)
        in_flight = min(pipeline.microbatches, p - index)
        level = self.plan.remat_level
        kept = self._kept(stage, level)
        activations = in_flight * stage.layers * kept * (2 if self.fw.rolled_loop else 1)
        activations += self._kept(stage, "none") - kept
        logits = self.logits(stage.tp) if last else 0.0
        return self.fw.overhead + self.fw.state_bytes * self.params(stage, first, last) + activations + logits

    def logits(self, shards: int) -> float:
        """What the head holds at the loss, on each of the ``shards`` devices its vocabulary is
        split over: one micro-batch's logits at the compute dtype and their float32 gradient."""
        m = self.model
        return self.plan.micro_batch * m.seq_len * m.vocab_size / shards * (self.width + 4)

    def spmd_memory(self, stage: Stage, pipeline: Pipeline) -> float:
        """A device of a pipeline run as one SPMD program: every stage's device allocates the
        same buffers, sized for the busiest stage. The fused 1F1B keeps a micro-batch's residuals
        from its forward to its weight gradient, 2(p - s) alive on stage s, so every device holds
        min(m, 2p) slots, each the vjp residuals of its layers as saved (``materialised``), and
        no rolled loop's second copy (the layers' scans write them straight into the slots).
        The embedding and head are split over the stages with the layers, the head runs on every
        device over its 1/p of the vocabulary, and the micro-batches' inputs and their gradients
        ([m, b, s, h] each) and the hand-off buffers between stages are whole on every device."""
        m, p = self.model, len(pipeline.stages)
        layers, level = max(s.layers for s in pipeline.stages), self.plan.remat_level
        slots = min(pipeline.microbatches, 2 * p) * layers * self._kept(stage, level, materialised=True)
        recomputed = self._kept(stage, "none") - self._kept(stage, level)  # one layer's, in the backward
        params = (layers * m.layer_params + 2 * m.vocab_size * m.d_model / p) / stage.tp
        inputs = 2 * (pipeline.microbatches + 2) * self.plan.micro_batch * m.seq_len * m.d_model * self.width
        state = self.fw.state_bytes * params
        return self.fw.overhead + state + slots + recomputed + inputs + self.logits(stage.tp * p)


def simulate(model: Transformer, cluster: Cluster, plan: Plan, framework: Framework) -> Prediction:
    """The step's predicted seconds and each device's memory under ``plan`` (see the module).

    A pipeline of p stages running m micro-batches under 1F1B takes the sum of its stages'
    forward + backward + sends (the first micro-batch through, warm-up and cool-down) plus
    m - 1 times its slowest stage's (the steady state). The step is the slowest pipeline, then
    each stage's gradient all-reduce and optimizer step (the slowest stage's)."""
    costs = StageCosts(model, cluster, plan, framework)
    depth = {len(p.stages) for p in plan.pipelines}
    if len(depth) != 1:
        raise ValueError(f"simulate: pipelines of {sorted(depth)} stages; every pipeline holds the same stages")
    p = depth.pop()
    # shardflow's pipeline is one SPMD program: every pipeline runs the busiest one's count of
    # micro-batches, its own past its count being weightless padding (computed, not skipped).
    padded = framework.spmd_pipeline and p > 1
    busiest = max(pipe.microbatches for pipe in plan.pipelines)
    pipeline_seconds = []
    for pipe in plan.pipelines:
        work = [
            costs.forward(s, i == 0, i == p - 1) + costs.backward(s, i == 0, i == p - 1) + 2 * costs.hop(s) * (p > 1)
            for i, s in enumerate(pipe.stages)
        ]
        pipeline_seconds.append(sum(work) + ((busiest if padded else pipe.microbatches) - 1) * max(work))
    sync = 0.0
    for s in range(p):
        replicas = [pipe.stages[s] for pipe in plan.pipelines]
        update = max(costs.update(r, s == 0, s == p - 1) for r in replicas)
        sync = max(sync, costs.gradient_sync(replicas, s == 0, s == p - 1) + update)
    memory = tuple(tuple(costs.memory(s, i, pipe) for i, s in enumerate(pipe.stages)) for pipe in plan.pipelines)
    return Prediction(max(pipeline_seconds) + sync, memory, tuple(pipeline_seconds), sync)


def uniform_plan(kind: str, *, dp: int, tp: int, pp: int, layers: int, microbatches: int, micro_batch: int, **kw):
    """A homogeneous plan: ``dp`` pipelines of ``pp`` stages of ``tp`` devices of ``kind``, the
    layers split as evenly as they go (earlier stages one more)."""
    per, extra = divmod(layers, pp)
    stages = tuple(Stage(kind, tp, per + (i < extra)) for i in range(pp))
    return Plan(tuple(Pipeline(stages, microbatches) for _ in range(dp)), micro_batch, **kw)


__all__ = [
    "REMAT",
    "Framework",
    "Pipeline",
    "Plan",
    "Prediction",
    "Stage",
    "StageCosts",
    "Transformer",
    "activation_bytes",
    "simulate",
    "uniform_plan",
]
