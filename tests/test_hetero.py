"""Heterogeneous clusters: the device catalogue, cluster descriptions and the step simulator's
arithmetic (its fit to published measurements is benchmarks/hetero_validate.py's)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from shardflow.hetero import CATALOGUE, Cluster, Framework, Pipeline, Plan, Stage, Transformer, device_kind, simulate
from shardflow.hetero.simulate import StageCosts, activation_bytes, uniform_plan

GPT = Transformer(n_layers=24, d_model=1024, n_heads=16, head_dim=64, ffn_dim=4096, vocab_size=50272, seq_len=2048)
FW = Framework(efficiency={"*": 0.5})


def test_the_catalogue_names_every_kind_the_issue_lists_with_datasheet_numbers():
    for name in ("H100", "H200", "A100-40GB", "A100-80GB", "L4", "A10G", "V100-16GB", "RTX-3090", "GH200"):
        kind = device_kind(name)
        assert kind.memory > 10e9 and kind.memory_bandwidth > 2e11 and kind.source
    assert device_kind("H100").flops("bf16") == 989e12 and device_kind("H100").flops("fp8") == 1979e12
    assert device_kind("H100-SXM") is CATALOGUE["H100"]
    with pytest.raises(ValueError, match=r"device kind V100-16GB has no bf16 tensor cores \(it has fp16, fp32\)"):
        device_kind("V100-16GB").flops("bf16")
    with pytest.raises(ValueError, match=r"unknown device kind 'B300'; the catalogue has H100, "):
        device_kind("B300")


def test_an_inventory_becomes_nodes_with_links_and_loses_devices_from_its_last_nodes():
    cluster = Cluster.from_inventory({"H100": 8, "A100-40GB": 12}, per_node={"H100": 8, "A100-40GB": 8})
    assert [(n.kind.name, n.devices) for n in cluster.nodes] == [("H100", 8), ("A100-40GB", 8), ("A100-40GB", 4)]
    assert cluster.size == 20 and cluster.inventory() == {"H100": 8, "A100-40GB": 12}
    assert cluster.nodes[0].intra == 450e9 and cluster.nodes[0].inter == 25e9
    assert Cluster.from_inventory({"L4": 4}).nodes[0].intra == 32e9  # no NVLink: PCIe
    smaller = cluster.without("A100-40GB", 6)
    assert [(n.kind.name, n.devices) for n in smaller.nodes] == [("H100", 8), ("A100-40GB", 6)]
    with pytest.raises(ValueError, match=r"cannot lose 9 x H100; it has 8"):
        cluster.without("H100", 9)
    assert Cluster.from_config({"inventory": {"H100": 8}, "inter_node_GBps": 50}).nodes[0].inter == 50e9
    with pytest.raises(ValueError, match=r"cluster: keys \['nodes'\] unknown"):
        Cluster.from_config({"inventory": {"H100": 8}, "nodes": 2})


def test_one_stage_on_one_device_is_its_layers_flops_at_the_sustained_rate():
    """No communication, no pipeline: forward + backward (3x the forward's flops) at half of
    the H100's bf16 peak, plus the element-wise bytes at its memory bandwidth."""
    cluster = Cluster.from_inventory({"H100": 1})
    plan = uniform_plan("H100", dp=1, tp=1, pp=1, layers=24, microbatches=1, micro_batch=1)
    fw = dataclasses.replace(FW, elementwise=0.0, state_bytes=0.0)
    got = simulate(GPT, cluster, plan, fw)
    flops = 24 * GPT.layer_flops(1) + 2 * 2048 * 1024 * 50272
    loss_bytes = 3 * 2048 * 50272 * 4
    want = 3 * (flops / (989e12 * 0.5) + loss_bytes / (3350e9 * 0.7))
    assert got.seconds == pytest.approx(want, rel=1e-9)


def test_a_slower_replica_or_a_slower_link_never_makes_the_step_faster():
    fast = Cluster.from_inventory({"A100-80GB": 8})
    mixed = Cluster.from_inventory({"A100-80GB": 4, "V100-32GB": 4}, per_node=4)
    even = uniform_plan("A100-80GB", dp=2, tp=2, pp=2, layers=24, microbatches=4, micro_batch=2, precision="fp16")
    slow_pipe = Pipeline(tuple(Stage("V100-32GB", 2, 12) for _ in range(2)), 4)
    uneven = Plan((even.pipelines[0], slow_pipe), 2, precision="fp16")
    base = simulate(GPT, fast, even, FW).seconds
    assert simulate(GPT, mixed, uneven, FW).seconds > base
    slow_links = Cluster.from_inventory({"A100-80GB": 8}, per_node=2, inter_node_GBps=1)
    assert simulate(GPT, slow_links, even, FW).seconds > base


def test_memory_counts_the_state_of_a_stage_and_its_in_flight_micro_batches():
    cluster = Cluster.from_inventory({"H100": 4})
    plan = uniform_plan("H100", dp=1, tp=1, pp=4, layers=24, microbatches=8, micro_batch=1)
    first, *_, last = simulate(GPT, cluster, plan, FW).memory[0]
    assert first > last  # 1F1B: stage 0 keeps p micro-batches' activations, the last one 1
    with pytest.raises(ValueError, match=r"pipelines of \[1, 2\] stages"):
        simulate(
            GPT, cluster, Plan((Pipeline((Stage("H100", 1, 24),), 1), Pipeline((Stage("H100", 1, 12),) * 2, 1)), 1), FW
        )


def test_the_gradient_all_reduce_is_a_ring_over_each_nodes_network_or_within_a_node():
    """Two replicas of the whole model, tp=4: across two nodes each node's four devices run
    their rings at once through its one network, so the node sends 2(n-1)/n of a whole
    replica's fp32 gradients at its bandwidth; within one node each device all-reduces its
    1/tp shard over NVLink."""
    fw = Framework(efficiency={"*": 0.5}, state_bytes=0.0)  # no optimizer state: the step is the ring alone
    plan = uniform_plan("H100", dp=2, tp=4, pp=1, layers=24, microbatches=1, micro_batch=1)
    params = 24 * GPT.layer_params + 2 * GPT.vocab_size * GPT.d_model  # embedding and head on the one stage
    two_nodes = Cluster.from_inventory({"H100": 8}, per_node=4, inter_node_GBps=10)
    want = 2 * (2 - 1) / 2 * params * 4 / 10e9 + 2 * (2 - 1) * two_nodes.inter_latency
    assert simulate(GPT, two_nodes, plan, fw).sync_seconds == pytest.approx(want, rel=1e-12)
    one_node = Cluster.from_inventory({"H100": 8}, per_node=8)
    want = 2 * (2 - 1) / 2 * params / 4 * 4 / 450e9 + 2 * (2 - 1) * one_node.intra_latency
    assert simulate(GPT, one_node, plan, fw).sync_seconds == pytest.approx(want, rel=1e-12)


def test_matmul_efficiency_halves_at_half_tokens_per_device_and_activations_follow_megatron():
    fw = Framework(efficiency={"*": 0.6, "T4": 0.4}, half_tokens=1024)
    assert fw.sustained("T4", 1024) == pytest.approx(0.2) and fw.sustained("H100", 3 * 1024) == pytest.approx(0.45)
    assert fw.sustained("T4") == 0.4  # no size given: the large-GEMM limit
    # s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes at fp16: 2048·2·1024·(10 + 6 + 40) for b=2, t=4
    assert activation_bytes(GPT, 2, 4, 2) == 2048 * 2 * 1024 * 56
    assert activation_bytes(GPT, 2, 4, 4) == 2 * activation_bytes(GPT, 2, 4, 2)  # fp32 keeps 4-byte values


def test_a_fused_attention_keeps_no_scores_and_remat_levels_keep_less():
    """Megatron's GPT less its 5·a·s/(h·t) scores term when attention is fused: 2048·2·1024·16
    bytes for b=2, t=4 at fp16; a SwiGLU, grouped-query model without dropout keeps its norms'
    inputs and outputs (4·h), Q, K, V and attention's output (2·q + 2·kv) and the MLP's three
    [tokens, f] values, the last two split over tp. "dots" keeps the input, the matmul outputs
    (q + 2·kv + 2·f split, two h-wide projections); "full" the input alone."""
    assert activation_bytes(GPT, 2, 4, 2, fused=True) == 2048 * 2 * 1024 * 16
    assert activation_bytes(GPT, 2, 4, 2) - activation_bytes(GPT, 2, 4, 2, fused=True) == 2048 * 2 * 1024 * 40
    llama = Transformer(16, 2048, 16, 128, 5632, 32000, 4096, kv_heads=8, gated=True, dropout=False)
    per_token = 4 * 2048 + (2 * 2048 + 2 * 1024 + 3 * 5632) / 2
    assert activation_bytes(llama, 8, 2, 2, fused=True) == 4096 * 8 * per_token * 2
    dots = 3 * 2048 + (2048 + 2 * 1024 + 2 * 5632) / 2
    assert activation_bytes(llama, 8, 2, 2, fused=True, remat="dots") == 4096 * 8 * dots * 2
    assert activation_bytes(llama, 8, 2, 2, fused=True, remat="full") == 4096 * 8 * 2048 * 2
    with pytest.raises(ValueError, match="fused attention moves no scores"):
        Framework(efficiency={"*": 0.5}, fused_attention=True, unfused_attention=2.0)


def test_remat_true_is_full_and_dots_sits_between_none_and_full():
    cluster = Cluster.from_inventory({"H100": 1})
    fw = Framework(efficiency={"*": 0.5}, fused_attention=True)
    plans = {
        r: uniform_plan("H100", dp=1, tp=1, pp=1, layers=24, microbatches=1, micro_batch=4, remat=r)
        for r in ("none", "dots", "full")
    }
    assert plans["full"] == uniform_plan("H100", dp=1, tp=1, pp=1, layers=24, microbatches=1, micro_batch=4, remat=True)
    assert plans["none"].remat is False and plans["dots"].remat_level == "dots"
    got = {r: simulate(GPT, cluster, p, fw) for r, p in plans.items()}
    assert got["none"].seconds < got["dots"].seconds < got["full"].seconds
    assert got["none"].memory[0][0] > got["dots"].memory[0][0] > got["full"].memory[0][0]
    with pytest.raises(ValueError, match="remat must be"):
        Plan((), 1, remat="some")


def test_materialised_residuals_are_what_jax_vjp_saves_of_a_llama_layer():
    """A pipeline's slots hold a layer's vjp residuals as saved: for shardflow's 1b Llama block
    (float32 norms, SwiGLU) the simulator's count equals the bytes of the residuals jax.vjp
    keeps per token (those of attention's scores, which a fused kernel does not keep, aside)."""
    import numpy as np
    from flax import nnx

    import shardflow.models.llama as llama_lib
    from shardflow.models.config import preset

    cfg, seq = preset("1b"), 96
    graphdef, state = nnx.split(llama_lib.Block(cfg, nnx.Rngs(0)))
    state = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim > 1 else a, state)
    cos, sin = llama_lib.rope_tables(seq, cfg.head_dim, cfg.rope_theta)
    x = jnp.zeros((1, seq, cfg.d_model), jnp.bfloat16)

    def residuals():
        return jax.tree.leaves(jax.vjp(lambda st, x: nnx.merge(graphdef, st)(x, cos, sin), state, x)[1])

    per_token = sum(
        int(np.prod(a.shape)) // seq * a.dtype.itemsize
        for a in jax.eval_shape(residuals)
        if a.shape.count(seq) == 1 and a.shape[-1] != cfg.head_dim // 2  # not the scores, not the RoPE tables
    )
    model = Transformer(
        cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size, seq,
        kv_heads=cfg.n_kv_heads, gated=True, dropout=False, fp32_norms=True,
    )  # fmt: skip
    counted = activation_bytes(model, 1, 1, 2, fused=True, materialised=True) / seq
    # less attention's float32 log-sum-exp per head and four float32 statistics per token (norms)
    assert per_token - cfg.n_heads * 4 - 4 * 4 == counted


def test_an_spmd_pipeline_allocates_the_busiest_stage_on_every_device():
    """Under ``spmd_pipeline`` every stage's device holds the same bytes: min(m, 2p) slots of
    its layers' residuals, one stage's share of the state (embedding and head split over the
    stages), and more than the MPMD pipeline's last stage, which keeps one micro-batch."""
    cluster = Cluster.from_inventory({"H100": 4})
    plan = uniform_plan("H100", dp=1, tp=1, pp=4, layers=24, microbatches=16, micro_batch=2)
    mpmd = Framework(efficiency={"*": 0.5}, fused_attention=True)
    spmd = dataclasses.replace(mpmd, spmd_pipeline=True)
    (stages,) = simulate(GPT, cluster, plan, spmd).memory
    assert len(set(stages)) == 1
    (mpmd_stages,) = simulate(GPT, cluster, plan, mpmd).memory
    assert stages[0] > max(mpmd_stages)
    short = dataclasses.replace(plan, pipelines=(Pipeline(plan.pipelines[0].stages, 3),))
    costs, stage = StageCosts(GPT, cluster, plan, spmd), plan.pipelines[0].stages[0]
    slot = 6 * costs._kept(stage, "none", materialised=True)  # a micro-batch's residuals of 6 layers
    inputs = 2 * 13 * 2 * GPT.seq_len * GPT.d_model * 2  # 13 fewer micro-batches' inputs and gradients
    assert stages[0] - simulate(GPT, cluster, short, spmd).memory[0][0] == pytest.approx((8 - 3) * slot + inputs)


def test_a_plan_draws_one_box_per_stage_and_names_each_pipelines_microbatches():
    pytest.importorskip("matplotlib")
    from matplotlib.patches import Rectangle

    plan = Plan(
        (
            Pipeline((Stage("A100-40GB", 2, 4), Stage("H100", 2, 12)), 5),
            Pipeline((Stage("H100", 1, 8), Stage("H100", 1, 8)), 3),
        ),
        micro_batch=2,
    )
    ax = plan.draw().axes[0]
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert [(b.get_x(), b.get_width()) for b in boxes] == [(0, 4), (4, 12), (0, 8), (8, 8)]
    texts = [t.get_text() for t in ax.texts]
    assert "5 micro-batches" in texts and "3 micro-batches" in texts and "A100-40GB\ntp 2\n4 layers" in texts
