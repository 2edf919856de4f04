"""The README's two quickstart commands, timed: the main job and the test suite.

    python benchmarks/quickstart.py --out quickstart.json            # the main job
    python benchmarks/quickstart.py --suite --out quickstart.json    # and the test suite

The main job is `shardflow train` with no arguments, run in a fresh temporary directory (so
its default `runs/default` starts empty); its first and last logged losses come from that run's
metrics.jsonl, and `shardflow sample --checkpoint runs/default` then generates from its last
checkpoint (the text is recorded, its time is not part of the main job's). The suite is the README's test command,
run from the repository root. Both are wall-clock times of the whole command, on whatever else the machine is doing:
the JSON records
the machine's core count and its load average before and after each command.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = [sys.executable, "-m", "pytest", "-q", "-n", "2", "tests"]


def timed(cmd, cwd) -> dict:
    load_before = os.getloadavg()
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return {
        "command": shlex.join(cmd),
        "returncode": done.returncode,
        "seconds": round(seconds, 1),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "output_tail": (done.stdout + done.stderr)[-2000:],
    }


def main_job() -> dict:
    with tempfile.TemporaryDirectory() as cwd:
        row = timed(["shardflow", "train"], cwd)
        sampled = subprocess.run(
            [
                "shardflow",
                "sample",
                "--checkpoint",
                "runs/default",
                "--prompt",
                "def ",
                "--max-new-tokens",
                "64",
                "--seed",
                "0",
            ],
            cwd=cwd,
            capture_output=True,
            text=True,
        )
        logged = [json.loads(line) for line in (Path(cwd) / "runs/default/metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in logged if "loss" in r]
    row |= {
        "name": "main job",
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "sample": {"returncode": sampled.returncode, "text": sampled.stdout, "stderr_tail": sampled.stderr[-500:]},
    }
    return row


def suite() -> dict:
    row = timed(SUITE, ROOT) | {"name": "test suite"}
    summary = re.findall(r"^=* ?((?:\d+ \w+, )*\d+ passed.*? in [\d.]+s.*?) ?=*$", row["output_tail"], re.M)
    row["summary"] = summary[-1] if summary else None
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="store_true", help="also time the test suite")
    parser.add_argument("--out", help="write the rows and the run's provenance to this JSON file")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = [main_job()] + ([suite()] if args.suite else [])
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    import jax

    meta = {
        "date": started,
        "commit": commit,
        "command": shlex.join([sys.executable, *sys.argv]),
        "jax": jax.__version__,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
    }
    for r in rows:
        extra = (
            f"loss {r['first_loss'][1]:.3f} -> {r['last_loss'][1]:.3f} at step {r['last_loss'][0]}"
            if "last_loss" in r
            else r.get("summary")
        )
        print(
            f"{r['name']:<11} {r['seconds']:>7.1f} s  rc {r['returncode']}  {extra}  "
            f"load {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
