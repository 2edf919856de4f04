"""Every notebook runs top to bottom in a fresh CPU-only `python` and prints what it has stored.

Each code cell runs as a reader's kernel would run it (the cells in order, one namespace, the
value of a cell's last expression shown), in one subprocess per notebook without the suite's
simulated devices (the notebook asks for its own) and without Jupyter. What each cell printed
to stdout is compared with the cell's stored "stream" outputs (stdout), and its last
expression's repr with the stored "execute_result" (text/plain), after the declared noise
below; stderr (warnings) is not compared. Any other difference fails: a notebook whose stored
outputs no longer match what it prints must be re-run and stored again:

    pip install nbclient ipykernel
    jupyter execute --inplace notebooks/tiny_model.ipynb    # in a shell without XLA_FLAGS

(the notebook's outputs were last stored this way, the cells' timing metadata then removed).

Declared noise:
- NOISE, a regex table applied to both texts first (temporary paths, wall-clock timings);
- a picture (display_data of image/png) is not compared: its pixels depend on the matplotlib
  version, and the code that draws it has its own test (test_schedules' draw test);
- an execute_result is compared with its whitespace collapsed (IPython pretty-prints a long
  list over several lines, repr on one);
- floats (a number with a decimal point) are compared numerically: |now - stored| <=
  max(RTOL * |stored|, one unit of the stored number's last printed digit), so a loss that
  moves in the 7th digit or crosses a rounding boundary passes, and one that moves in the
  4th significant digit fails. Integers (bytes, shapes, counts, line numbers) must be equal.
"""

import difflib
import json
import re
import textwrap
from pathlib import Path

import pytest
from test_docs import run_python

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

NOISE = [  # (regex, replacement)
    (r"[^\s('\"]*shardflow-notebook-\w+", "<tmpdir>"),  # tempfile.mkdtemp(prefix="shardflow-notebook-")
    (r"\b\d[\d,]*(?:\.\d+)?\s?(?:s/step|step/s|tok/s|min|ms|s)\b", "<time>"),  # wall clock
    (r"\btok_s=[\d,]+", "tok_s=<time>"),  # the trainer's throughput
]
RTOL = 1e-5
FLOAT = re.compile(r"[-+]?\d+\.(\d+)(?:[eE][-+]?\d+)?")

RUNNER = textwrap.dedent('''
    """Run a notebook's code cells as a kernel would; write what each printed and showed."""
    import ast, contextlib, io, json, sys

    cells = [c for c in json.load(open(sys.argv[1]))["cells"] if c["cell_type"] == "code"]
    namespace, shown = {"__name__": "__main__"}, []
    for i, cell in enumerate(cells):
        tree = ast.parse("".join(cell["source"]))
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(tree, f"<cell {i}>", "exec"), namespace)
            value = eval(compile(ast.Expression(last.value), f"<cell {i}>", "eval"),
                         namespace) if last else None
        shown.append({"stdout": out.getvalue(), "result": None if value is None else repr(value)})
        print(f"cell {i}: done", flush=True)
    json.dump(shown, open(sys.argv[2], "w"))
''')


def stored_outputs(cell) -> dict:
    stdout, result = "", None
    for output in cell.get("outputs", []):
        kind = output["output_type"]
        if kind == "stream":
            if output["name"] == "stdout":
                stdout += "".join(output["text"])
        elif kind == "execute_result":
            result = "".join(output["data"]["text/plain"])
        elif kind == "display_data" and set(output["data"]) <= {"image/png", "text/plain"}:
            continue  # a picture (a schedule's drawing): not compared, see the docstring
        else:  # an error, an image, a widget: nothing here knows how to compare it
            raise AssertionError(f"stored output of type {kind!r}: {str(output)[:300]}")
    return {"stdout": stdout, "result": result}


def differences(now: str | None, stored: str | None, collapse_whitespace=False) -> list[str]:
    """What differs between a cell's output now and its stored output, after the declared noise."""
    if now is None or stored is None:
        return [] if now is stored else [f"now {now!r}, stored {stored!r}"]
    for pattern, replacement in NOISE:
        now, stored = re.sub(pattern, replacement, now), re.sub(pattern, replacement, stored)
    if collapse_whitespace:
        now, stored = " ".join(now.split()), " ".join(stored.split())
    skeleton_now, skeleton_stored = FLOAT.sub("<float>", now), FLOAT.sub("<float>", stored)
    if skeleton_now != skeleton_stored:
        return [
            f"  {line}"
            for line in difflib.unified_diff(
                skeleton_stored.splitlines(), skeleton_now.splitlines(), "stored", "now", n=0, lineterm=""
            )
        ] or [f"  now:    {skeleton_now!r}\n  stored: {skeleton_stored!r}"]
    out = []
    for a, b in zip(FLOAT.finditer(now), FLOAT.finditer(stored)):
        x, y = float(a.group(0)), float(b.group(0))
        if not abs(x - y) <= max(RTOL * abs(y), 10.0 ** -len(b.group(1))):
            out.append(f"  {a.group(0)} now, {b.group(0)} stored")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_prints_its_stored_outputs(path, tmp_path):
    (tmp_path / "run_notebook.py").write_text(RUNNER)
    done = run_python(tmp_path / "run_notebook.py", tmp_path, args=[str(path), str(tmp_path / "shown.json")])
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout[-500:]}\n{done.stderr[-6000:]}"
    shown = json.loads((tmp_path / "shown.json").read_text())
    code = [(i, c) for i, c in enumerate(json.loads(path.read_text())["cells"]) if c["cell_type"] == "code"]
    report = []
    for (i, cell), now in zip(code, shown):
        stored = stored_outputs(cell)
        for what, collapse in (("stdout", False), ("result", True)):
            bad = differences(now[what], stored[what], collapse)
            if bad:
                report.append(f"cell {i} {what}:\n" + "\n".join(bad))
    assert not report, (
        f"{path.name}: stored outputs differ from a fresh run (re-run and store "
        "them, see this test's docstring):\n" + "\n".join(report)
    )


def test_the_comparison_catches_drift_and_allows_declared_noise():
    assert not differences(
        "resumed (/tmp/shardflow-notebook-ab_1/checkpoints)\n",
        "resumed (/var/tmp/shardflow-notebook-q7o/checkpoints)\n",
    )
    assert not differences("(5.4922695, 5.492269992828369)", "(5.492269992828369, 5.492269992828369)")
    assert not differences("{10: 3.907}", "{10: 3.906}")  # a rounding boundary
    assert differences("{10: 3.909}", "{10: 3.906}")  # two units of the last digit
    assert differences("5.4925", "5.492269992828369")  # the 4th decimal
    assert differences("98,304 bytes", "98,305 bytes")  # integers are exact
    assert differences("loop.py:95", "_classification.py:400")  # explain's source column
    assert not differences(
        "[CpuDevice(id=0),\n CpuDevice(id=1)]", "[CpuDevice(id=0), CpuDevice(id=1)]", collapse_whitespace=True
    )
    assert differences("x\n", None) and not differences(None, None)
