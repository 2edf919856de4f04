"""`shardflow train`: resume, cross-mesh restore, config errors, NaN stop, CLI and logs."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from test_models import ENGINE, small_config

from shardflow import train
from shardflow.train import cli, config, devices, steps


@pytest.mark.slow
def test_resume_gives_the_uninterrupted_loss_sequence(data_dir, tmp_path):
    def cfg(out):
        c = small_config(data_dir, out, steps=6, compute_dtype="bfloat16")
        c.checkpoint.every = 3
        return c

    whole_cfg = cfg(tmp_path / "whole")
    whole_cfg.checkpoint.keep = 1
    whole = train.train(whole_cfg, progress=False)["losses"]
    assert [p.name for p in (tmp_path / "whole" / "checkpoints").iterdir()] == ["6"]  # keep 1
    first = train.train(cfg(tmp_path / "split"), progress=False, until=3)
    assert sorted(first["losses"]) == [1, 2, 3]
    second = train.train(cfg(tmp_path / "split"), progress=False)
    assert second["start_step"] == 3 and sorted(second["losses"]) == [4, 5, 6]
    assert [whole[s] for s in range(1, 7)] == [first["losses"][s] for s in (1, 2, 3)] + [
        second["losses"][s] for s in (4, 5, 6)
    ]


@pytest.mark.slow
def test_restore_onto_a_different_mesh_gives_the_same_parameters(data_dir, tmp_path):
    saved = small_config(data_dir, tmp_path, steps=2, strategy="dp", mesh={"data": 8})
    saved.checkpoint.every = 2
    params_dp = jax.device_get(train.train(saved, progress=False)["params"])

    restored_cfg = small_config(data_dir, tmp_path, steps=2, strategy="tp", mesh={"data": 2, "model": 4})
    restored_cfg.checkpoint.every = 2
    result = train.train(restored_cfg, progress=False)
    assert result["start_step"] == 2 and result["losses"] == {}
    wq = result["params"]["layers"]["attn"]["wq"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "model", None)
    jax.tree.map(np.testing.assert_array_equal, params_dp, jax.device_get(result["params"]))


@pytest.mark.slow
def test_resuming_another_models_checkpoint_is_a_config_error(data_dir, tmp_path):
    saved = small_config(data_dir, tmp_path, steps=2)
    saved.checkpoint.every = 2
    train.train(saved, progress=False)
    other = small_config(data_dir, tmp_path, steps=4)
    other.checkpoint.every = 2
    other.model = {**other.model, "n_layers": other.model.get("n_layers", 2) + 1}
    with pytest.raises(
        config.ConfigError,
        match=r"checkpoint at step 2 .* holds other arrays .*"
        r"layers.*saved \(\d+,.*config that wrote it, or "
        r"start this run in a fresh --out directory$",
    ):
        train.train(other, progress=False)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optimiser.lr=1e-3"], "unknown config key 'optimiser'"),
        (["optimizer.learning_rate=1e-3"], "unknown config key 'optimizer.learning_rate'"),
        (["model.dim=3"], "unknown config key 'model.dim'"),
        (["mesh={data: 4}"], "mesh {'data': 4} has 4 devices but 8 are available"),
        (["batch_size=12"], "not divisible by the data axes"),
        (["batch_size=16", "grad_accum=4"], "micro-batch 4"),
        (["strategy=tp", "mesh={data: 8}"], "names mesh axis 'model'"),
        (
            ["strategy=tp", "mesh={data: 1, model: 8}", "model.n_kv_heads=2", "model.n_heads=4"],
            "kv_heads.* does not divide|dimension 2 \\(size 2\\)",
        ),
        (["strategy=zero9"], "unknown strategy 'zero9'"),
        (["data.seq_len=-1"], "data.seq_len must be a positive integer, got -1"),
        (["optimizer.lr=abc"], "optimizer.lr must be a number > 0, got 'abc'"),
        (["optimizer.beta2=1.0"], "optimizer.beta2 must be a number in \\[0, 1\\), got 1.0"),
        (["checkpoint.keep=0"], "checkpoint.keep must be a positive integer"),
        (["data.path=/nonexistent"], "data.path '/nonexistent' is not a prepared data dir"),
    ],
)
def test_config_errors_are_clear_and_early(overrides, message, data_dir, tmp_path, monkeypatch):
    compiles = []
    monkeypatch.setattr(steps, "parallelize_step", lambda *a, **k: compiles.append(1))
    with pytest.raises(config.ConfigError, match=message):
        cfg = config.load(None, [f"data.path={data_dir}"] + overrides, out=str(tmp_path))
        train.train(cfg, progress=False)
    assert compiles == []


def test_yaml_exponents_without_a_dot_are_numbers():
    """PyYAML reads 3e-4 as a string; float keys take it as the number (the --help example)."""
    cfg = config.load(None, ["optimizer.lr=3e-4", "optimizer.eps=1e-8"])
    assert (cfg.optimizer.lr, cfg.optimizer.eps) == (3e-4, 1e-8)


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(data_dir, tmp_path):
    cfg = small_config(data_dir, tmp_path, steps=8)
    cfg.checkpoint.every = 2
    cfg.optimizer.lr, cfg.optimizer.clip_norm, cfg.optimizer.warmup_steps = 1e30, 0.0, 0
    result = train.train(cfg, progress=False)
    assert result["stopped"] and "loss is" in result["stopped"]
    bad = min(s for s, loss in result["losses"].items() if not np.isfinite(loss))
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(saved) < bad and f"step {max(saved)}" in result["stopped"]


@pytest.mark.slow
def test_cli_trains_and_writes_metrics_and_tensorboard(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(
        [
            "train",
            "--steps",
            "4",
            "--out",
            str(out),
            "--no-progress",
            "--set",
            f"data.path={data_dir}",
            "--set",
            f"engine={ENGINE}",
            "--set",
            "model={preset: tiny, d_model: 64, n_layers: 1, head_dim: 8}",
            "--set",
            "batch_size=8",
            "--set",
            "data.seq_len=32",
            "--set",
            "log_every=2",
            "--set",
            "eval_every=3",
            "--set",
            "eval_batches=2",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4]
    assert all(np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in records)
    assert [("val_loss" in r) for r in records] == [False, True, True]
    assert 2.0 < records[-1]["val_loss"] < 6.0  # near ln(256) = 5.5 after 4 steps, finite
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())
    assert "done: step 4" in capsys.readouterr().out


def test_cli_reports_config_errors_without_a_traceback(tmp_path, capsys):
    assert cli.main(["train", "--set", "nonsense=1", "--out", str(tmp_path)]) == 2
    assert "config error: unknown config key 'nonsense'" in capsys.readouterr().err


def test_prepare_command(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello world\n" * 100)
    assert cli.main(["prepare", "--input", str(src), "--out", str(tmp_path / "d")]) == 0
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["train_tokens"] > 1000


@pytest.mark.parametrize(
    "args,message",
    [
        (["--input", "/nonexistent.txt"], "missing: \\['/nonexistent.txt'\\]"),
        (["--tokenizer", "bpe", "--vocab-size", "10"], "more than the 256 byte tokens, got vocab_size 10"),
        (["--val-fraction", "1.5"], "val_fraction must be in \\(0, 1\\), got 1.5"),
    ],
)
def test_prepare_errors_are_one_line(args, message, tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello world\n")
    argv = ["prepare", "--out", str(tmp_path / "d")] + (args if "--input" in args else ["--input", str(src)] + args)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepare error: ") and re.search(message, err), err
    assert not (tmp_path / "d").exists()


def test_cpu_platform_gets_simulated_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(devices, "backends_are_initialized", lambda: False)  # as before JAX starts
    train.configure_host_platform()
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    train.configure_host_platform()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    train.configure_host_platform()
    assert os.environ["XLA_FLAGS"] == ""


def test_multi_process_environment_initializes_jax_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for var in (
        "JAX_COORDINATOR_ADDRESS",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    train.maybe_initialize_distributed()
    monkeypatch.setenv("SLURM_NTASKS", "1")
    train.maybe_initialize_distributed()
    assert calls == []
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    train.maybe_initialize_distributed()
    assert calls == [{}]  # JAX reads the address itself and detects the rest
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    train.maybe_initialize_distributed()
    assert calls[-1] == {"num_processes": 4, "process_id": 3}


def _tensorboard_curve(tb_dir, tag):
    """{step: value} of ``tag`` as TensorBoard shows it: event files in the order written, a
    SessionLog.START at step s (a purge) hiding what earlier files logged from step s on."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    curve = {}
    for path in sorted(tb_dir.iterdir()):  # event file names begin with their creation time
        raw, i = path.read_bytes(), 0
        while i < len(raw):  # TFRecords: length (8 bytes), its crc (4), data, data's crc (4)
            length = int.from_bytes(raw[i : i + 8], "little")
            event = Event.FromString(raw[i + 12 : i + 12 + length])
            i += 16 + length
            if event.session_log.status == SessionLog.START:
                curve = {s: v for s, v in curve.items() if s < event.step}
            for value in event.summary.value:
                if value.tag == tag:
                    assert event.step not in curve, f"{tag} at step {event.step} shown twice"
                    curve[event.step] = value.simple_value
    return curve


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once(data_dir, tmp_path):
    cfg = small_config(data_dir, tmp_path, steps=6)  # logs every step
    cfg.checkpoint.every = 2
    first = train.train(cfg, progress=False, until=3)["losses"]
    shutil.rmtree(tmp_path / "checkpoints" / "3")  # killed after logging step 3, before its save
    second = train.train(cfg, progress=False)["losses"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == [first[1], first[2]] + [second[s] for s in range(3, 7)]
    curve = _tensorboard_curve(tmp_path / "tb", "train/loss")
    assert sorted(curve) == [1, 2, 3, 4, 5, 6]
    assert curve[3] == pytest.approx(second[3]) and curve[6] == pytest.approx(second[6])


@pytest.mark.slow
def test_progress_without_a_terminal_is_plain_log_lines(data_dir, tmp_path, capsys):
    """capsys's streams are not terminals, as a redirect to a file is not."""
    cfg = small_config(data_dir, tmp_path, steps=6)
    cfg.log_every = 2
    train.train(cfg)  # progress on
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err
    lines = [line for line in captured.out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"]
    assert re.fullmatch(r"step 2/6 loss \d+\.\d{3} tok_s [\d,]+ mfu n/a", lines[0]), lines[0]
    assert len(captured.out + captured.err) < 1000
