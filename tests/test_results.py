"""The headline results tables (README.md's and benchmarks/results/README.md's): every ratio is
the raw JSON's figure, rounded to the digits printed.

A table with the header `| metric | ratio | device | date | raw |` is a headline table. Its raw
cell links the raw JSON, relative to the markdown file, and the link's fragment says where the
ratio comes from: a JSON pointer (RFC 6901) to a number, or two pointers joined by `÷` for
their quotient.
"""

import json
import re
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS_INDEX = ROOT / "benchmarks" / "results" / "README.md"
HEADER = ["metric", "ratio", "device", "date", "raw"]
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)#([^)\s]+)\)")
RATIO = re.compile(r"^\**(\d+(?:\.(\d+))?)×\**$")


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def headline_rows(markdown: Path) -> list[dict]:
    """Each headline table row of ``markdown``: its cells by column name and its line number."""
    rows, in_table = [], False
    lines = markdown.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.lstrip().startswith("|"):
            in_table = False
            continue
        row = cells(line)
        if row == HEADER:
            in_table = True
        elif in_table and not set("".join(row)) <= set("-: "):
            rows.append({**dict(zip(HEADER, row)), "line": number})
    return rows


def resolve(document, pointer: str):
    """RFC 6901: the value at ``pointer`` in ``document``."""
    if pointer == "":
        return document
    if not pointer.startswith("/"):
        raise ValueError(f"JSON pointer {pointer!r} does not start with '/'")
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(document, list):
            if not token.isdigit() or int(token) >= len(document):
                raise KeyError(f"{pointer!r}: no index {token!r} in a list of {len(document)}")
            document = document[int(token)]
        elif isinstance(document, dict):
            if token not in document:
                raise KeyError(f"{pointer!r}: no key {token!r} (keys: {sorted(document)[:12]})")
            document = document[token]
        else:
            raise KeyError(f"{pointer!r}: {token!r} reaches into a {type(document).__name__}")
    return document


def raw_value(markdown: Path, raw_cell: str) -> float:
    """The figure the raw cell's link points at, from the JSON it links."""
    match = LINK.search(raw_cell)
    if not match:
        raise ValueError(f"raw cell {raw_cell!r} has no link of the form [text](file.json#pointer)")
    path, fragment = match.groups()
    document = json.loads((markdown.parent / urllib.parse.unquote(path)).read_text())
    values = [resolve(document, urllib.parse.unquote(p)) for p in fragment.split("÷")]
    for pointer, value in zip(fragment.split("÷"), values):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{path}#{pointer} is {value!r}, not a number")
    if len(values) == 1:
        return float(values[0])
    if len(values) == 2:
        return values[0] / values[1]
    raise ValueError(f"fragment {fragment!r}: one pointer, or two joined by '÷'")


def mismatch(markdown: Path, row: dict) -> str | None:
    """Why the row's printed ratio is not its raw figure rounded to the printed digits (None
    when it is)."""
    match = RATIO.match(row["ratio"])
    if not match:
        return f"line {row['line']}: ratio {row['ratio']!r} is not of the form 1.23×"
    printed, decimals = match.group(1), len(match.group(2) or "")
    try:
        value = raw_value(markdown, row["raw"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"line {row['line']}: {type(e).__name__}: {e}"
    if f"{value:.{decimals}f}" != printed:
        return f"line {row['line']}: printed {printed}×, the raw figure is {value!r}"
    return None


def headline_tables() -> list[Path]:
    return [path for path in (ROOT / "README.md", RESULTS_INDEX) if path.exists()]


def test_the_results_index_has_a_headline_table():
    assert 6 <= len(headline_rows(RESULTS_INDEX)) <= 10


@pytest.mark.parametrize("markdown", headline_tables(), ids=lambda p: str(p.relative_to(ROOT)))
def test_headline_ratios_are_their_raw_figures(markdown):
    errors = [e for row in headline_rows(markdown) if (e := mismatch(markdown, row))]
    assert not errors, "\n".join(errors)


def test_a_wrong_ratio_or_a_broken_pointer_is_caught(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "raw.json").write_text(
        json.dumps({"rows": [{"tokens_per_s": 82186.0}, {"tokens_per_s": 96310.0}], "a/b": {"x~y": 2.5}})
    )
    link = "[raw](run/raw.json#/rows/1/tokens_per_s÷/rows/0/tokens_per_s)"
    table = tmp_path / "README.md"
    table.write_text(
        "\n".join(
            [
                "| metric | ratio | device | date | raw |",
                "|---|---|---|---|---|",
                f"| right | 1.17× | 1 × H200 | 2026-12-02 | {link} |",
                f"| right, three digits, bold | **1.172×** | 1 × H200 | 2026-12-02 | {link} |",
                f"| wrong | 1.18× | 1 × H200 | 2026-12-02 | {link} |",
                "| escaped pointer | 2.5× | cpu | 2026-12-02 | [raw](run/raw.json#/a~1b/x~0y) |",
                "| broken pointer | 1.17× | 1 × H200 | 2026-12-02 | [raw](run/raw.json#/rows/2/tokens_per_s) |",
                "| not a number | 1.17× | 1 × H200 | 2026-12-02 | [raw](run/raw.json#/rows/0) |",
                "| no file | 1.17× | 1 × H200 | 2026-12-02 | [raw](run/none.json#/rows/0) |",
                "",
                "| metric | ratio | device | date | raw |",
                "|---|---|---|---|---|",
                f"| second table, wrong | 0.85× | 1 × H200 | 2026-12-02 | {link} |",
            ]
        )
        + "\n"
    )
    rows = headline_rows(table)
    assert [r["metric"] for r in rows] == [
        "right",
        "right, three digits, bold",
        "wrong",
        "escaped pointer",
        "broken pointer",
        "not a number",
        "no file",
        "second table, wrong",
    ]
    errors = {r["metric"]: mismatch(table, r) for r in rows}
    assert errors["right"] is None and errors["right, three digits, bold"] is None
    assert errors["escaped pointer"] is None
    assert "printed 1.18×" in errors["wrong"] and "printed 0.85×" in errors["second table, wrong"]
    assert "no index '2'" in errors["broken pointer"]
    assert "not a number" in errors["not a number"]
    assert "FileNotFoundError" in errors["no file"]
