"""Damaged checkpoints and failing saves: resume falls back to the newest step that restores,
with a warning naming the damaged step; nothing restorable or a failed save is one
`checkpoint error:` line; no exit hangs on orbax's threads."""

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from test_models import SMALL_LLAMA, small_config

from shardflow import train
from shardflow.train import cli
from shardflow.train.checkpoint import CheckpointError, Checkpoints, abstract_like


def _cfg(data_dir, out):
    cfg = small_config(data_dir, out, steps=6)
    cfg.checkpoint.every = 2
    return cfg


@pytest.fixture(scope="module")
def saved(data_dir, tmp_path_factory):
    """A run interrupted after step 4 of 6: checkpoints at steps 2 and 4, and its losses."""
    out = tmp_path_factory.mktemp("saved")
    losses = train.train(_cfg(data_dir, out), progress=False, until=4)["losses"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4"]
    return out, losses


@pytest.fixture(scope="module")
def target(data_dir, tmp_path_factory):
    run = train.setup(_cfg(data_dir, tmp_path_factory.mktemp("target")))
    params, opt_state = jax.eval_shape(lambda: train.init_state(run))
    return {
        "params": abstract_like(params, run.shardings(run.param_specs)),
        "opt_state": abstract_like(opt_state, run.shardings(run.opt_specs)),
    }


def _copy(saved, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved[0], out)
    return out


def _arrays(step_dir):
    return sorted((step_dir / "default" / "ocdbt.process_0" / "d").iterdir())


def _flip_bytes(step_dir):
    for path in _arrays(step_dir):
        raw = bytearray(path.read_bytes())
        raw[::97] = bytes(b ^ 0xFF for b in raw[::97])
        path.write_bytes(bytes(raw))


# name -> (how step 4's folder is damaged, a fragment of the reason the warning gives)
DAMAGE = {
    "empty folder": (lambda d: [shutil.rmtree(d), d.mkdir()], "checkpoints/4 is empty"),
    "partial folder": (lambda d: shutil.rmtree(d / "default"), "checkpoints/4/default is missing"),
    "deleted _METADATA": (
        lambda d: (d / "default" / "_METADATA").unlink(),
        "checkpoints/4/default has no readable _METADATA",
    ),
    "truncated arrays": (
        lambda d: [p.write_bytes(p.read_bytes()[:10]) for p in _arrays(d)],
        'OUT_OF_RANGE: Error reading "',
    ),
    "random bytes": (
        lambda d: [p.write_bytes(np.random.default_rng(0).bytes(p.stat().st_size)) for p in _arrays(d)],
        'Error reading "',
    ),
    "deleted arrays": (lambda d: [p.unlink() for p in _arrays(d)], 'Error reading "'),
    "flipped bytes": (_flip_bytes, 'Error reading "'),
    "truncated manifest": (
        lambda d: (d / "default" / "manifest.ocdbt").write_bytes(b"12345"),
        'manifest.ocdbt": Error decoding manifest',
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_step_falls_back_to_the_newest_good_one(damage, saved, target, tmp_path, capsys, monkeypatch):
    out = _copy(saved, tmp_path)
    damage_fn, reason = DAMAGE[damage]
    damage_fn(out / "checkpoints" / "4")
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    ckpt = Checkpoints(out / "checkpoints")
    step, state = ckpt.restore_latest(target)
    ckpt.close()
    gc.collect()  # abandoned reads, were there any, would complain now
    time.sleep(0.2)  # and late ones from tensorstore's threads here
    assert step == 2 and set(state) == {"params", "opt_state"}
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and warning[0].startswith("warning: checkpoint step 4 is damaged ("), err
    assert reason in warning[0] and "resuming from step 2" in warning[0], warning[0]
    assert "Traceback" not in err and "Event loop is closed" not in err and unraisable == []
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4.damaged"]


@pytest.mark.slow
def test_training_resumes_from_the_good_step_as_if_uninterrupted(data_dir, saved, tmp_path, capsys):
    out = _copy(saved, tmp_path)
    _flip_bytes(out / "checkpoints" / "4")
    result = train.train(_cfg(data_dir, out), progress=False)
    assert result["start_step"] == 2 and sorted(result["losses"]) == [3, 4, 5, 6]
    assert [result["losses"][s] for s in (3, 4)] == [saved[1][s] for s in (3, 4)]
    assert "warning: checkpoint step 4 is damaged" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4", "4.damaged", "6"]


def test_no_restorable_step_is_one_checkpoint_error_line(data_dir, saved, tmp_path, capsys):
    out = _copy(saved, tmp_path)
    for step in (2, 4):
        for path in _arrays(out / "checkpoints" / str(step)):
            path.write_bytes(path.read_bytes()[:10])
    code = cli.main(
        [
            "train",
            "--out",
            str(out),
            "--steps",
            "6",
            "--no-progress",
            "--set",
            f"model={json.dumps(SMALL_LLAMA)}",
            "--set",
            f"data.path={data_dir}",
            "--set",
            "batch_size=8",
            "--set",
            "data.seq_len=32",
            "--set",
            "compute_dtype=float32",
            "--set",
            "checkpoint.every=2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(
        f"checkpoint error: no checkpoint in {out}/checkpoints can be restored: "
        "step 4 is damaged (OUT_OF_RANGE: Error reading "
    ), err
    assert "; step 2 is damaged (OUT_OF_RANGE: Error reading " in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4"]  # left alone


def _tree(path):
    return {p.relative_to(path): p.read_bytes() if p.is_file() else None for p in path.rglob("*")}


def test_a_run_that_does_not_resume_refuses_to_mix_with_old_checkpoints(data_dir, saved, tmp_path, capsys):
    """orbax saves no step at or below the newest one there: a fresh run would have kept steps 2
    and 4 of the old run beside its own 6. Refused before anything is written; nothing deleted."""
    out = _copy(saved, tmp_path)
    before = _tree(out)
    code = cli.main(
        [
            "train",
            "--out",
            str(out),
            "--steps",
            "6",
            "--no-progress",
            "--set",
            f"model={json.dumps(SMALL_LLAMA)}",
            "--set",
            f"data.path={data_dir}",
            "--set",
            "batch_size=8",
            "--set",
            "data.seq_len=32",
            "--set",
            "checkpoint.every=2",
            "--set",
            "checkpoint.resume=false",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        f"config error: checkpoint.resume is false but {out}/checkpoints holds checkpoints (steps 2, 4)"
    ), err
    assert "fresh --out directory" in err and f"delete {out}/checkpoints yourself" in err
    assert _tree(out) == before


@pytest.mark.slow
def test_a_run_that_does_not_resume_saves_every_step_beside_set_aside_ones(data_dir, saved, tmp_path):
    out = _copy(saved, tmp_path)
    shutil.rmtree(out / "checkpoints" / "2")
    (out / "checkpoints" / "4").rename(out / "checkpoints" / "4.damaged")
    cfg = _cfg(data_dir, out)
    cfg.checkpoint.resume = False
    result = train.train(cfg, progress=False)
    assert result["start_step"] == 0 and sorted(result["losses"]) == [1, 2, 3, 4, 5, 6]
    assert [result["losses"][s] for s in (1, 2, 3, 4)] == [saved[1][s] for s in (1, 2, 3, 4)]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4", "4.damaged", "6"]


def _train_command(data_dir, out, once_checked="pass"):
    """`shardflow train` in a fresh process; ``once_checked`` runs once the run's directories
    have passed their checks, with ``out`` the run's directory."""
    script = "\n".join(
        [
            "import sys",
            "from pathlib import Path",
            "from shardflow.train import cli, config",
            "check = config.check_writable",
            "def check_then(cfg):",
            "    check(cfg)",
            "    out = Path(cfg.out)",
            textwrap.indent(textwrap.dedent(once_checked).strip(), "    "),
            "config.check_writable = check_then",
            "sys.exit(cli.main(sys.argv[1:]))",
        ]
    )
    return [
        sys.executable,
        "-c",
        script,
        "train",
        "--out",
        str(out),
        "--steps",
        "4",
        "--no-progress",
        "--set",
        f"model={json.dumps(SMALL_LLAMA)}",
        "--set",
        f"data.path={data_dir}",
        "--set",
        "batch_size=8",
        "--set",
        "data.seq_len=32",
        "--set",
        "compute_dtype=float32",
        "--set",
        "eval_every=0",
        "--set",
        "checkpoint.every=2",
    ]


@pytest.mark.slow
def test_a_process_whose_saves_fail_exits_promptly_with_one_error(data_dir, tmp_path):
    """The checkpoint directory is fine when checked, then a file takes its place: the first
    save fails. orbax used to leave threads waiting 300 s at exit for a signal of the failed
    directory creation."""
    out = tmp_path / "run"
    command = _train_command(
        data_dir,
        out,
        """
        out.mkdir(parents=True)
        (out / "checkpoints").write_text("not a directory")
    """,
    )
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"checkpoint error: saving step 2 in {out}/checkpoints failed: NotADirectoryError"
    ), result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 60, f"exit took {elapsed:.0f} s"


@pytest.mark.slow
def test_a_damaged_checkpoint_prints_no_stray_traceback_in_the_process(data_dir, saved, tmp_path):
    out = _copy(saved, tmp_path)
    (out / "checkpoints" / "4" / "default" / "manifest.ocdbt").write_bytes(b"12345")
    result = subprocess.run(
        _train_command(data_dir, out) + ["--steps", "6"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "warning: checkpoint step 4 is damaged (" in result.stderr
    assert "resumed from step 2" in result.stdout
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr


@pytest.mark.slow
def test_a_failed_background_save_is_a_checkpoint_error(data_dir, tmp_path, monkeypatch):
    from orbax.checkpoint._src.serialization import serialization

    async def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serialization, "async_serialize_from_host", disk_full)
    cfg = _cfg(data_dir, tmp_path)
    cfg.steps = 2
    with pytest.raises(
        CheckpointError,
        match=r"saving step 2 in .*checkpoints failed: OSError: "
        r"\[Errno 28\] No space left on device",
    ):
        train.train(cfg, progress=False)


def _incompressible_state(seed):
    """{"w": float32 [64, 256] of random bits} split over the 8 devices: zstd stores such data
    as it is, so a flipped bit in its file is a flipped bit of the restored array."""
    mesh = jax.make_mesh((8,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    bits = np.random.default_rng(seed).integers(0, 2**32, (64, 256), dtype=np.uint32)
    return {"w": jax.device_put(bits.view(np.float32), sharding)}


def test_one_flipped_bit_in_an_arrays_data_is_refused(tmp_path, capsys):
    ckpt = Checkpoints(tmp_path / "checkpoints")
    for step in (1, 2):
        ckpt.save(step, _incompressible_state(step))
    ckpt.wait()
    ckpt.close()
    saved = np.asarray(_incompressible_state(2)["w"]).tobytes()
    [(path, offset)] = [
        (p, p.read_bytes().find(saved[4096:4160]))
        for p in _arrays(tmp_path / "checkpoints" / "2")
        if saved[4096:4160] in p.read_bytes()
    ]
    raw = bytearray(path.read_bytes())
    raw[offset + 10] ^= 0x04
    path.write_bytes(bytes(raw))
    state = _incompressible_state(0)
    target = abstract_like(state, jax.tree.map(lambda x: x.sharding, state))
    ckpt = Checkpoints(tmp_path / "checkpoints")
    step, restored = ckpt.restore_latest(target)
    ckpt.close()
    assert step == 1
    assert np.asarray(restored["w"]).tobytes() == np.asarray(_incompressible_state(1)["w"]).tobytes()
    assert (
        "warning: checkpoint step 2 is damaged (1 of its 1 arrays do not match their "
        "checksums in checksums.json: w); resuming from step 1"
    ) in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2.damaged"]


def test_a_step_whose_checksums_were_not_written_is_set_aside(saved, target, tmp_path, capsys):
    """What a process killed between orbax's commit of a step and its checksums leaves."""
    out = _copy(saved, tmp_path)
    (out / "checkpoints" / "4" / "checksums.json").unlink()
    ckpt = Checkpoints(out / "checkpoints")
    step, _ = ckpt.restore_latest(target)
    ckpt.close()
    assert step == 2
    assert (
        f"warning: checkpoint step 4 is damaged ({out}/checkpoints/4/checksums.json is "
        "missing: its save did not finish); resuming from step 2"
    ) in capsys.readouterr().err


@pytest.mark.slow
def test_a_nan_stop_after_resuming_names_the_step_that_verified(data_dir, saved, target, tmp_path, capsys):
    """Step 4's files replaced by well-formed ones of NaN parameters, as damage the storage
    format cannot see: the checksums refuse them, the run resumes from step 2, and the stop
    that a huge learning rate then causes names step 2 as the last good checkpoint."""
    out = _copy(saved, tmp_path)
    ckpt = Checkpoints(out / "checkpoints")
    state = ckpt.restore(4, target)
    ckpt.close()
    state["params"] = jax.tree.map(lambda x: x * np.nan, state["params"])
    forged = Checkpoints(tmp_path / "forged")
    forged.save(4, state)
    forged.wait()
    forged.close()
    shutil.rmtree(out / "checkpoints" / "4" / "default")
    shutil.copytree(tmp_path / "forged" / "4" / "default", out / "checkpoints" / "4" / "default")
    cfg = _cfg(data_dir, out)
    cfg.optimizer.lr, cfg.optimizer.clip_norm, cfg.optimizer.warmup_steps = 1e30, 0.0, 0
    cfg.checkpoint.every = 5  # the loss is NaN at step 5: no save of this run comes first
    result = train.train(cfg, progress=False)
    assert result["start_step"] == 2 and not np.isfinite(result["losses"][5])
    assert result["stopped"] and "last good checkpoint: step 2 in " in result["stopped"], result
    err = capsys.readouterr().err
    assert "warning: checkpoint step 4 is damaged (" in err and "do not match their checksums" in err


def test_every_finished_save_has_checksums_of_its_arrays(saved):
    for step in ("2", "4"):
        checksums = json.loads((saved[0] / "checkpoints" / step / "checksums.json").read_text())
        assert "params/embedding" in checksums and "opt_state/1/0/mu/embedding" in checksums
        assert all(len(words) == 2 for words in checksums.values())


# Root reads any file whatever its mode; started without the capabilities that allow it, a
# process of root's is refused by the mode like any user's.
_WITHOUT_ROOTS_READ_OVERRIDE = [
    "setpriv",
    "--bounding-set=-dac_override,-dac_read_search",
    "--inh-caps=-dac_override,-dac_read_search",
]


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() == 0 and shutil.which("setpriv") is None,
    reason="as root, needs setpriv to drop the capability to read any file",
)
def test_a_step_this_process_may_not_read_is_a_checkpoint_error(data_dir, saved, tmp_path):
    """Permission is the process's, not the files': the step is named and left where it is."""
    out = _copy(saved, tmp_path)
    step_dir = out / "checkpoints" / "4"
    before = _tree(out)
    step_dir.chmod(0)
    prefix = _WITHOUT_ROOTS_READ_OVERRIDE if os.geteuid() == 0 else []
    try:
        result = subprocess.run(
            prefix + _train_command(data_dir, out) + ["--steps", "6"], capture_output=True, text=True, timeout=120
        )
    finally:
        step_dir.chmod(0o755)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"checkpoint error: {step_dir} cannot be read by this process (Permission denied): give "
        f"it read permission, or move that step out of {out}/checkpoints to resume from an older "
        "one"
    ], result.stderr
    assert _tree(out) == before
