"""Edge cases of the compiler that must either agree with ``jax.jit`` on one device or be
refused with an ``sf.ShardingError`` that says what to change."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow.attention import attention
from shardflow.registry import decision_of
from shardflow.specs import Partial, to_sbp


@pytest.fixture(scope="module")
def mesh():
    return sf.make_mesh({"data": 2, "model": 4})


# ------------------------------------------------------------------------------ out-of-range lookups
# A table split on its indexed dim (an embedding's vocabulary) is looked up block by block: each
# device gathers the rows it holds. An id outside the table must still give what the whole
# lookup gives under its mode: clamped (CLIP, PROMISE_IN_BOUNDS, as XLA runs it) or the fill value.

VOCAB, WIDTH = 4096, 8
TABLE = np.arange(VOCAB * WIDTH, dtype=np.float32).reshape(VOCAB, WIDTH) + 1  # no row is zero
IDS = np.array([[-VOCAB - 3, -1, 0, 5], [VOCAB - 1, VOCAB, VOCAB + 1, 10 * VOCAB]], np.int32)


def _lax_gather(mode, fill_value=None):
    dn = lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,), start_index_map=(0,))
    return lambda table, ids: lax.gather(table, ids[..., None], dn, (1, WIDTH), mode=mode, fill_value=fill_value)


LOOKUPS = {
    "index": lambda table, ids: table[ids],
    "take": lambda table, ids: jnp.take(table, ids, axis=0),
    "take-clip": lambda table, ids: jnp.take(table, ids, axis=0, mode="clip"),
    "at-get-promise": lambda table, ids: table.at[ids].get(mode="promise_in_bounds"),
    "at-get-clip": lambda table, ids: table.at[ids].get(mode="clip"),
    "at-get-fill": lambda table, ids: table.at[ids].get(mode="fill"),
    "at-get-fill-value": lambda table, ids: table.at[ids].get(mode="fill", fill_value=-7.0),
    "lax-default": _lax_gather(None),
    "lax-promise": _lax_gather(lax.GatherScatterMode.PROMISE_IN_BOUNDS),
    "lax-clip": _lax_gather(lax.GatherScatterMode.CLIP),
    "lax-fill": _lax_gather(lax.GatherScatterMode.FILL_OR_DROP),
    "lax-fill-value": _lax_gather(lax.GatherScatterMode.FILL_OR_DROP, fill_value=3.0),
}


def _vocab_split(step, *args) -> bool:
    """Whether the plan looks the table up block by block (the lookup's result partial over 'model')."""
    return any(
        primitive == "gather" and isinstance(sbp[1], Partial) for primitive, _, _, sbp in step.explain(*args).values
    )


@pytest.mark.parametrize("name", LOOKUPS)
def test_out_of_range_lookup_in_a_vocab_split_table_agrees_with_jit(mesh, name):
    fn = LOOKUPS[name]
    step = sf.parallelize(fn, mesh=mesh, in_specs=(PS("model"), PS()))
    assert _vocab_split(step, TABLE, IDS)
    np.testing.assert_array_equal(np.asarray(step(TABLE, IDS)), np.asarray(jax.jit(fn)(TABLE, IDS)))


UPDATES = np.arange(IDS.size * WIDTH, dtype=np.float32).reshape(IDS.shape + (WIDTH,)) + 1


def _lax_scatter_add(mode):
    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(2,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
    )
    return lambda table, ids, updates: lax.scatter_add(table, ids[..., None], updates, dn, mode=mode)


SCATTER_ADDS = {
    "at-add": lambda table, ids, updates: table.at[ids].add(updates),
    "at-add-clip": lambda table, ids, updates: table.at[ids].add(updates, mode="clip"),
    "at-add-drop": lambda table, ids, updates: table.at[ids].add(updates, mode="drop"),
    "at-add-promise": lambda table, ids, updates: table.at[ids].add(updates, mode="promise_in_bounds"),
    "lax-default": _lax_scatter_add(None),
    "lax-promise": _lax_scatter_add(lax.GatherScatterMode.PROMISE_IN_BOUNDS),
    "lax-clip": _lax_scatter_add(lax.GatherScatterMode.CLIP),
    "lax-drop": _lax_scatter_add(lax.GatherScatterMode.FILL_OR_DROP),
}


@pytest.mark.parametrize("name", SCATTER_ADDS)
def test_out_of_range_scatter_add_into_a_vocab_split_table_agrees_with_jit(mesh, name):
    fn = SCATTER_ADDS[name]
    step = sf.parallelize(fn, mesh=mesh, in_specs=(PS("model"), PS(), PS()), out_specs=PS("model"))
    program = step.program(TABLE, IDS, UPDATES)
    scatters = [e for e in program.jaxpr.jaxpr.eqns if e.primitive is lax.scatter_add_p]
    assert scatters and all(decision_of(e).named("vocab") for e in scatters), program
    np.testing.assert_array_equal(np.asarray(step(TABLE, IDS, UPDATES)), np.asarray(jax.jit(fn)(TABLE, IDS, UPDATES)))


# ------------------------------------------------------------------------------ a loop of no trips


def _scan_over_no_rows(x):
    def body(carry, row):
        return carry * 2 + row.sum(), carry * row

    return jax.lax.scan(body, x.sum(0), jnp.zeros((0, x.shape[1])), length=0)


def _scan_of_no_trips(x):
    def body(carry, _):
        return jnp.tanh(carry) @ jnp.ones((x.shape[1], x.shape[1])), carry.sum(0)

    return jax.lax.scan(body, x, None, length=0)


@pytest.mark.parametrize("passes", ["greedy", "solver"])
@pytest.mark.parametrize("fn", [_scan_over_no_rows, _scan_of_no_trips])
def test_a_scan_of_length_zero_agrees_with_jit(mesh, fn, passes):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    step = sf.parallelize(
        fn, mesh=mesh, in_specs=PS("data", "model"), passes=sf.passes.SOLVER if passes == "solver" else None
    )
    grad = sf.parallelize(
        jax.grad(lambda x: sum(jnp.sum(y) for y in jax.tree.leaves(fn(x)))), mesh=mesh, in_specs=PS("data")
    )
    for f, ref in [(step, fn), (grad, grad.fn)]:
        got, want = f(x), jax.jit(ref)(x)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.shape == w.shape
            np.testing.assert_allclose(np.asarray(g), np.asarray(w))


# ------------------------------------------------------------------------------ memory budgets with units


@pytest.mark.parametrize(
    "budget, nbytes",
    [
        (4096, 4096),
        (np.int64(4096), 4096),
        (40e9, 40_000_000_000),
        ("4096", 4096),
        ("4096B", 4096),
        ("40GB", 40_000_000_000),
        ("40 GB", 40_000_000_000),
        ("40gb", 40_000_000_000),
        ("1.5 GB", 1_500_000_000),
        ("40GiB", 40 * 2**30),
        ("0.5 KiB", 512),
        ("2MB", 2_000_000),
        ("3 MiB", 3 * 2**20),
        ("1TB", 10**12),
        ("1 TiB", 2**40),
        ("1.1 kB", 1100),
    ],
    ids=str,
)
def test_a_memory_budget_is_bytes_or_a_string_with_units(mesh, budget, nbytes):
    step = sf.parallelize(lambda x: x * 2, mesh=mesh, in_specs=PS("data"), memory_budget=budget)
    assert step.memory_budget == nbytes and type(step.memory_budget) is int


def test_a_memory_budget_string_bounds_the_solver_in_bytes(mesh):
    def mlp(w, x):
        return jnp.tanh(x @ w).sum()

    args = (np.ones((64, 64), np.float32), np.ones((8, 64), np.float32))
    step = sf.parallelize(mlp, mesh=mesh, in_specs=(sf.AUTO, PS("data")), passes=sf.passes.SOLVER, memory_budget="4KiB")
    assert step.explain(*args).memory_bytes <= 4096
    with pytest.raises(sf.ShardingError, match=r"memory_budget=1,024 bytes per device"):
        sf.parallelize(
            mlp, mesh=mesh, in_specs=(sf.AUTO, PS("data")), passes=sf.passes.SOLVER, memory_budget="1KiB"
        ).explain(*args)


# ------------------------------------------------------------------------------ passes by name


def test_passes_named_by_string_are_the_passes_of_that_name(mesh):
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    fn = lambda x: jnp.tanh(x @ x.T).sum(0)  # noqa: E731
    named = sf.parallelize(
        fn, mesh=mesh, in_specs=PS("data"), passes=["inline", "cse", "solve", "boxing", "unroll", "lower"]
    )
    assert named.passes == sf.passes.SOLVER
    mixed = sf.parallelize(
        fn,
        mesh=mesh,
        in_specs=PS("data"),
        passes=[sf.passes.DEFAULT[0], "propagate", "boxing", *sf.passes.DEFAULT[-2:]],
    )
    assert [p.name for p in mixed.passes] == ["inline", "propagate", "boxing", "unroll", "lower"]
    for step in (named, mixed):
        np.testing.assert_allclose(np.asarray(step(x)), np.asarray(jax.jit(fn)(x)), rtol=1e-5)
    assert named.explain(x).planner.startswith("solver") and mixed.explain(x).planner == "greedy"


# ------------------------------------------------------------------------------ sf.plan with nothing to rank


def _mlp(w, x):
    return jnp.tanh(x @ w).sum()


MLP = (np.ones((64, 64), np.float32), np.ones((8, 64), np.float32))


def test_a_memory_budget_that_refuses_every_mesh_says_what_the_leanest_plan_holds():
    free = sf.plan(_mlp, *MLP, in_specs=(sf.AUTO, PS("data")))
    least = min(c.explain.memory_bytes for c in free)
    lean = min(free, key=lambda c: c.explain.memory_bytes).mesh_shape
    with pytest.raises(sf.ShardingError) as refusal:
        sf.plan(_mlp, *MLP, in_specs=(sf.AUTO, PS("data")), memory_budget="100B")
    message = str(refusal.value)
    assert (
        f"memory_budget=100 bytes per device refuses every mesh shape tried; the leanest plan found without "
        f"it holds {least:,} bytes per device"
        in message
        and f"on {lean}:" in message
    ), message
    assert message.count("memory_budget=100 bytes per device") == 1 + len(free), message  # and each refusal


def test_every_mesh_refused_says_why_for_each():
    with pytest.raises(sf.ShardingError, match=r"every mesh shape tried is refused: on \{'data': 8\}: .*12"):
        sf.plan(_mlp, MLP[0], np.ones((12, 64), np.float32), in_specs=(PS(), PS("data")), mesh_shapes=[{"data": 8}])


# ------------------------------------------------------------------------------ a mesh axis no value uses


def _mlp_grad(w1, w2, x):
    return jax.grad(lambda w1, w2: jnp.sum(jnp.tanh(x @ w1) @ w2))(w1, w2)


MLP_GRAD_ARGS = (np.ones((16, 32), np.float32) / 16, np.ones((32, 16), np.float32) / 32, np.ones((16, 16), np.float32))


def test_a_mesh_axis_no_value_uses_is_warned_of_by_name(mesh):
    step = sf.parallelize(_mlp_grad, mesh=mesh, in_specs=(PS(), PS(), PS("data")))
    with pytest.warns(
        sf.ReplicatedAxisWarning,
        match=r"mesh axis 'model' \(4 devices\) of _mlp_grad "
        r"\(test_edges.py:\d+\): no value is split or partial over "
        r"it: every device along it runs the same work on the same "
        r"data",
    ) as caught:
        step(*MLP_GRAD_ARGS)
    assert len(caught) == 1 and "'data'" not in str(caught[0].message), [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(*MLP_GRAD_ARGS)  # once per compiled program, not per call
        step.explain(*MLP_GRAD_ARGS)


def _ring_loss(q, k, v):
    return jnp.sum(jnp.tanh(attention(q, k, v, causal=True, context="ring")))


def _pipelined(layers, hp, x, tg):
    return sf.pipeline(
        lambda w, h: jnp.tanh(h @ w),
        layers,
        x,
        head=lambda hp, y, t: jnp.mean((y @ hp - t) ** 2),
        head_params=hp,
        head_args=tg,
        stages=2,
        microbatches=2,
    )


REPLICATION_FREE = {  # (mesh, fn, in_specs, args): every axis splits some value
    "dp": ({"data": 8}, _mlp_grad, (PS(), PS(), PS("data")), MLP_GRAD_ARGS),
    "fsdp": ({"data": 8}, _mlp_grad, (PS("data"), PS(None, "data"), PS("data")), MLP_GRAD_ARGS),
    "tp": ({"data": 2, "model": 4}, _mlp_grad, (PS(None, "model"), PS("model"), PS("data")), MLP_GRAD_ARGS),
    "pipeline": (
        {"data": 2, "pipe": 2},
        jax.grad(_pipelined, argnums=(0, 1)),
        (PS(), PS(), PS("data"), PS("data")),
        (
            np.ones((4, 8, 8), np.float32) / 8,
            np.ones((8, 3), np.float32),
            np.ones((8, 8), np.float32),
            np.ones((8, 3), np.float32),
        ),
    ),
    "context": (
        {"data": 2, "context": 4},
        jax.grad(_ring_loss, argnums=(0, 1, 2)),
        PS("data", "context"),
        tuple(np.ones((2, 32, 4, 8), np.float32) for _ in range(3)),
    ),
}


@pytest.mark.parametrize("case", REPLICATION_FREE)
def test_no_warning_where_every_axis_splits_a_value(case):
    axes, fn, specs, args = REPLICATION_FREE[case]
    step = sf.parallelize(fn, mesh=sf.make_mesh(axes), in_specs=specs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.ReplicatedAxisWarning)
        step.explain(*args)


def test_the_layouts_plan_and_alternatives_try_are_not_warned_of(mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.ReplicatedAxisWarning)
        ranked = sf.plan(_mlp, *MLP, in_specs=(PS(), PS("data")))
        step = sf.parallelize(_mlp, mesh=mesh, in_specs=(PS(None, "model"), PS("data")))
        tried = sf.alternatives(step, *MLP, top=None)
    assert len(ranked) == 4 and all(c.step is not None for c in ranked)
    assert any(to_sbp(a.spec, mesh, 2) == (sf.B, sf.B) for a in tried if a.argument == "args[0]")


def test_the_axes_no_value_uses_are_named_in_one_warning(mesh):
    step = sf.parallelize(_mlp_grad, mesh=mesh, in_specs=PS())
    with pytest.warns(sf.ReplicatedAxisWarning) as caught:
        step(*MLP_GRAD_ARGS)
    assert len(caught) == 1 and str(caught[0].message).startswith(
        "mesh axes 'data' (2 devices) and 'model' (4 devices) of _mlp_grad"
    ), str(caught[0].message)
    assert "unless the 8 copies are intended" in str(caught[0].message)
    assert caught[0].filename == __file__


# ------------------------------------------------------------------------------ explain's summary line


def test_explains_total_counts_every_collective_a_call_runs(mesh):
    def loss(ws, x):
        return jnp.mean(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0] ** 2)

    plan = sf.parallelize(jax.value_and_grad(loss), mesh=mesh, in_specs=(PS(None, "model"), PS("data"))).explain(
        np.ones((3, 16, 16), np.float32), np.ones((8, 16), np.float32)
    )
    runs = sum(c.count for c in plan.collectives)
    assert runs > len(plan.collectives)  # rows inside the 3-layer loop run 3 times a call
    assert f"in {runs} collectives ({len(plan.collectives)} distinct), " in str(plan), str(plan)


# ------------------------------------------------------------------------------ XLA's generators


def test_xla_generators_run_whole_by_their_rule_not_as_a_fallback(mesh):
    def noisy(key, x):
        _, bits = jax.lax.rng_bit_generator(key, x.shape, dtype=jnp.uint32)
        return x * (bits % 7).astype(x.dtype)

    key, x = np.arange(4, dtype=np.uint32), np.ones((8, 16), np.float32)
    step = sf.parallelize(noisy, mesh=mesh, in_specs=(PS(), PS("data")), out_specs=PS("data"))
    np.testing.assert_array_equal(np.asarray(step(key, x)), np.asarray(jax.jit(noisy)(key, x)))
    assert not step.explain(key, x).fallbacks
