"""benchmarks/context.py end to end on tiny shapes (simulated CPU devices): every variant runs
and reports its time and ratio to one device."""
import importlib.util
import json
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "context.py"


def test_every_variant_runs_on_the_cpu_check(tmp_path):
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("context_benchmark", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "context.json"
    rows = script.main(["--cpu-check", "--steps", "1", "--warmup", "0", "--out", str(out)])
    assert [r["variant"] for r in rows] == ["one device", *script.VARIANTS]
    for r in rows:
        assert r["status"] == "ok", r
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and math.isfinite(r["ratio"])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
