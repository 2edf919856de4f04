"""`shardflow explain` shows the training step's plan without training or writing anything;
`shardflow train` refuses, before allocating or compiling, a config whose step cannot fit in
the devices' memory; Ctrl-C ends a run with one line naming its last checkpoint."""

import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import pytest

from shardflow.train import cli, config, planning, run_setup

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GiB = 2**30


@pytest.fixture
def host_of_32_gib(monkeypatch):
    """The CPU devices share a host of 32 GiB (4 GiB each of the 8), whatever this machine has."""
    real_sysconf = os.sysconf
    monkeypatch.setattr(
        os,
        "sysconf",
        lambda name: 32 * GiB // real_sysconf("SC_PAGE_SIZE") if name == "SC_PHYS_PAGES" else real_sysconf(name),
    )


def _nothing_allocated(monkeypatch):
    """init_state may run only abstractly (under jax.eval_shape)."""
    real_init_state = run_setup.init_state

    def abstract_only(run):
        state = real_init_state(run)
        if not all(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
            pytest.fail("parameters allocated")
        return state

    monkeypatch.setattr(run_setup, "init_state", abstract_only)


@pytest.mark.slow
@pytest.mark.parametrize("planner", ["greedy", "solver"])
def test_explain_prints_the_plan_time_and_memory_and_writes_nothing(
    planner, tmp_path, capsys, monkeypatch, host_of_32_gib
):
    monkeypatch.chdir(tmp_path)
    _nothing_allocated(monkeypatch)
    code = cli.main(
        [
            "explain",
            "--set",
            "model={preset: tiny, n_layers: 2}",
            "--set",
            "mesh={data: 2, model: 4}",
            "--set",
            "strategy=2d",
            "--set",
            f"planner={planner}",
        ]
    )
    out, err = capsys.readouterr()
    assert "warning: mesh axis" not in err, err
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith(
        "model {'preset': 'tiny', 'n_layers': 2} 1.7M params | mesh "
        "{'data': 2, 'model': 4} strategy 2d planner " + planner
    ), lines[0]
    assert re.search(r"^kind +axes +value +bytes +µs +× +source +reason$", out, re.M), out
    assert re.search(r"^all_reduce +model ", out, re.M), out  # the tensor-parallel sums
    assert f"planner: {planner}" in out
    step_time = re.search(
        r"^step time, modelled: ([\d.]+) ms \(([\d.]+) ms of collectives \+ "
        r"([\d.]+) ms of local work - ([\d.]+) ms the layer loop hides\)$",
        out,
        re.M,
    )
    total, collectives, work, hidden = map(float, step_time.groups())
    assert total > 0 and abs(total - (collectives + work - hidden)) < 2e-3
    assert re.search(
        r"^memory per device, modelled: [\d.]+ MiB \([\d.]+ MiB of parameters, "
        r"optimizer state and batch \+ [\d.]+ MiB the loops hold; other intermediates "
        r"not counted\); fits in 4.0 GiB each of 8 CPU devices \(32.0 GiB of host "
        r"memory shared\)$",
        out,
        re.M,
    ), out
    assert list(tmp_path.iterdir()) == []


def test_explain_refuses_a_bad_config_like_train(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["explain", "--set", "strategy={batch: data, embd: data}"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            "config error: strategy {'batch': 'data', 'embd': 'data'}: the rules table names logical axis 'embd'"
        )
        and err.count("\n") == 1
    ), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("config,params", [("1b.yaml", "886.1M"), ("3b.yaml", "3.02B"), ("7b-2d.yaml", "6.74B")])
def test_a_model_too_large_for_the_devices_is_refused_before_anything_is_allocated(
    config, params, tmp_path, capsys, monkeypatch, host_of_32_gib
):
    _nothing_allocated(monkeypatch)
    out = tmp_path / "run"
    code = cli.main(
        ["train", "--config", str(CONFIGS / config), "--set", "data.path=null", "--out", str(out), "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    needs = re.match(
        r"config error: model \{.*\} \(" + re.escape(params) + r" parameters\) needs an estimated "
        r"([\d.]+) GiB per device on mesh \{.*\} \(the greedy planner's estimate, a lower bound: "
        r"([\d.]+) GiB of parameters, optimizer state and batch \+ [\d.]+ [GM]iB of activations "
        r"the layers keep for the backward\), more than 4.0 GiB each of 8 CPU devices \(32.0 GiB "
        r"of host memory shared\)\. Run it on accelerators with at least \1 GiB each \(this "
        r"machine has CPU devices only\), or make the step need less per device: more devices",
        err,
    )
    assert needs, err
    assert float(needs.group(1)) > 4.0
    assert not out.exists()


def test_the_125m_preset_fits_the_cpu_devices(capsys, monkeypatch, tmp_path, host_of_32_gib):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["explain", "--set", "model=125m"]) == 0
    assert "; fits in 4.0 GiB each of 8 CPU devices" in capsys.readouterr().out


@pytest.mark.slow
def test_ctrl_c_ends_training_with_one_line_naming_the_last_checkpoint(tmp_path):
    """SIGINT once the first checkpoint is on disk: exit code 130, no traceback, every step on
    disk finished (its checksums written), the line names the newest."""
    out = tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardflow.train",
            "--out",
            str(out),
            "--steps",
            "1000",
            "--no-progress",
            "--set",
            "model={preset: tiny, d_model: 64, n_layers: 1, head_dim: 8, max_seq_len: 32}",
            "--set",
            "batch_size=8",
            "--set",
            "data.seq_len=32",
            "--set",
            "eval_every=0",
            "--set",
            "checkpoint.every=2",
            "--set",
            "compute_dtype=float32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (out / "checkpoints" / "2" / "checksums.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    try:
        stdout, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"no exit within 60 s of Ctrl-C: {process.communicate()}")
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and all((out / "checkpoints" / str(s) / "checksums.json").exists() for s in steps)
    last = re.fullmatch(r"interrupted after step (\d+); last checkpoint: step (\d+) in (.+)", stderr.splitlines()[-1])
    assert last, stderr
    assert int(last.group(2)) == steps[-1] <= int(last.group(1)) + 1
    assert last.group(3) == str(out / "checkpoints")


def test_a_step_the_planner_refuses_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    import shardflow as sf

    def refuse(run, step_fn):
        raise sf.ShardingError("llama.py:66: dim 2 of size 4 is not divisible by 8")

    monkeypatch.setattr(planning, "plan_step", refuse)
    out = tmp_path / "run"
    code = cli.main(
        [
            "train",
            "--out",
            str(out),
            "--steps",
            "2",
            "--no-progress",
            "--set",
            "model={preset: tiny, d_model: 64, n_layers: 1, head_dim: 8}",
            "--set",
            "data.seq_len=32",
            "--set",
            "checkpoint.every=1",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("sharding error: ") and err.count("\n") == 1, err
    assert err.endswith("llama.py:66: dim 2 of size 4 is not divisible by 8\n"), err
    assert not out.exists()


def test_a_mesh_axis_the_strategy_leaves_unused_is_one_warning_line(tmp_path, capsys, monkeypatch, host_of_32_gib):
    monkeypatch.chdir(tmp_path)
    assert (
        cli.main(
            [
                "explain",
                "--set",
                "model={preset: tiny, n_layers: 2}",
                "--set",
                "mesh={data: 2, model: 4}",
                "--set",
                "strategy=dp",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        "warning: mesh axis 'model' (4 devices) splits nothing under strategy 'dp': every "
        "device along it repeats the same work on the same data. Use a strategy that names "
        "it, or leave it out of the mesh\n"
    ) in err, err
    assert "ReplicatedAxisWarning" not in err


def test_plan_prints_the_best_plans_for_a_cluster_and_refuses_a_bad_one(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("cluster:\n  inventory: {H100: 2, A100-40GB: 2}\n  per_node: 2\n")
    argv = ["plan", "--cluster", str(cluster), "--set", "model={preset: tiny, n_layers: 4}", "--set", "batch_size=8"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "cluster 2 x H100, 2 x A100-40GB" in out and "pipelines (stage kind x tp)" in out
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert rows and all("GB" not in r or "/" in r for r in rows)
    run = out.strip().splitlines()[-1]
    assert run.startswith(("run the best plan on the ", "the best plan mixes")), run
    if run.startswith("run"):  # the command's settings make a valid run on the devices it names
        devices = int(run.split("run the best plan on the ")[1].split()[0])
        keys = [k.strip().strip('"') for k in run.split("--set ")[1:]]
        cfg = config.load(None, ["model={preset: tiny, n_layers: 4}", *keys])
        config.validate(cfg, devices)
    cluster.write_text("cluster:\n  inventory: {B300: 8}\n")
    assert cli.main(argv) == 2
    assert "config error: unknown device kind 'B300'" in capsys.readouterr().err
    moe = ["plan", "--cluster", str(tmp_path / "missing.yaml"), "--set", "model.preset=moe-tiny"]
    assert cli.main(moe) == 2
    assert "config error: --cluster" in capsys.readouterr().err


def test_the_plans_the_trainer_runs_become_its_settings():
    from shardflow.hetero import Pipeline, Plan, Stage
    from shardflow.train.cluster_plan import trainer_settings

    uneven = Plan((Pipeline((Stage("H100", 2, 8),), 3), Pipeline((Stage("A100-40GB", 2, 8),), 1)), micro_batch=2)
    assert trainer_settings(uneven) == [
        "mesh={data: 2, model: 2}",
        "strategy=tp",
        "batch_size=8",
        "replica_microbatches=[3, 1]",
    ]
    staged = Pipeline((Stage("H100", 1, 5), Stage("A100-40GB", 1, 3)), 4)
    assert trainer_settings(Plan((staged, staged), micro_batch=1, remat=True)) == [
        "mesh={pipe: 2, data: 2}",
        "strategy=dp",
        "batch_size=8",
        "pipeline.stages=2",
        "pipeline.microbatches=4",
        "pipeline.schedule=1f1b-fused",
        "pipeline.layers_per_stage=[5, 3]",
        "model.remat=full",
    ]
    cfg = config.load(None, ["model={preset: tiny, n_layers: 8}", *trainer_settings(Plan((staged, staged), 1))])
    config.validate(cfg, 4)
    # uneven counts under a pipeline: the replicas' slots are its micro-batches (padding computed)
    uneven_pipelines = Plan((staged, Pipeline(staged.stages, 2)), 1)
    assert trainer_settings(uneven_pipelines)[3:] == [
        "pipeline.stages=2",
        "pipeline.microbatches=4",
        "pipeline.schedule=1f1b-fused",
        "pipeline.layers_per_stage=[5, 3]",
        "replica_microbatches=[4, 2]",
    ]
    config.validate(config.load(None, ["model={preset: tiny, n_layers: 8}", *trainer_settings(uneven_pipelines)]), 4)
    mixed = Pipeline((Stage("H100", 1, 5), Stage("A100-40GB", 2, 3)), 4)
    assert trainer_settings(Plan((mixed,), 1)) is None  # one mesh: one tensor-parallel width


def test_a_plan_the_trainers_checks_refuse_is_not_run():
    """The stacked layers are stored split over the pipe axis: 3 stages of a 4-layer model (1, 1,
    2 layers) have settings but no run, nor 3 stages of a 6-layer one whose 256-entry
    vocabulary they would split; the next runnable plan is the one named instead."""
    from shardflow.hetero import Pipeline, Plan, Stage
    from shardflow.train.cluster_plan import expressible, trainer_settings, unrunnable

    def tiny(n_layers):
        return config.load(None, [f"model={{preset: tiny, n_layers: {n_layers}}}", "compute_dtype=float32"])

    three = Plan((Pipeline((Stage("H100", 1, 1), Stage("H100", 1, 1), Stage("A100-40GB", 1, 2)), 4),), 1)
    two = Plan((Pipeline((Stage("H100", 1, 3), Stage("A100-40GB", 1, 1)), 4),), 1)
    assert "pipeline.layers_per_stage=[1, 1, 2]" in trainer_settings(three)
    assert "must divide by 3" in unrunnable(three, tiny(4))
    six = Plan((Pipeline((Stage("H100", 1, 2), Stage("H100", 1, 2), Stage("A100-40GB", 1, 2)), 4),), 1)
    assert "parameter embedding: dimension 0 (size 256)" in unrunnable(six, tiny(6))
    assert unrunnable(two, tiny(4)) is None
    candidates = [types.SimpleNamespace(plan=three), types.SimpleNamespace(plan=two)]
    assert expressible(candidates, tiny(4)) == (candidates[1], trainer_settings(two))
