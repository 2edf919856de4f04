"""The raw JSON a benchmark writes beside its results table: ``{"meta": ..., "rows": [...]}``.

``meta`` says what the figures were measured on: the date, the commit, the devices (kind and
count), the jax version and the full command line. The commit is read when the script starts
(the code it runs), not when it writes. On a machine whose checkout has no git metadata, set
SHARDFLOW_COMMIT to the commit the tree was copied from.
"""

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's commit, with "-dirty" when tracked files differ from it; SHARDFLOW_COMMIT
    when set; "unknown" without either."""
    if os.environ.get("SHARDFLOW_COMMIT"):
        return os.environ["SHARDFLOW_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


STARTED_AT_COMMIT = commit()


def run_meta(**extra) -> dict:
    import jax

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": STARTED_AT_COMMIT,
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }
    meta.update(extra)
    return meta


def write_json(path, rows, **extra) -> None:
    """``rows`` under this run's ``meta`` (with ``extra`` added to it)."""
    with open(path, "w") as f:
        json.dump({"meta": run_meta(**extra), "rows": rows}, f, indent=1)
