"""Multi-host training, run as two processes on this machine: two `shardflow train` processes
of 4 CPU devices each, joined by jax.distributed (gloo collectives), must train exactly as one
process of 8 devices, and the checkpoint they write together must restore in one process."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml
from test_docs import cpu_only_env
from test_models import small_config

from shardflow import train


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(cfg, n_processes: int, devices_each: int, timeout: float = 900):
    path = os.path.join(cfg.out, "config.yaml")
    os.makedirs(cfg.out, exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    return launch(
        [sys.executable, "-m", "shardflow.train", "--config", path, "--no-progress"], n_processes, devices_each, timeout
    )


def launch(command, n_processes: int, devices_each: int, timeout: float) -> list[str]:
    """``command`` run as ``n_processes`` processes of ``devices_each`` CPU devices joined by
    jax.distributed; their outputs, each having exited 0."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(n_processes):
        env = dict(
            cpu_only_env(devices_each),
            JAX_COORDINATOR_ADDRESS=coordinator,
            JAX_NUM_PROCESSES=str(n_processes),
            JAX_PROCESS_ID=str(i),
        )
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one(data_dir, tmp_path):  # noqa: F811
    def cfg(out, steps=3):
        c = small_config(data_dir, tmp_path / out, steps=steps, strategy="2d", mesh={"data": 2, "model": 4})
        c.checkpoint.every = 3
        c.checkpoint.async_save = False
        return c

    outputs = run_processes(cfg("two"), n_processes=2, devices_each=4)
    assert "mesh {'data': 2, 'model': 4}" in outputs[0] and "8 x cpu" in outputs[0], outputs[0]
    assert all("done: step 3" in out for out in outputs), outputs
    rows = [json.loads(line) for line in open(tmp_path / "two" / "metrics.jsonl")]
    two = {r["step"]: r["loss"] for r in rows if "loss" in r}

    one = train.train(cfg("one"), progress=False)
    assert sorted(two) == sorted(one["losses"]) == [1, 2, 3]
    np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [one["losses"][s] for s in (1, 2, 3)], rtol=1e-5)

    restored = train.train(cfg("two"), progress=False)  # one process, 8 devices
    assert restored["start_step"] == 3 and restored["losses"] == {}
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        jax.device_get(one["params"]),
        jax.device_get(restored["params"]),
    )


PLAN_IN_EACH_PROCESS = r"""
import jax, jax.numpy as jnp, numpy as np
from types import SimpleNamespace
from shardflow import train
train.maybe_initialize_distributed()
import shardflow as sf
from shardflow.passes import solve

grad = jax.grad(lambda x, w1, w2: jnp.sum((jnp.tanh(x @ w1) @ w2) ** 2), argnums=(1, 2))
mesh = sf.make_mesh({"data": 2, "model": 4})
args = [jax.ShapeDtypeStruct(s, np.float32) for s in ((16, 32), (32, 64), (64, 32))]
real_relaxation, real_solve = solve.highs.relaxation, solve._solve


def out_of_iterations(*args, **kwargs):
    return SimpleNamespace(x=None, status=1, message="out of iterations (simulated)")


def greedy_here(program, time_limit):      # planning that is not deterministic (simulated)
    real_solve(program, time_limit)
    return solve.propagate(program).replace(planner="greedy (simulated)")


def crash(*args, **kwargs):
    raise RuntimeError("HiGHS crashed (simulated)")


for case in ("whole", "cut on 0", "cut on 1", "differ on 1", "raise on 0"):
    kind = case.split()[0] if case.endswith(str(jax.process_index())) else None
    solve.highs.relaxation = {"cut": out_of_iterations, "raise": crash}.get(kind, real_relaxation)
    solve._solve = greedy_here if kind == "differ" else real_solve
    f = sf.parallelize(grad, mesh=mesh, passes=sf.passes.SOLVER,
                       in_specs=(jax.P("data"), jax.P(None, "model"), jax.P("model")),
                       out_specs=(jax.P(None, "model"), jax.P("model")))
    try:
        print(case, "PLANNER", f.explain(*args).planner[:90])
    except sf.ShardingError as e:
        print(case, "REFUSED", e)
    except RuntimeError as e:
        print(case, "RAISED", e)
"""


@pytest.mark.slow
def test_processes_plan_with_process_0s_solve_and_refuse_plans_that_differ(tmp_path):
    """Each process plans the program itself, with HiGHS's results taken from process 0: where
    a solve would have stopped on one host only (simulated), every process plans what process
    0's solve gave — greedy's plan where process 0's stopped, the solver's where process 1's
    would have. Where planning differs anyway (simulated), a ShardingError in every process,
    not two programs whose collectives do not match; where process 0's solve raises, it raises
    there and the others refuse, rather than wait for its result."""
    path = tmp_path / "script.py"
    path.write_text(PLAN_IN_EACH_PROCESS)
    outputs = launch([sys.executable, str(path)], n_processes=2, devices_each=4, timeout=300)
    for out in outputs:
        assert "whole PLANNER solver (optimal" in out, out
        assert "cut on 0 PLANNER greedy (the solver did not run: out of iterations (simulated))" in out, out
        assert "cut on 1 PLANNER solver (optimal" in out, out
        assert (
            "differ on 1 REFUSED script.py:36: the 2 processes planned different programs (processes [1] "
            "differ from process 0" in out
        ), out
    assert "raise on 0 RAISED HiGHS crashed (simulated)" in outputs[0], outputs[0]
    assert (
        "raise on 0 REFUSED script.py:36: the solve on process 0, whose result every process plans with, "
        "raised RuntimeError: HiGHS crashed (simulated)" in outputs[1]
    ), outputs[1]
