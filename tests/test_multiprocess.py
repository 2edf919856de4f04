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
import yaml

from shardflow import train
from test_models import small_config
from test_train import data_dir  # noqa: F401  (fixture)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(cfg, n_processes: int, devices_each: int, timeout: float = 900):
    path = os.path.join(cfg.out, "config.yaml")
    os.makedirs(cfg.out, exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    return launch([sys.executable, "-m", "shardflow.train", "--config", path, "--no-progress"],
                  n_processes, devices_each, timeout)


def launch(command, n_processes: int, devices_each: int, timeout: float) -> list[str]:
    """``command`` run as ``n_processes`` processes of ``devices_each`` CPU devices joined by
    jax.distributed; their outputs, each having exited 0."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(n_processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=coordinator,
                   JAX_NUM_PROCESSES=str(n_processes), JAX_PROCESS_ID=str(i),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}")
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


def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one(data_dir, tmp_path):  # noqa: F811
    def cfg(out, steps=3):
        c = small_config(data_dir, tmp_path / out, steps=steps, strategy="2d",
                         mesh={"data": 2, "model": 4})
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
    np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [one["losses"][s] for s in (1, 2, 3)],
                               rtol=1e-5)

    restored = train.train(cfg("two"), progress=False)  # one process, 8 devices
    assert restored["start_step"] == 3 and restored["losses"] == {}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 jax.device_get(one["params"]), jax.device_get(restored["params"]))


PLAN_IN_EACH_PROCESS = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from shardflow import train
train.maybe_initialize_distributed()
import shardflow as sf
from shardflow.passes import solve
if sys.argv[1] == "cut" and jax.process_index() == 1:       # this host's solve runs out of time
    def out_of_time(*args, **kwargs):
        raise solve.Unsolvable("time limit (simulated)")
    solve._solved = out_of_time
grad = jax.grad(lambda x, w1, w2: jnp.sum((jnp.tanh(x @ w1) @ w2) ** 2), argnums=(1, 2))
mesh = sf.make_mesh({"data": 2, "model": 4})
f = sf.parallelize(grad, mesh=mesh, passes=sf.passes.SOLVER,
                   in_specs=(jax.P("data"), jax.P(None, "model"), jax.P("model")),
                   out_specs=(jax.P(None, "model"), jax.P("model")))
args = [jax.ShapeDtypeStruct(s, np.float32) for s in ((16, 32), (32, 64), (64, 32))]
try:
    print("PLANNER", f.explain(*args).planner[:40])
except sf.ShardingError as e:
    print("REFUSED", e)
"""


def run_script(tmp_path, script: str, arg: str) -> list[str]:
    path = tmp_path / "script.py"
    path.write_text(script)
    return launch([sys.executable, str(path), arg], n_processes=2, devices_each=4, timeout=300)


def test_processes_whose_solves_end_differently_are_refused_not_run(tmp_path):
    """Each process solves the program itself; where the time limit cuts one host's solve short
    (simulated) its plan is greedy's, the others' the solver's — a ShardingError in every
    process, not two programs whose collectives do not match. Where all solve, all agree."""
    agreed = run_script(tmp_path, PLAN_IN_EACH_PROCESS, "whole")
    assert all("PLANNER solver (optimal" in out for out in agreed), agreed
    cut = run_script(tmp_path, PLAN_IN_EACH_PROCESS, "cut")
    for out in cut:
        assert "REFUSED script.py:19: the 2 processes planned different programs (processes [1] differ from process 0" in out, out
    assert "planner: greedy (the solver did not run: time limit (simulated))" in cut[1]
