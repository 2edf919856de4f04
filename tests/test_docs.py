"""Every Python block of README.md and docs/*.md runs as written, in a fresh CPU-only `python`.

The convention for fenced blocks in those files:

- A ```python block runs. A file's blocks run in order, concatenated, in one fresh `python`
  subprocess per file (a later block may use the names of an earlier one, as a reader pasting
  them would). The subprocess gets none of the suite's simulated devices (conftest's XLA_FLAGS
  device count is removed), so a block that needs 8 devices asks for them itself with
  `jax.config.update("jax_num_cpu_devices", 8)`, as on the CPU-only machine the quickstart
  targets. Line numbers in a failure are the Markdown file's own (the lines between blocks
  are blank in the script).
- A ```python block on the line after `<!-- excerpt: PATH -->` quotes PATH (a path in the
  repository) and does not run; each of its lines must be a line of PATH, compared without
  leading and trailing whitespace, so the quotation cannot go stale.
- Every other fence (```text, ```bash, a bare ```) is not run.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->\n$")


def blocks(path: Path):
    """(first line number, language, excerpt path or None, code) of each fenced block."""
    text = path.read_text()
    for m in FENCE.finditer(text):
        before = text[:m.start()]
        excerpt = EXCERPT.search(before[-300:])
        yield (before.count("\n") + 2, m.group(1), excerpt and excerpt.group(1), m.group(2))


def runnable(path: Path):
    return [(line, code) for line, lang, excerpt, code in blocks(path)
            if lang == "python" and excerpt is None]


def cpu_only_env(devices: int | None = None) -> dict:
    """The environment of a fresh `python` on a CPU-only machine: no forced device count, or
    ``devices`` simulated ones (the suite's other XLA flags kept)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.pop("XLA_FLAGS", ""))
    if devices is not None:
        flags += f" --xla_force_host_platform_device_count={devices}"
    if flags.strip():
        env["XLA_FLAGS"] = flags.strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_python(script: Path, cwd: Path, args=(), timeout: float = 600) -> subprocess.CompletedProcess:
    """`python script args...` in cwd (script's folder), a fresh process on a CPU-only machine."""
    return subprocess.run([sys.executable, script.name, *args], cwd=cwd, env=cpu_only_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_the_convention_finds_every_python_block():
    """The parser sees every ```python fence (one it missed would silently not run)."""
    for p in DOCS:
        python = [b for b in blocks(p) if b[1] == "python"]
        assert len(python) == p.read_text().count("```python"), p.name
    assert len(runnable(DOCS[0])) >= 2  # README's usage and models blocks


@pytest.mark.parametrize("path", [p for p in DOCS if runnable(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_in_a_fresh_process(path, tmp_path):
    lines = [""] * path.read_text().count("\n")
    for first, code in runnable(path):
        for i, source_line in enumerate(code.splitlines()):
            lines[first - 1 + i] = source_line
    script = tmp_path / f"{path.name}.py"
    script.write_text("\n".join(lines) + "\n")
    done = run_python(script, tmp_path)
    assert done.returncode == 0, f"{path.name}'s Python blocks failed:\n{done.stderr[-6000:]}"


@pytest.mark.parametrize("path,line,excerpt,code", [
    pytest.param(p, line, e, code, id=f"{p.name}:{line}")
    for p in DOCS for line, _, e, code in blocks(p) if e])
def test_excerpts_quote_the_file_they_name(path, line, excerpt, code):
    source = {l.strip() for l in (ROOT / excerpt).read_text().splitlines()}
    missing = [l for l in code.splitlines() if l.strip() and l.strip() not in source]
    assert not missing, f"{path.name}:{line} quotes {excerpt}, which has no line {missing}"
