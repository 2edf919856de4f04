"""The README's usage example runs as written and does what it says."""
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs(capsys):
    text = README.read_text()
    block = re.search(r"## Usage\s+```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "all_reduce" in printed and "total:" in printed
    assert np.isfinite(float(namespace["l"]))


def test_quickstart_test_command_is_what_ci_runs():
    quickstart = re.search(r"## Quickstart\s+```bash\n(.*?)```", README.read_text(), re.S).group(1)
    test_command = quickstart.strip().splitlines()[1].split("&&")[1].strip()
    ci = (README.parent / ".ci" / "run").read_text()
    assert test_command in ci
