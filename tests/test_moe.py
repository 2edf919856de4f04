"""Mixture of experts: routing against a token-by-token reference, and the model's loss and
gradients sharded with expert parallelism equal to one device's."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import soundness_harness as harness
from fast_tier import examples
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import shardflow as sf
from shardflow import experts_rule, models
from shardflow.experts import routed_experts
from shardflow.experts_primitives import ExpertsConfig, sf_experts_bwd_p, sf_experts_fwd_p
from shardflow.models import PipelineConfig, moe
from shardflow.models import sharding as model_sharding
from shardflow.program import all_eqns
from shardflow.specs import S

SMALL_MOE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, moe_ffn_dim=32)


def reference_moe(x, gates, experts, weights, capacity_factor):
    """Token by token, as one device routes: each expert's queue filled by rank (every token's
    first choice before any second choice), then by token; a choice past capacity dropped.
    capacity_factor None: dropless. Returns (y, choices dropped)."""
    w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in weights)
    x, gates, experts = np.asarray(x, np.float64), np.asarray(gates, np.float64), np.asarray(experts)
    b, s, k = experts.shape
    n_experts = w_gate.shape[0]
    cap = math.inf if capacity_factor is None else moe.capacity(s, k, n_experts, capacity_factor)
    y, dropped = np.zeros_like(x), 0
    for row in range(b):
        queued = np.zeros(n_experts, int)
        for rank in range(k):
            for t in range(s):
                e = experts[row, t, rank]
                queued[e] += 1
                if queued[e] > cap:
                    dropped += 1
                    continue
                h = x[row, t] @ w_gate[e]
                h = h / (1 + np.exp(-h)) * (x[row, t] @ w_up[e])
                y[row, t] += gates[row, t, rank] * (h @ w_down[e])
    return y, dropped


def _routed(seed, batch, seq, n_experts, k, d=8, f=6):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(batch, seq, d)), jnp.float32)
    weights = [jnp.asarray(r.normal(size=shape) * 0.3, jnp.float32) for shape in ((n_experts, d, f),) * 2]
    weights.append(jnp.asarray(r.normal(size=(n_experts, f, d)) * 0.3, jnp.float32))
    gates, experts, _ = moe.route(jnp.asarray(r.normal(size=(batch, seq, n_experts)), jnp.float32), k)
    return x, gates, experts, weights


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 3),
    seq=st.integers(1, 24),
    n_experts=st.sampled_from([2, 4, 8]),
    k=st.integers(1, 4),
    capacity_factor=st.sampled_from([0.1, 0.5, 1.0, 1.25, 2.0]),
)
def test_capacity_routing_drops_what_one_device_drops(seed, batch, seq, n_experts, k, capacity_factor):
    k = min(k, n_experts)
    x, gates, experts, weights = _routed(seed, batch, seq, n_experts, k)
    y, dropped = moe.capacity_experts(x, gates, experts, *weights, capacity_factor)
    expected, expected_dropped = reference_moe(x, gates, experts, weights, capacity_factor)
    assert int(dropped) == expected_dropped
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), seq=st.integers(1, 24), n_experts=st.sampled_from([2, 4, 8]), k=st.integers(1, 3))
def test_dropless_routing_computes_every_choice(seed, seq, n_experts, k):
    k = min(k, n_experts)
    x, gates, experts, weights = _routed(seed, 2, seq, n_experts, k)
    expected, _ = reference_moe(x, gates, experts, weights, None)
    np.testing.assert_allclose(np.asarray(moe.dropless_experts(x, gates, experts, *weights)), expected, atol=1e-5)


def _eqns(jaxpr, prim) -> list:
    return [eqn for eqn in all_eqns(jaxpr) if eqn.primitive is prim]


@pytest.mark.parametrize("remat, runs", [("dots", 1), ("dots_no_batch", 1), ("full", 2), ("none", 1)])
def test_a_policy_keeping_products_keeps_the_routed_experts_outputs(remat, runs):
    """Under remat "dots" the routed experts' forward (three grouped GEMMs) runs once per layer
    in a train step's gradient, as the dense MLP's products do; under "full" the backward runs
    it again."""
    cfg = models.preset("moe-tiny", routing="dropless", remat=remat, **SMALL_MOE)
    graphdef, params = nnx.split(models.build(cfg))
    tokens = jnp.zeros((2, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(_losses_and_grads(cfg, graphdef, None))(nnx.to_pure_dict(params), tokens)
    assert len(_eqns(jaxpr.jaxpr, sf_experts_fwd_p)) == runs
    assert len(_eqns(jaxpr.jaxpr, sf_experts_bwd_p)) == 1


@settings(max_examples=examples(8), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    seq=st.sampled_from([4, 8, 12]),
    k=st.integers(1, 3),
    capacity_factor=st.sampled_from([None, 0.5, 1.0, 1.25, 2.0]),
)
def test_the_expert_parallel_layer_equals_one_device(seed, seq, k, capacity_factor):
    """Tokens split over 'data' and 'expert', the experts over 'expert': each routing mode's
    output and dropped choices, and the gradients of its operands, equal one device's."""
    x, gates, experts, weights = _routed(seed, 8, seq, 4, k)

    def layer(x, gates, w_gate, w_up, w_down):
        if capacity_factor is None:
            y, dropped = moe.dropless_experts(x, gates, experts, w_gate, w_up, w_down), jnp.zeros(())
        else:
            y, dropped = moe.capacity_experts(x, gates, experts, w_gate, w_up, w_down, capacity_factor)
        return jnp.sum(jnp.sin(y)), dropped

    grad = jax.value_and_grad(layer, argnums=(0, 1, 2, 3, 4), has_aux=True)
    want = jax.jit(grad)(x, gates, *weights)
    mesh = sf.make_mesh({"data": 2, "expert": 4})
    tokens, expert = P(("data", "expert")), P("expert")
    got = sf.parallelize(grad, mesh=mesh, in_specs=(tokens, tokens, expert, expert, expert))(x, gates, *weights)
    assert int(got[0][1]) == int(want[0][1])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


def test_router_bias_moves_selection_not_gates_and_balances_load():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]] * 6, jnp.float32))
    gates, experts, _ = moe.route(logits, 1, bias=jnp.asarray([0.0, 0.0, 0.4]))
    assert experts[0, 0] == 2 and gates[0, 0] == 1.0  # chosen by the bias, weighted by its probability
    bias = moe.updated_router_bias(jnp.zeros(3), jnp.asarray([6.0, 0.0, 0.0]), rate=0.1)
    np.testing.assert_allclose(bias, [-0.2, 0.1, 0.1])  # by the relative imbalance: (2 - 6) / 2, (2 - 0) / 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(experts_per_token=5), "experts_per_token"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(routing="sparse"), "routing"),
        (dict(balance="loss"), "balance"),
        (dict(moe_every=3), "moe_every"),
        (dict(routing_group=-1), "routing_group"),
        (dict(family="gpt2", n_heads=4, head_dim=64), "llama-family"),
    ],
)
def test_bad_moe_config_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        models.preset("moe-tiny", n_experts=4, **overrides)


def test_experts_not_divisible_by_the_expert_axis_are_refused_naming_the_parameter():
    model = nnx.eval_shape(lambda: models.build(models.preset("moe-tiny", n_experts=6, **SMALL_MOE)))
    mesh = sf.make_mesh({"data": 2, "expert": 4})
    with pytest.raises(ValueError, match=r"mlp/w_(gate|up|down): dimension 1 \(size 6\).*expert"):
        model_sharding.param_specs(model, {"expert": "expert"}, mesh)


EP = {"batch": ("data", "expert"), "expert": "expert"}
EP_TP = {**EP, "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}


def _loss_and_grads(cfg, tokens, mesh=None, rules=None, passes=None):
    model = models.build(cfg)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    def loss_and_grads(params, tokens):
        def loss(params):
            local = nnx.State(state)
            nnx.replace_by_pure_dict(local, params)
            return nnx.merge(graphdef, local).loss(tokens, tokens)

        if rules is None:
            return jax.value_and_grad(loss)(params)
        with model_sharding.activation_sharding(rules, sf.constrain):
            return jax.value_and_grad(loss)(params)

    if mesh is None:
        return jax.jit(loss_and_grads)(params, tokens), None
    specs = model_sharding.param_specs(model, rules, mesh)
    step = sf.parallelize(loss_and_grads, mesh=mesh, in_specs=(specs, P(("data", "expert"))), passes=passes)
    return step(params, tokens), step.explain(params, tokens)


MESHES = {
    "expert4": ({"data": 1, "expert": 4}, EP),
    "data2-expert4": ({"data": 2, "expert": 4}, EP),
    "data2-expert2-model2": ({"data": 2, "expert": 2, "model": 2}, EP_TP),
}


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("routing, balance", [("capacity", "aux_loss"), ("dropless", "bias")])
def test_expert_parallel_loss_and_grads_equal_one_device(mesh_name, routing, balance):
    axes, rules = MESHES[mesh_name]
    devices = np.asarray(jax.devices()[: math.prod(axes.values())])
    mesh = sf.make_mesh(axes, devices=devices)
    cfg = models.preset("moe-tiny", routing=routing, balance=balance, z_loss_weight=1e-3, **SMALL_MOE)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 16)), jnp.int32)
    (loss, grads), _ = _loss_and_grads(cfg, tokens)
    (sharded_loss, sharded_grads), plan = _loss_and_grads(cfg, tokens, mesh, rules)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), sharded_grads, grads)


KEPT = {  # rules that put no mesh axis on "expert": the experts' activations kept for the backward
    "tp": (
        {"data": 4, "expert": 1, "model": 2},
        {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model"},
    ),
    "fsdp": ({"data": 8, "expert": 1}, {"batch": "data", "embed": "data"}),
}


@pytest.mark.parametrize("mesh_name", KEPT)
def test_kept_activations_equal_one_device(mesh_name):
    """Under rules that split no mesh axis by expert, the dropless layer's backward takes the
    forward's gate and up projections (split with the tokens, or by ffn column under tp); the
    loss and every gradient equal one device's. Rules that do split the experts keep none."""
    axes, rules = KEPT[mesh_name]
    cfg = models.preset("moe-tiny", routing="dropless", balance="bias", **SMALL_MOE)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (8, 16)), jnp.int32)
    model = models.build(cfg)
    for layout, kept in ((rules, True), (EP, False)):
        with model_sharding.activation_sharding(layout, sf.constrain):
            jaxpr = jax.make_jaxpr(lambda t: jax.grad(lambda m: m.loss(t, t))(model))(tokens)
        assert [e.params["config"].keep_activations for e in _eqns(jaxpr.jaxpr, sf_experts_bwd_p)] == [kept]
    (loss, grads), _ = _loss_and_grads(cfg, tokens)
    (sharded_loss, sharded_grads), _ = _loss_and_grads(cfg, tokens, sf.make_mesh(axes), rules)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), sharded_grads, grads)


def test_routing_groups_of_several_sequences_across_devices_equal_one_device():
    """Capacity queues over groups of two sequences, each sequence on its own device: the queues
    cross devices and still drop exactly what one device drops."""
    mesh = sf.make_mesh({"data": 2, "expert": 4})
    cfg = models.preset("moe-tiny", routing_group=32, capacity_factor=0.5, **SMALL_MOE)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (8, 16)), jnp.int32)
    (loss, grads), _ = _loss_and_grads(cfg, tokens)
    (sharded_loss, sharded_grads), _ = _loss_and_grads(cfg, tokens, mesh, EP)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), sharded_grads, grads)
    with pytest.raises(ValueError, match=r"routing_group \(24\) must be a multiple or a divisor"):
        models.build(models.preset("moe-tiny", routing_group=24, **SMALL_MOE)).loss(tokens, tokens)


@pytest.mark.parametrize("passes", ["greedy", "solver"])
def test_capacity_dispatch_is_an_all_to_all_over_the_expert_axis(passes):
    """With the experts split over 'expert' and their weights larger than the tokens routed to
    them (as in any trained MoE), the planner moves the dispatched tokens to their experts by an
    all-to-all and never gathers an expert's weights. (Where the tokens outweigh the experts, the
    solver may rightly gather the weights instead.)"""
    mesh = sf.make_mesh({"data": 2, "expert": 4})
    cfg = models.preset("moe-tiny", **{**SMALL_MOE, "moe_ffn_dim": 512})
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 16)), jnp.int32)
    _, plan = _loss_and_grads(cfg, tokens, mesh, EP, sf.passes.SOLVER if passes == "solver" else None)
    routed = [c for c in plan.collectives if c.kind == "all_to_all"]
    assert routed and all(c.axes == ("expert",) for c in routed)
    # each on the MoE layer's line, the backward's too (made in the layer loop's backward pass)
    assert all(c.source.startswith("moe.py:") for c in routed), [c.source for c in routed]
    assert not [name for name, *_ in plan.gathered if "mlp" in name], plan.gathered


TRAIN_CASES = {
    "ep-capacity-aux": ("ep", {"data": 2, "expert": 4}, dict(routing="capacity", balance="aux_loss")),
    "ep_fsdp-dropless-bias": ("ep_fsdp", {"data": 2, "expert": 4}, dict(routing="dropless", balance="bias")),
    "ep_tp-capacity-bias": ("ep_tp", {"data": 2, "expert": 2, "model": 2}, dict(balance="bias", bias_rate=0.05)),
    "pipe-ep-dropless-bias": ("ep", {"pipe": 2, "data": 2, "expert": 2}, dict(routing="dropless", balance="bias")),
    "pipe-ep-capacity-aux": ("ep", {"pipe": 2, "data": 1, "expert": 4}, dict(routing="capacity", balance="aux_loss")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAIN_CASES)
def test_shardflow_train_with_expert_parallelism_equals_one_device(case, data_dir, tmp_path):
    """Three optimizer steps of `shardflow train` (balance losses, router-bias updates and all)
    give one device's losses; with pipeline stages, one device's running the same micro-batches
    in turn."""
    from test_models import single_device_losses, small_config

    from shardflow import train

    strategy, mesh, moe_keys = TRAIN_CASES[case]
    cfg = small_config(data_dir, tmp_path, strategy=strategy, mesh=mesh)
    cfg.model = {**cfg.model, **SMALL_MOE, "preset": "moe-tiny", "n_heads": 8, "n_kv_heads": 4, **moe_keys}
    if "pipe" in mesh:
        cfg.pipeline.stages, cfg.pipeline.microbatches = mesh["pipe"], 2
    expected = single_device_losses(cfg, pipelined="pipe" in mesh)
    got = train.train(cfg, progress=False)["losses"]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], expected, rtol=1e-5)


# --- the routed experts' exchange under expert parallelism


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """jax.lax.ragged_all_to_all's result (it has no CPU lowering), built from all-gathers: each
    source's rows ``input_offsets[me] : + send_sizes[me]`` land at its ``output_offsets[me]``."""
    every = [lax.all_gather(v, axis_name) for v in (operand, input_offsets, send_sizes, output_offsets)]
    operands, starts, sizes, lands = every
    me = lax.axis_index(axis_name)
    rows = jnp.arange(output.shape[0])
    for source in range(operands.shape[0]):
        start, size, at = starts[source, me], sizes[source, me], lands[source, me]
        inside = ((rows >= at) & (rows < at + size)).reshape(-1, *[1] * (output.ndim - 1))
        taken = operands[source][jnp.clip(start + rows - at, 0, operand.shape[0] - 1)]
        output = jnp.where(inside, taken, output)
    return output


def _experts_case(name, backward, exchange):
    config = ExpertsConfig(exchange)

    def fn(x, experts, w_gate, w_up, w_down, dh):
        if backward:
            return sf_experts_bwd_p.bind(x, experts, w_gate, w_up, w_down, dh, config=config)
        return sf_experts_fwd_p.bind(x, experts, w_gate, w_up, w_down, config=config)

    prim = sf_experts_bwd_p if backward else sf_experts_fwd_p
    shapes = ((8, 2, 8), (8, 2, 2), (8, 8, 6), (8, 8, 6), (8, 6, 8), (8, 2, 2, 8))
    args = tuple((s, jnp.int32 if i == 1 else jnp.float32) for i, s in enumerate(shapes))
    return harness.Case(name, prim, fn, args, values=((1, harness.ints(0, 8)),))


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("exchange", ["ragged", "padded"])
def test_expert_parallel_exchange_equals_the_experts_run_whole(backward, exchange, monkeypatch):
    """Tokens and experts split over one axis, or over two at once, or beside a token split:
    every choice reaches its expert's device and comes home, by the padded all-to-all and by the
    ragged one's offsets (on CPU, through an emulated ragged all-to-all)."""
    monkeypatch.setattr(experts_rule, "ragged_all_to_all", emulated_ragged_all_to_all)
    c = _experts_case(f"experts-{exchange}-{'bwd' if backward else 'fwd'}", backward, exchange)
    _, sigs = harness.traced(c)
    ep, tokens = (
        [i for i, s in enumerate(sigs) if s.name == name and s.ins[0] == S(0)][0] for name in ("ep", "tokens")
    )
    for sig_idx, sizes in [((ep,), (2,)), ((ep,), (4,)), ((ep, ep), (2, 2)), ((tokens, ep), (2, 2))]:
        for seed in range(3):
            harness.check(c, sig_idx, sizes, seed)


def test_the_ragged_exchange_is_refused_on_cpu_naming_the_line():
    mesh = sf.make_mesh({"expert": 4}, devices=np.asarray(jax.devices()[:4]))
    x, experts = jnp.ones((256, 8, 64)), jnp.zeros((256, 8, 2), jnp.int32)
    weights = jnp.ones((4, 64, 512)), jnp.ones((4, 64, 512)), jnp.ones((4, 512, 64))  # outweigh the tokens

    def layer(x, experts, *weights):
        return routed_experts(x, experts, *weights, exchange="ragged")

    split = P("expert")
    step = sf.parallelize(layer, mesh=mesh, in_specs=(split,) * 5, out_specs=split)
    with pytest.raises(sf.ShardingError, match=r"test_moe.py:\d+.*ragged_all_to_all has no CPU lowering.*padded"):
        step(x, experts, *weights)


def test_dropless_expert_parallelism_sends_each_choice_once_each_way():
    """Planned for a ragged exchange (explained on CPU, as for GPUs), a dropless layer's tokens
    reach their experts by all-to-alls over 'expert' of the formula's bytes, on the model's line:
    2 k T d bytes (P-1)/P per device forward at a balanced load, no expert weight gathered."""
    mesh = sf.make_mesh({"data": 2, "expert": 4})
    tokens, k, d, f, n_experts = 2048, 2, 64, 512, 8
    x = jax.ShapeDtypeStruct((tokens, d), jnp.float32)
    experts = jax.ShapeDtypeStruct((tokens, k), jnp.int32)
    weights = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d))]

    def layer(x, experts, *weights):
        return routed_experts(x, experts, *weights, exchange="ragged").sum(1)

    spec = P(("data", "expert"))
    step = sf.parallelize(layer, mesh=mesh, in_specs=(spec, spec, *[P("expert")] * 3), out_specs=spec)
    plan = step.explain(x, experts, *weights)
    sent = [c for c in plan.collectives if c.kind == "all_to_all" and c.shape[-1] == d]
    assert [(c.source[:12], c.axes, c.count) for c in sent] == [("test_moe.py:", ("expert",), 2)]  # out and home
    local = tokens // 8
    assert sent[0].bytes * sent[0].count == 2 * k * local * d * 4 * 3 // 4
    assert not plan.gathered


@pytest.mark.parametrize("passes", ["greedy", "solver"])
def test_capacity_layer_all_to_all_bytes_are_the_minimum_in_the_compiled_program(passes):
    """At capacity factor 1 the dispatched buffer holds k choices per token, so the all-to-alls
    XLA runs for one capacity-mode layer's forward move 2 k T d bytes (P-1)/P per device (T its
    tokens): within 5 % of that minimum, and explain lists the same bytes on the model's line.
    (At capacity factor c they move c times as much: the buffer is what travels.)"""
    from shardflow import hlo

    batch, seq, d, f, n_experts, k = 16, 32, 64, 512, 8, 2
    mesh = sf.make_mesh({"data": 2, "expert": 4})
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(batch, seq, d)), jnp.float32)
    router = jnp.asarray(r.normal(size=(d, n_experts)), jnp.float32)
    weights = [
        jnp.asarray(r.normal(size=s) * 0.1, jnp.float32) for s in ((n_experts, d, f),) * 2 + ((n_experts, f, d),)
    ]

    def layer(x, router, *weights):
        gates, experts, _ = moe.route(jnp.einsum("bsd,de->bse", x, router), k)
        return moe.capacity_experts(x, gates, experts, *weights, capacity_factor=1.0)[0]

    tokens = P(("data", "expert"))
    step = sf.parallelize(
        layer,
        mesh=mesh,
        in_specs=(tokens, P(), *[P("expert")] * 3),
        out_specs=tokens,
        passes=sf.passes.SOLVER if passes == "solver" else None,
    )
    local_tokens = batch * seq // 8
    minimum = 2 * k * local_tokens * d * 4 * 3 / 4
    compiled = step.lower(x, router, *weights).compile().as_text()
    ran = sum(c.bytes * c.count for c in hlo.collectives(compiled) if c.kind == "all_to_all")
    assert minimum <= ran <= 1.05 * minimum, (ran, minimum)
    listed = [c for c in step.explain(x, router, *weights).collectives if c.kind == "all_to_all"]
    assert sum(c.bytes * c.count for c in listed) == ran
    assert all(c.source.startswith("moe.py:") for c in listed)
    np.testing.assert_allclose(step(x, router, *weights), jax.jit(layer)(x, router, *weights), rtol=1e-5, atol=1e-5)


# --- MoE under pipeline stages (sf.pipeline): each micro-batch routes on its own


def _losses_and_grads(cfg, graphdef, pipeline):
    def loss(params, tokens):
        return nnx.merge(graphdef, params).losses(tokens, tokens, pipeline=pipeline)

    return jax.value_and_grad(loss, has_aux=True)


def _strided_reference(cfg, graphdef, params, tokens, m):
    """The plain model on each strided micro-batch (sf.pipeline's split), averaged: what a
    pipelined MoE step computes."""
    micro = [tokens[i::m] for i in range(m)]
    results = [jax.jit(_losses_and_grads(cfg, graphdef, None))(params, t) for t in micro]
    return jax.tree.map(lambda *xs: sum(xs) / m, *results)


@pytest.mark.parametrize("routing, balance", [("capacity", "aux_loss"), ("dropless", "bias")])
def test_pipelined_moe_routes_each_micro_batch_as_the_plain_model_does(routing, balance):
    """On one device sf.pipeline runs the micro-batches in turn: its loss (balance and z terms
    included), its gradients and its routing statistics per layer are the plain model's on each
    micro-batch, averaged; each layer's balance loss is differentiated on its own stage."""
    cfg = models.preset(
        "moe-tiny", routing=routing, balance=balance, z_loss_weight=1e-3, **{**SMALL_MOE, "n_layers": 4}
    )
    graphdef, params = nnx.split(models.build(cfg))
    params = nnx.to_pure_dict(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 16)), jnp.int32)
    want = _strided_reference(cfg, graphdef, params, tokens, 4)
    got = jax.jit(_losses_and_grads(cfg, graphdef, PipelineConfig(2, 4, "1f1b")))(params, tokens)
    assert got[0][1]["load"].shape == (4, cfg.n_experts)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


PIPELINED = {
    "pipe2-expert4": ({"pipe": 2, "data": 1, "expert": 4}, EP, "1f1b"),
    "pipe2-data2-expert2": ({"pipe": 2, "data": 2, "expert": 2}, EP, "zb-h1"),
    "pipe2-expert2-model2": ({"pipe": 2, "data": 1, "expert": 2, "model": 2}, EP_TP, "gpipe"),
}


def _pipelined_cases():
    """Every mesh with greedy, one with the solver, both routings: the fast tier runs one."""
    for case, passes in [(case, "greedy") for case in PIPELINED] + [("pipe2-data2-expert2", "solver")]:
        for routing, balance in (("capacity", "aux_loss"), ("dropless", "bias")):
            fast = (case, passes, routing) == ("pipe2-data2-expert2", "greedy", "dropless")
            marks = () if fast else (pytest.mark.slow,)
            yield pytest.param(case, passes, routing, balance, marks=marks, id=f"{case}-{passes}-{routing}-{balance}")


@pytest.mark.parametrize("case, passes, routing, balance", _pipelined_cases())
def test_pipelined_expert_parallel_step_equals_one_device(case, passes, routing, balance):
    """The stages on 'pipe', the experts on 'expert' within each stage (greedy's plan, and the
    solver's with the pipeline's bodies): the loss, every gradient and the per-layer routing
    statistics equal the same pipelined step on one device."""
    axes, rules, schedule = PIPELINED[case]
    mesh = sf.make_mesh(axes)
    cfg = models.preset(
        "moe-tiny", routing=routing, balance=balance, z_loss_weight=1e-3, **{**SMALL_MOE, "n_layers": 4}
    )
    model = models.build(cfg)
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (16, 16)), jnp.int32)  # micro-batches of 4
    grad = _losses_and_grads(cfg, graphdef, PipelineConfig(2, 4, schedule))
    want = jax.jit(grad)(params, tokens)
    rules = model_sharding.with_pipeline(rules)
    specs = model_sharding.param_specs(model, rules, mesh)

    def step(params, tokens):
        with model_sharding.activation_sharding(rules, sf.constrain):
            return grad(params, tokens)

    batch = model_sharding.spec_for(("batch", None), rules)
    solver = {"passes": sf.passes.SOLVER} if passes == "solver" else {}
    got = sf.parallelize(step, mesh=mesh, in_specs=(specs, batch), **solver)(params, tokens)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
