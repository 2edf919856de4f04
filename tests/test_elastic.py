"""Elastic restarts: a run that loses devices (a spot preemption) resumes from its last
checkpoint on the devices it finds, its mesh re-sized (``mesh: {data: auto, model: 2}``) and its
step re-planned, and its loss curve continues as the uninterrupted run's: the data order is a
function of the seed and the step, and the global batch stays the same."""

import json
import subprocess
import sys

import numpy as np
import pytest
from test_docs import cpu_only_env

from shardflow import train
from shardflow.train import config

RUN = """
import json, sys
from shardflow import train
from shardflow.train import config
result = train.train(config.load(None, json.loads(sys.argv[1])), until=int(sys.argv[2]), progress=False)
print(json.dumps({int(s): l for s, l in result["losses"].items()}))
"""


def overrides(data_dir, out):
    return [
        "model={preset: tiny, n_layers: 2}",
        "mesh={data: auto, model: 2}",
        "strategy=tp",
        "batch_size=24",
        "data.seq_len=32",
        "compute_dtype=float32",
        f"data.path={data_dir}",
        f"out={out}",
        "steps=12",
        "log_every=1",
        "checkpoint.every=4",
        "eval_every=0",
    ]


def on_devices(devices: int, keys: list, until: int) -> dict:
    """Train until step ``until`` in a fresh process that finds ``devices`` CPU devices."""
    done = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(keys), str(until)],
        env=cpu_only_env(devices),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(s): loss for s, loss in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.slow
def test_a_run_that_loses_two_of_eight_devices_and_gets_them_back_follows_the_uninterrupted_loss(data_dir, tmp_path):
    want = train.train(config.load(None, overrides(data_dir, tmp_path / "whole")), progress=False)["losses"]
    keys = overrides(data_dir, tmp_path / "elastic")
    got = on_devices(8, keys, 4) | on_devices(6, keys, 8) | on_devices(8, keys, 12)
    assert sorted(got) == list(range(1, 13))
    np.testing.assert_allclose([got[s] for s in range(1, 13)], [want[s] for s in range(1, 13)], rtol=1e-5)


def test_an_auto_axis_takes_the_devices_the_fixed_axes_leave():
    cfg = config.Config()
    cfg.mesh, cfg.strategy, cfg.batch_size = {"data": "auto", "model": 2}, "tp", 24
    assert config.validate(cfg, 8) == {"data": 4, "model": 2}
    assert config.validate(cfg, 6) == {"data": 3, "model": 2}
    with pytest.raises(config.ConfigError, match=r"the 7 devices do not divide by the other axes' 2 to size 'data'"):
        config.validate(cfg, 7)
    cfg.mesh = {"data": "auto", "model": "auto"}
    with pytest.raises(config.ConfigError, match=r"at most one axis may be auto"):
        config.validate(cfg, 8)
