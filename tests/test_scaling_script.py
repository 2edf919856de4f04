"""benchmarks/scaling.py end to end on the tiny preset (8 simulated CPU devices, conftest.py)."""
import json
import math

from benchmark_scripts import load


def load_script():
    return load("scaling")


def test_scaling_tiny_tp_both_engines(tmp_path):
    out = tmp_path / "scaling.json"
    rows = load_script().main(["--preset", "tiny", "--strategies", "tp", "--steps", "1",
                               "--warmup", "1", "--batch", "1", "--seq", "64", "--out", str(out)])
    assert [(r["strategy"], r["engine"]) for r in rows] == [
        ("1-device", "shardflow"), ("1-device", "jit"), ("tp", "shardflow"), ("tp", "jit")]
    for r in rows:
        assert r["status"] == "ok", r
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert math.isfinite(r["loss"]) and r["mfu"] is None  # CPU: no known peak
    tp = rows[2]
    # tiny has 4 kv heads: 8-way TP does not divide them, so the model axis shrinks to 4.
    assert tp["mesh"] == {"data": 2, "model": 4} and tp["global_batch"] == 2
    assert math.isfinite(tp["weak_scaling_eff"]) and math.isfinite(tp["shardflow_over_jit"])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))


def test_meshes():
    scaling = load_script()
    assert scaling.candidate_meshes("fsdp", 8, 2) == [{"data": 8}]
    assert scaling.candidate_meshes("tp", 8, 2)[0] == {"data": 1, "model": 8}
    assert scaling.candidate_meshes("2d", 8, 2) == [{"data": 4, "model": 2}]
    assert scaling.candidate_meshes("tp_sp", 1, 2) == [{"data": 1, "model": 1}]
