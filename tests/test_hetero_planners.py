"""benchmarks/hetero_planners.py's re-implemented baselines: their memoised pricing equals the
simulator's, their plans fit, their pieces (splits, Metis's device groups) are well formed, and on
a small cluster our planner is at least as fast as AMP, whose uniform plans lie inside its space."""

import pytest
from benchmark_scripts import load

from shardflow.hetero import Cluster, Framework, Transformer, search, simulate

hp = load("hetero_planners")
hb = load("_hetero_baselines")  # the baselines and their pieces
FW = Framework(efficiency={"*": 0.5})
SMALL = Transformer(n_layers=6, d_model=1024, n_heads=16, head_dim=64, ffn_dim=4096, vocab_size=8192, seq_len=1024)


@pytest.fixture(scope="module")
def cluster():
    return Cluster.from_inventory({"H100": 2, "A100-40GB": 2}, per_node=2)


def test_pieces():
    assert hb.largest_remainder(10, [1, 1, 2]) == [3, 3, 4]
    assert sum(hb.largest_remainder(24, [3.0, 1.0, 0.5])) == 24
    assert hb.minmax_split(lambda s, n: n * (1 if s == 0 else 3), 8, 2) == [6, 2]
    for stages in (1, 3, 5):
        for groups in hb._stage_group_orders(16, stages, 1.0, 4):
            assert len(groups) == stages and sum(groups) == 16
            assert all(g & (g - 1) == 0 and g >= 16 // stages for g in groups)


@pytest.mark.parametrize("name", list(hp.PLANNERS))
def test_baselines_price_as_simulate_and_fit(cluster, name):
    keeper = hp.Keeper(SMALL, cluster, FW)
    assert hp.PLANNERS[name](keeper, 8) > 0
    seconds, plan = keeper.best
    pred = simulate(SMALL, cluster, plan, FW)
    assert pred.seconds == pytest.approx(seconds, rel=1e-12)
    assert all(m <= keeper.capacity[s.kind] for p, ms in zip(plan.pipelines, pred.memory) for s, m in zip(p.stages, ms))
    assert plan.global_batch == 8


def test_ours_at_least_amp_on_a_small_cluster(cluster):
    ours = search(SMALL, cluster, 8, FW, precision=hp.PRECISION, top=1).best.seconds
    for variant in ("AMP", "AMP-kind-aware"):
        keeper = hp.Keeper(SMALL, cluster, FW)
        hp.PLANNERS[variant](keeper, 8)
        assert ours <= keeper.best[0] * (1 + 1e-9)
