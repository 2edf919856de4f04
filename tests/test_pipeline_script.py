"""benchmarks/pipeline.py end to end on the tiny preset (8 simulated CPU devices, conftest.py)."""

import json
import math

import pytest
from benchmark_scripts import load


@pytest.mark.slow
def test_pipeline_script_tiny(tmp_path, capsys):
    out = tmp_path / "pipeline.json"
    rows = load("pipeline").main(
        [
            "--preset",
            "tiny",
            "--schedules",
            "1f1b-fused",
            "--microbatches",
            "4",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--profile",
            "--out",
            str(out),
        ]
    )
    by = {r["config"]: r for r in rows}
    assert list(by) == ["fsdp", "pp8 1f1b-fused", "pp4xdp2 1f1b-fused", "pp4xfsdp2 1f1b-fused"]
    assert all(by[c]["status"] == "ok" for c in ("fsdp", "pp4xdp2 1f1b-fused", "pp4xfsdp2 1f1b-fused")), rows
    assert by["pp4xfsdp2 1f1b-fused"]["loss"] == pytest.approx(by["pp4xdp2 1f1b-fused"]["loss"], rel=1e-3)
    assert "does not split into pipeline.stages 8" in by["pp8 1f1b-fused"]["status"]  # 4 layers
    pp = by["pp4xdp2 1f1b-fused"]
    assert math.isfinite(pp["tokens_per_s"]) and pp["tokens_per_s"] > 0 and math.isfinite(pp["loss"])
    # tiny runs without remat: F = B = W = 1, a step of 3 on every stage, (m + p - 1) of them
    assert pp["predicted_bubble"] == pytest.approx(3 / 7)
    assert pp["measured_bubble"] is None and pp["idle"] is None  # traced, but a CPU trace has no GPU kernels
    printed = capsys.readouterr().out
    assert "x fsdp, bubble only" in printed and "0.571" in printed
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    # the cross-host model on that measurement: 4 hosts of 2 (the pp4 x dp2 row has 4 stages)
    hosts = load("pipeline_hosts").main(
        [str(out), "--hosts", "4", "--gpus-per-host", "2", "--nic-gbps", "400", "--config", "pp4xdp2 1f1b-fused"]
    )
    (here,) = [h for h in hosts if h["tokens_per_gpu"] == 16 * 128 / 8]
    assert here["microbatches"] == 4 and here["fsdp_s"] >= by["fsdp"]["step_s"]
    assert here["pp_s"] > pp["step_s"]  # the hand-offs now cross hosts, at 50 GB/s


def test_idle_fraction_counts_the_time_no_compute_kernel_runs():
    idle_fraction = load("pipeline").idle_fraction
    kernels = [
        (0, 40, "gemm"),
        (30, 50, "fusion"),  # compute 0-50
        (50, 70, "ncclDevKernel_SendRecv"),  # only a collective: idle
        (80, 100, "gemm"),
        (85, 90, "ncclDevKernel_AllReduce"),
    ]
    # span 0-100; compute 0-50 and 80-100: 30 of 100 without compute
    assert idle_fraction(kernels) == pytest.approx(0.3)
    assert idle_fraction([(0, 10, "gemm"), (10, 20, "fusion")]) == 0.0
    # waits of at least 15: the 50-80 gap counts, the launch gaps of 1 below do not
    launches = kernels + [(100, 110, "gemm"), (111, 120, "fusion"), (121, 130, "gemm")]
    assert idle_fraction(launches) == pytest.approx(32 / 130)
    assert idle_fraction(launches, min_gap=15) == pytest.approx(30 / 130)


def test_the_cross_host_model_adds_what_crosses_hosts_and_nothing_else():
    predict = load("pipeline_hosts").predict
    measured = {
        "tokens_per_gpu": 4096,
        "fsdp_step_s": 1.0,
        "pp_step_s": 1.1,
        "seq": 1024,
        "stages": 2,
        "microbatches": 4,
    }
    same = dict(tokens_per_gpu=4096, nic=100e9, nvlink=100e9, had_data_axis=True)
    row = predict(measured, fsdp_bytes=50e9, pipe_bytes=5e9, inhost_bytes=1e9, **same)
    assert row["fsdp_s"] == 1.0 and row["pp_s"] == pytest.approx(1.1)  # links as fast as on one host
    slow = predict(measured, fsdp_bytes=50e9, pipe_bytes=5e9, inhost_bytes=1e9, **dict(same, nic=25e9))
    assert slow["fsdp_s"] == pytest.approx(2.0)  # 50 GB at 25 GB/s, overlapped
    assert slow["pp_s"] == pytest.approx(1.1 + 5 / 25 - 5 / 100)  # hand-offs not overlapped
    # a quarter of the tokens: one micro-batch of one sequence, lockstep bubble (1+1)/1 over (4+1)/4
    quarter = predict(measured, fsdp_bytes=50e9, pipe_bytes=5e9, inhost_bytes=1e9, **dict(same, tokens_per_gpu=512))
    assert quarter["microbatches"] == 1
    assert quarter["pp_s"] == pytest.approx(1.1 / 8 * (2 / (5 / 4)))
    assert quarter["fsdp_s"] == pytest.approx(0.5)  # the weights' bytes do not shrink
