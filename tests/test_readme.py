"""The README's usage example runs as written and does what it says."""

import pathlib
import re

import pytest
from test_docs import run_python

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_usage_example_runs(tmp_path):
    """Saved as train.py and run by a fresh `python` on a CPU-only machine (no device count in
    the environment: the block's own jax_num_cpu_devices line gives it 8), it prints the plan
    the README shows, line for line, and a finite loss."""
    text = README.read_text()
    block = re.search(r"## Usage\s+.*?```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "train.py").write_text(block + "\nimport math\nassert math.isfinite(float(l)), l\n")
    done = run_python(tmp_path / "train.py", tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    printed = done.stdout
    assert "all_reduce" in printed and "total:" in printed
    shown = re.search(r"\n```\n(kind .*?\ntotal: .*?)\n```", text, re.S).group(1)
    assert printed.splitlines()[: len(shown.splitlines())] == shown.splitlines()


def test_quickstart_test_command_is_what_ci_runs():
    quickstart = re.search(r"## Quickstart\s+```bash\n(.*?)```", README.read_text(), re.S).group(1)
    test_command = quickstart.strip().splitlines()[1].split("&&")[1].strip()
    ci = (README.parent / ".ci" / "run").read_text()
    assert test_command in ci
