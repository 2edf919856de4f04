"""sf.alternatives: what the next-best annotations of a parallelized step would cost."""

import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardflow as sf
from shardflow.specs import to_sbp


def mlp(x, w1, w2):
    return jnp.sum(jnp.tanh(x @ w1) @ w2)


ARGS = (np.ones((64, 256), np.float32), np.ones((256, 1024), np.float32), np.ones((1024, 256), np.float32))
ROW_SPLIT_W1 = (P("data"), P("model", None), P(None, "model"))  # w1 split on its contracting dim


@pytest.fixture
def mesh():
    return sf.make_mesh({"data": 2, "model": 4})


def every_layout(shape, sizes):
    """Independently of the code under test: each axis on one dim or none, kept where the
    blocks divide, as NdSbp."""
    out = set()
    for dims in itertools.product([None, *range(len(shape))], repeat=len(sizes)):
        ways = [math.prod(n for (a, n), d in zip(sizes.items(), dims) if d == dim) for dim in range(len(shape))]
        if all(s % w == 0 for s, w in zip(shape, ways)):
            out.add(tuple(sf.B if d is None else sf.S(d) for d in dims))
    return out


@pytest.mark.parametrize("passes", ["DEFAULT", "SOLVER"])
def test_every_other_layout_of_an_argument_is_planned_and_ranked(mesh, passes):
    step = sf.parallelize(mlp, mesh=mesh, in_specs=ROW_SPLIT_W1, out_specs=P(), passes=getattr(sf.passes, passes))
    given = step.explain(*ARGS).modelled_seconds
    found = sf.alternatives(step, *ARGS, only=r"args\[1\]", top=None)
    assert {a.argument for a in found} == {"args[1]"}
    layouts = {to_sbp(a.spec, mesh, 2) for a in found}
    assert len(layouts) == len(found)
    assert layouts == every_layout(ARGS[1].shape, {"data": 2, "model": 4}) - {to_sbp(ROW_SPLIT_W1[1], mesh, 2)}
    assert [a.seconds for a in found] == sorted(a.seconds for a in found)
    for a in found[:3]:  # each figure is that annotation's own plan
        specs = list(ROW_SPLIT_W1)
        specs[1] = a.spec
        again = sf.parallelize(mlp, mesh=mesh, in_specs=tuple(specs), out_specs=P(), passes=getattr(sf.passes, passes))
        assert a.seconds == pytest.approx(again.explain(*ARGS).modelled_seconds)
        assert a.delta == pytest.approx(a.seconds - given)
    # Megatron's column split of w1 needs no collective in the forward: cheaper than splitting
    # the contracting dim, whose partial sums must be reduced before the tanh.
    megatron = next(a for a in found if to_sbp(a.spec, mesh, 2) == (sf.B, sf.S(1)))
    assert megatron.delta < 0


def test_top_keeps_the_best_across_arguments(mesh):
    step = sf.parallelize(mlp, mesh=mesh, in_specs=ROW_SPLIT_W1, out_specs=P())
    every = sf.alternatives(step, *ARGS, top=None)
    assert {a.argument for a in every} == {"args[0]", "args[1]", "args[2]"}
    assert sf.alternatives(step, *ARGS, top=5) == every[:5]


def test_auto_arguments_are_the_solvers_and_not_varied(mesh):
    step = sf.parallelize(
        mlp, mesh=mesh, in_specs=(P("data"), P(None, "model"), sf.AUTO), out_specs=P(), passes=sf.passes.SOLVER
    )
    assert {a.argument for a in sf.alternatives(step, *ARGS, top=None)} == {"args[0]", "args[1]"}


def test_an_annotation_over_the_memory_budget_is_listed_as_refused_last(mesh):
    pinned = sf.parallelize(mlp, mesh=mesh, in_specs=ROW_SPLIT_W1, out_specs=P(), passes=sf.passes.SOLVER)
    budget = pinned.explain(*ARGS).memory_bytes
    step = sf.parallelize(
        mlp, mesh=mesh, in_specs=ROW_SPLIT_W1, out_specs=P(), passes=sf.passes.SOLVER, memory_budget=budget
    )
    found = sf.alternatives(step, *ARGS, only=r"args\[1\]", top=None)
    refused = [a for a in found if a.refused]
    whole = next(a for a in refused if to_sbp(a.spec, mesh, 2) == (sf.B, sf.B))
    assert "memory_budget" in whole.refused and whole.seconds == math.inf and "refused" in str(whole)
    assert found[-len(refused) :] == refused
    assert all(a.memory_bytes <= budget for a in found if not a.refused)


@pytest.mark.parametrize(
    "delta, shown",
    [
        (0.0, "(same as the step)"),
        (-1e-9, "(same as the step)"),
        (4e-10, "(same as the step)"),
        (2e-6, "(+0.002 ms)"),
        (-3.5e-5, "(-0.035 ms)"),
    ],
)
def test_a_difference_prints_as_its_sign_says(delta, shown):
    line = str(sf.Alternative("args[1]", P("model"), 1e-3 + delta, delta, 4096))
    assert line == f"args[1]: {P('model')}  {(1e-3 + delta) * 1e3:.3f} ms modelled {shown}, 4,096 bytes per device"
    assert "-0.000" not in line


def test_only_names_an_argument_as_a_regular_expression(mesh):
    step = sf.parallelize(mlp, mesh=mesh, in_specs=ROW_SPLIT_W1, out_specs=P())
    assert {a.argument for a in sf.alternatives(step, *ARGS, only=r"args\[[12]\]", top=None)} == {"args[1]", "args[2]"}
    with pytest.raises(
        sf.ShardingError,
        match=r"only='args\[1\]' matches no argument; the arguments whose "
        r"annotations can vary are args\[0\], args\[1\], args\[2\]",
    ):
        sf.alternatives(step, *ARGS, only="args[1]")
    with pytest.raises(sf.ShardingError, match=r"only='w\(' is not a regular expression \(missing \)"):
        sf.alternatives(step, *ARGS, only="w(")
