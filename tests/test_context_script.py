"""benchmarks/context.py end to end on tiny shapes (simulated CPU devices): every variant runs
and reports its time and ratio to one device."""

import json
import math

import pytest
from benchmark_scripts import load


def load_script():
    return load("context")


@pytest.mark.slow
def test_every_variant_runs_on_the_cpu_check(tmp_path):
    script = load_script()
    out = tmp_path / "context.json"
    rows = script.main(["--cpu-check", "--steps", "1", "--warmup", "0", "--out", str(out)])
    assert [r["variant"] for r in rows] == ["one device", *script.VARIANTS]
    for r in rows:
        assert r["status"] == "ok", r
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and math.isfinite(r["ratio"])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))


@pytest.mark.slow
def test_training_rows_report_each_variants_compiled_memory(tmp_path):
    """--train on the CPU check: the tiny preset's step per variant, each with its own compiled
    bytes per device (XLA's account of that program, not the process's allocator peak, which
    only grows from one variant to the next). At these sizes the variants differ by kilobytes
    (all-gather 72,499,136 B, ring 72,455,064 on XLA:CPU): only that each is reported is checked."""
    script = load_script()
    rows = script.main(
        [
            "--cpu-check",
            "--train",
            "--variants",
            "all_gather,ring",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--out",
            str(tmp_path / "train.json"),
        ]
    )
    assert [(r["variant"], r["status"]) for r in rows] == [("all_gather", "ok"), ("ring", "ok")]
    assert all(0 < r["compiled_gb"] < 1 for r in rows)
