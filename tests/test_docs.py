"""README.md and docs/**/*.md say what the code does: every Python block runs as written, alone,
in a fresh CPU-only `python`; what a block shows it prints, it prints; every relative link
leads to a file; every trainer config key is in the config reference.

The convention for fenced blocks in those files:

- A ```python block runs on its own: saved as example.py in an empty folder and run by a fresh
  `python` subprocess, one per block, as a reader pasting it into a file would. The subprocess
  gets none of the suite's simulated devices (conftest's XLA_FLAGS device count is removed), so
  a block that needs 8 devices asks for them itself with
  `jax.config.update("jax_num_cpu_devices", 8)`, as on a CPU-only machine. A failure names the
  Markdown file and the line where the block starts.
- A ```text block that follows a running ```python block (nothing but blank lines between them)
  is what that block prints: its standard output must be exactly that text.
- A ```python block on the line after `<!-- excerpt: PATH -->` quotes PATH (a path in the
  repository) and does not run; each of its lines must be a line of PATH, compared without
  leading and trailing whitespace, so the quotation cannot go stale.
- Every other fence (```text, ```bash, ```yaml, a bare ```) is not run.
"""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CONFIG_REFERENCE = ROOT / "docs" / "reference" / "config.md"
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->\n$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the Markdown line of the block's first line of code
    lang: str
    excerpt: str | None  # the quoted file's path, for an excerpt
    code: str
    prints: str | None  # the ```text block right after it, if any

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order."""
    text = path.read_text()
    found = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(found):
        before = text[: m.start()]
        excerpt = EXCERPT.search(before[-300:])
        after = found[i + 1] if i + 1 < len(found) else None
        prints = (
            after.group(2) if after and after.group(1) == "text" and not text[m.end() : after.start()].strip() else None
        )
        out.append(Block(path, before.count("\n") + 2, m.group(1), excerpt and excerpt.group(1), m.group(2), prints))
    return out


def runnable(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang == "python" and b.excerpt is None]


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
    return subprocess.run(
        [sys.executable, script.name, *args],
        cwd=cwd,
        env=cpu_only_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_convention_finds_every_python_block():
    """The parser sees every ```python fence (one it missed would silently not run), and the
    docs tree is where the glob looks."""
    for p in DOCS:
        python = [b for b in blocks(p) if b.lang == "python"]
        assert len(python) == p.read_text().count("```python"), p.name
    assert runnable(DOCS[0])  # README's usage example
    assert CONFIG_REFERENCE in DOCS and any(p.parent.name == "tutorials" for p in DOCS)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for p in DOCS for b in runnable(p)], ids=lambda b: b.name)
def test_python_block_runs_alone(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block.code)
    done = run_python(script, tmp_path)
    assert done.returncode == 0, (
        f"{block.name}: the block starting on this line failed (its line N is the "
        f"file's line {block.line} + N - 1):\n{done.stderr[-6000:]}"
    )
    if block.prints is not None:
        assert done.stdout == block.prints, (
            f"{block.name}: the block prints\n{done.stdout}\nwhere the text block after it shows\n{block.prints}"
        )


@pytest.mark.parametrize("block", [b for p in DOCS for b in blocks(p) if b.excerpt], ids=lambda b: b.name)
def test_excerpts_quote_the_file_they_name(block):
    source = {l.strip() for l in (ROOT / block.excerpt).read_text().splitlines()}
    missing = [l for l in block.code.splitlines() if l.strip() and l.strip() not in source]
    assert not missing, f"{block.name} quotes {block.excerpt}, which has no line {missing}"


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link of ``path`` outside fenced blocks."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    return [
        (text[: m.start()].count("\n") + 1, m.group(1))
        for m in LINK.finditer(text)
        if not re.match(r"[a-z][a-z0-9+.-]*:", m.group(1)) and not m.group(1).startswith("#")
    ]


def test_links_find_their_files():
    broken = [
        f"{p.relative_to(ROOT)}:{line}: {target}"
        for p in DOCS
        for line, target in links(p)
        if not (p.parent / target.split("#")[0]).exists()
    ]
    assert not broken, "relative links to no file:\n" + "\n".join(broken)


def trainer_config_keys() -> list[str]:
    """Every key `shardflow train` accepts, dotted: the Config dataclass's fields and their
    sections', and `model.preset` with every ModelConfig field under `model.`."""
    from shardflow.models import ModelConfig
    from shardflow.train.config import Config

    def keys(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from keys(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    return [*keys(Config(), ""), "model.preset", *(f"model.{f.name}" for f in dataclasses.fields(ModelConfig))]


def test_the_config_reference_names_every_key():
    keys = trainer_config_keys()
    assert "pipeline.schedule" in keys and "model.context" in keys and "planner" in keys
    reference = CONFIG_REFERENCE.read_text()
    missing = [k for k in keys if f"`{k}`" not in reference]
    assert not missing, f"{CONFIG_REFERENCE.relative_to(ROOT)} does not name these config keys: {missing}"
