"""benchmarks/links.py: the link model's calibration, run on 8 simulated CPU devices (the
numbers are the CPU's; what is checked is that every kind runs with the shapes it claims and
the fit recovers a line)."""

import json

import pytest
from benchmark_scripts import load


def load_script():
    return load("links")


def test_the_fit_recovers_alpha_and_beta():
    links = load_script()
    alpha, beta = links.fit([(s, 7e-6 + s / 120e9) for s in (1e6, 4e6, 16e6)])
    assert alpha == pytest.approx(7e-6, rel=1e-6) and beta == pytest.approx(120e9, rel=1e-6)


def test_sent_bytes_are_the_ring_formulas_conversion_prices():
    links = load_script()
    assert [links.sent_bytes(k, 1024, 4) for k in links.KINDS] == [1536, 3072, 768, 768, 1024]


@pytest.mark.slow
def test_every_kind_runs_over_each_axis(tmp_path):
    out = tmp_path / "links.json"
    load_script().main(
        [
            "--mesh",
            '{"data": 2, "model": 4}',
            "--sizes-mb",
            "0.0625",
            "0.125",
            "--iters",
            "1",
            "--rounds",
            "1",
            "--out",
            str(out),
        ]
    )
    fits = json.loads(out.read_text())["fits"]
    assert [(f["axis"], f["size"], f["kind"]) for f in fits] == [
        (axis, n, kind) for axis, n in (("data", 2), ("model", 4)) for kind in load_script().KINDS
    ]
    assert all(p["seconds"] > 0 for f in fits for p in f["points"])
