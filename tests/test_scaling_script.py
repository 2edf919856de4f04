"""benchmarks/scaling.py end to end on the tiny preset (8 simulated CPU devices, conftest.py)."""

import json
import math

import pytest
from benchmark_scripts import load


def load_script():
    return load("scaling")


@pytest.mark.slow
def test_scaling_tiny_tp_both_engines(tmp_path):
    out = tmp_path / "scaling.json"
    rows = load_script().main(
        [
            "--preset",
            "tiny",
            "--strategies",
            "tp",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--batch",
            "1",
            "--seq",
            "64",
            "--out",
            str(out),
        ]
    )
    assert [(r["strategy"], r["engine"]) for r in rows] == [
        ("1-device", "shardflow"),
        ("1-device", "jit"),
        ("tp", "shardflow"),
        ("tp", "jit"),
    ]
    for r in rows:
        assert r["status"] == "ok", r
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert math.isfinite(r["loss"]) and r["mfu"] is None  # CPU: no known peak
    # a strategy's first step runs from the same state on the same batch in both engines
    for ours, jits in (rows[:2], rows[2:]):
        assert math.isclose(ours["first_loss"], jits["first_loss"], rel_tol=1e-3), (ours, jits)
    tp = rows[2]
    # tiny has 4 kv heads: 8-way TP does not divide them, so the model axis shrinks to 4.
    assert tp["mesh"] == {"data": 2, "model": 4} and tp["global_batch"] == 2
    assert math.isfinite(tp["weak_scaling_eff"]) and math.isfinite(tp["shardflow_over_jit"])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))


@pytest.mark.slow
def test_the_unrolled_engine_runs_the_same_step(monkeypatch):
    """shardflow-unrolled: the fsdp step's layer loops, whose bodies gather, lowered unrolled;
    its first step's loss is the rolled engine's."""
    from shardflow import registry
    from shardflow.passes import lower

    apart = []  # per loop lowered: unrolled apart (its body communicates), or not
    loop_region = lower.Local.loop_region
    monkeypatch.setattr(
        lower.Local,
        "loop_region",
        lambda self, eqn, *a: apart.append(registry.decision_of(eqn).apart) or loop_region(self, eqn, *a),
    )
    args = ["--preset", "tiny", "--strategies", "fsdp", "--engines", "shardflow,shardflow-unrolled"]
    rows = load_script().main(args + ["--steps", "1", "--warmup", "1", "--batch", "1", "--seq", "64"])
    assert [(r["strategy"], r["engine"], r["status"]) for r in rows] == [
        ("1-device", "shardflow", "ok"),
        ("fsdp", "shardflow", "ok"),
        ("fsdp", "shardflow-unrolled", "ok"),
    ]
    assert math.isclose(rows[1]["first_loss"], rows[2]["first_loss"], rel_tol=1e-5)
    assert True in apart and False in apart


def test_meshes():
    scaling = load_script()
    assert scaling.candidate_meshes("fsdp", 8, 2) == [{"data": 8}]
    assert scaling.candidate_meshes("tp", 8, 2)[0] == {"data": 1, "model": 8}
    assert scaling.candidate_meshes("2d", 8, 2) == [{"data": 4, "model": 2}]
    assert scaling.candidate_meshes("tp_sp", 1, 2) == [{"data": 1, "model": 1}]


def test_kernel_time_splits_nccl_by_collective_and_counts_its_exposed_time(monkeypatch):
    """A profiled step's NCCL time by collective (from the kernel names), and the time an NCCL
    kernel runs with nothing else beside it (ns, one GPU)."""
    scaling = load_script()
    kernels = [
        (0, 100, "nvjet_gemm"),
        (50, 150, "ncclDevKernel_AllGather_RING_LL"),
        (150, 170, "ncclDevKernel_ReduceScatter_RING_LL"),
        (170, 200, "loop_add_fusion"),
        (200, 240, "ncclDevKernel_SendRecv"),
    ]
    monkeypatch.setattr(scaling, "traced_kernels", lambda *args: [kernels])
    (g,) = scaling.kernel_time(None, None, None, None)["kernel_time_per_gpu"]
    assert g["nccl_ms_by_kind"] == {"AllGather": 1e-4, "SendRecv": 4e-5, "ReduceScatter": 2e-5}
    assert math.isclose(g["nccl_exposed_ms"], (50 + 20 + 40) / 1e6)
    assert math.isclose(g["nccl_ms"], 1.6e-4) and math.isclose(g["span_ms"], 2.4e-4)
