"""benchmarks/hetero_emulated.py: the emulated slow replicas' extra load changes nothing the step
computes, and on a cluster with a slower kind the planner's data-parallel plan gives the faster
replicas more micro-batches than the even split, predicted faster."""

import contextlib
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import hetero_emulated as emulated  # noqa: E402

from shardflow import train  # noqa: E402
from shardflow.predication import predicated_p  # noqa: E402
from shardflow.program import all_eqns  # noqa: E402
from shardflow.train import uneven  # noqa: E402


def test_the_extra_load_changes_nothing_the_step_computes():
    """Two replicas, the second loaded: the loaded step runs a second predicated region per
    slot (on the slow replica's rows), and its loss and gradient norm are the unloaded step's."""
    assert emulated.slow_rows(2, 2, {1}) == [False, False, True, True]
    run = emulated.setup("tiny", 64, "none", jax.devices()[:2], [3, 1], 2)
    batch = emulated.batch_of(run)
    state = jax.eval_shape(lambda: train.init_state(run))
    regions = []
    for load in (contextlib.nullcontext(), emulated.loaded(emulated.slow_rows(2, 2, {1}), 0.5)):
        with load:  # a step made afresh: JAX caches a scan body's trace by its function
            step = uneven.make_train_step(run.graphdef, run.optimizer, run.cfg.compute_dtype)
            jaxpr = jax.make_jaxpr(step)(*state, batch).jaxpr
            regions.append(sum(eqn.primitive is predicated_p for eqn in all_eqns(jaxpr)))
    assert regions[1] == 2 * regions[0] > 0
    plain = emulated.timed_step(run, set(), 0.5, steps=1, warmup=0)
    loaded = emulated.timed_step(run, {1}, 0.5, steps=1, warmup=0)
    np.testing.assert_allclose(loaded[1:], plain[1:], rtol=1e-6)


@pytest.mark.parametrize("slow", [{1}, {2, 3}])
def test_the_planner_gives_slower_replicas_fewer_micro_batches(slow):
    from shardflow.train import config

    cfg = config.Config()
    cfg.model, cfg.data.seq_len = {"preset": "1b", "remat": "none"}, 2048
    counts, predicted = emulated.plans(cfg, "H100", 1.5, 4, slow, 32, 2)
    assert counts["even"] == [4, 4, 4, 4]
    assert sum(counts["plan"]) == 16
    fast = [c for r, c in enumerate(counts["plan"]) if r not in slow]
    assert min(fast) > max(c for r, c in enumerate(counts["plan"]) if r in slow)
    assert predicted["plan"].seconds < predicted["even"].seconds
