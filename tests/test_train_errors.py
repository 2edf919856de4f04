"""`shardflow train` refuses a bad config with one `config error:` line, exit code 2, before
anything compiles and before anything is written to the run's directory."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shardflow.train import cli, steps


def _argv(out):
    return [
        "train",
        "--out",
        str(out),
        "--steps",
        "2",
        "--set",
        "model={preset: tiny, d_model: 64, n_layers: 1, head_dim: 8, max_seq_len: 32}",
        "--set",
        "batch_size=8",
        "--set",
        "data.seq_len=32",
        "--set",
        "checkpoint.every=1",
    ]


def _token_dir(path, n_tokens, meta=None):
    path.mkdir()
    (np.arange(n_tokens) % 256).astype(np.uint16).tofile(path / "train.bin")
    (np.arange(256) % 256).astype(np.uint16).tofile(path / "val.bin")
    (path / "meta.json").write_text(meta if meta is not None else json.dumps({"vocab_size": 256, "dtype": "uint16"}))
    return path


def _data(n_tokens=4096, meta=None):
    return lambda tmp: ["--set", f"data.path={_token_dir(tmp / 'tokens', n_tokens, meta)}"]


def _config_file(text):
    def make(tmp):
        (tmp / "run.yaml").write_text(text)
        return ["--config", str(tmp / "run.yaml")]

    return make


def _file_in_the_way(relative):
    def make(tmp):
        (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp / relative).write_text("")
        return []

    return make


def _checkpoints_of_another_run(*steps, resume="false"):
    def make(tmp):
        for step in steps:
            (tmp / "run" / "checkpoints" / str(step) / "default").mkdir(parents=True)
            (tmp / "run" / "checkpoints" / str(step) / "default" / "_METADATA").write_text("{}")
        return ["--set", f"checkpoint.resume={resume}"]

    return make


def _pipeline(*settings, n_layers=None):
    """mesh {data: 2, pipe: 4} and pipeline.stages=4, then pipeline.KEY=VALUE settings (or
    plain arguments after a "--set"), the model's layers set to n_layers."""

    def make(tmp):
        args = ["--set", "mesh={data: 2, pipe: 4}", "--set", "pipeline.stages=4"]
        plain = list(settings).index("--set") if "--set" in settings else len(settings)
        args += [a for s in settings[:plain] for a in ("--set", f"pipeline.{s}")]
        args += list(settings[plain:])
        return args + (["--set", f"model.n_layers={n_layers}"] if n_layers else [])

    return make


# name -> (what makes the case: tmp dir -> extra arguments, expected message fragment)
CASES = {
    "mesh an int": (
        lambda tmp: ["--set", "mesh=8"],
        "mesh must map axis names to sizes, e.g. {data: 2, model: 4}; got 8",
    ),
    "model size a word": (
        lambda tmp: ["--set", "model.d_model=big"],
        "model.d_model must be a positive integer, got 'big'",
    ),
    "negative mesh sizes": (
        lambda tmp: ["--set", "mesh={data: -2, model: -4}"],
        "mesh axis 'data' must have a positive integer size or auto, got -2",
    ),
    "empty data file": (_data(n_tokens=0), "train.bin is empty"),
    "data shorter than a sequence": (
        _data(n_tokens=20),
        "train.bin has 20 tokens, too few for sequences of data.seq_len 32",
    ),
    "meta.json not JSON": (
        _data(meta="{vocab_size: "),
        "meta.json is not a `shardflow prepare` meta.json (Expecting property name",
    ),
    "meta.json without dtype": (_data(meta='{"vocab_size": 256}'), "(no key 'dtype')"),
    "missing --config file": (lambda tmp: ["--config", str(tmp / "nope.yaml")], "nope.yaml: No such file or directory"),
    "YAML syntax error": (
        _config_file("steps: [1\n"),
        "run.yaml is not valid YAML: expected ',' or ']', but got '<stream end>' at line 2",
    ),
    "--set YAML syntax error": (
        lambda tmp: ["--set", "model={preset: tiny"],
        "--set 'model={preset: tiny' is not valid YAML",
    ),
    "checkpoint path a file": (
        _file_in_the_way("run/checkpoints"),
        "the checkpoint directory '{tmp}/run/checkpoints' is a file",
    ),
    "out a file": (_file_in_the_way("run"), "out '{tmp}/run' is a file, not a directory"),
    "resume=false over checkpoints": (
        _checkpoints_of_another_run(2, 4),
        "checkpoint.resume is false but {tmp}/run/checkpoints holds checkpoints (steps 2, 4), "
        "which this run could not replace: orbax saves no step at or below 4 there. Resume from "
        "them (checkpoint.resume=true), train into a fresh --out directory, or delete "
        "{tmp}/run/checkpoints yourself",
    ),
    "boolean a word": (
        lambda tmp: ["--set", "checkpoint.resume=maybe"],
        "checkpoint.resume must be true or false, got 'maybe'",
    ),
    # pipeline parallelism (docs/tutorials/pipelining.md): mesh {data: 2, pipe: 4}, pipeline.stages=4
    "pipeline stages not the pipe axis's size": (
        _pipeline("stages=2"),
        "pipeline.stages 2 must equal the size of mesh axis 'pipe' (4, mesh {'data': 2, 'pipe': 4})",
    ),
    "pipeline without a pipe axis": (
        lambda tmp: ["--set", "pipeline.stages=4"],
        "pipeline.stages 4 runs on mesh axis 'pipe', which the mesh {'data': 8} lacks; give it "
        "one, e.g. mesh={data: 2, pipe: 4}",
    ),
    "layers not divisible by the stages": (
        _pipeline(),
        "model.n_layers 1 does not split into pipeline.stages 4; pipeline.layers_per_stage gives an uneven split",
    ),
    "layers not divisible by stages x chunks": (
        _pipeline("schedule=zb-v", n_layers=4),
        "model.n_layers 4 does not split into pipeline.stages 4 x 2 chunks (zb-v); "
        "pipeline.layers_per_stage gives an uneven split",
    ),
    "uneven split of the wrong length": (
        _pipeline("schedule=zb-v", "layers_per_stage=[2, 1, 1, 1]", n_layers=4),
        "pipeline.layers_per_stage [2, 1, 1, 1] must give 8 counts (pipeline.stages 4 x 2 chunks "
        "(zb-v)) summing to model.n_layers 4",
    ),
    "uneven split of layers the axis cannot store": (
        _pipeline("layers_per_stage=[2, 2, 1, 1]", n_layers=6),
        "model.n_layers 6 is stored split over pipeline.stages 4: with layers_per_stage too it must divide by 4",
    ),
    "uneven split not a list": (
        _pipeline("layers_per_stage=3", n_layers=4),
        "pipeline.layers_per_stage must be a list of positive integers (or null: an even split), got 3",
    ),
    "batch not divisible by the micro-batches": (
        _pipeline("microbatches=8", n_layers=4),
        "micro-batch 8 (batch_size 8 / grad_accum 1) does not split into "
        "pipeline.microbatches 8 x the data axes ('data',) (2 ways)",
    ),
    "unknown schedule": (
        _pipeline("schedule=pipedream", n_layers=4),
        "unknown pipeline schedule 'pipedream'; the built-in ones are gpipe, 1f1b, 1f1b-fused, "
        "interleaved, zb-h1, zb-v, zb-fused",
    ),
    "interleaved micro-batches not a multiple of the stages": (
        _pipeline("schedule=interleaved", "microbatches=2", n_layers=8),
        "interleaved: the number of microbatches must be a multiple of the number of stages "
        "(the schedule runs microbatches in groups of p = 4), got m = 2; use m = 4 or 4",
    ),
    "pipeline stages a word": (
        _pipeline("stages=four"),
        "pipeline.stages must be a positive integer (or null: no pipeline), got 'four'",
    ),
    "pipeline key misspelt": (
        _pipeline("stage=4"),
        "unknown config key 'pipeline.stage'; valid "
        "keys here: axis, chunks, layers_per_stage, "
        "microbatches, schedule, stages",
    ),
    "pipeline under the jit engine": (
        _pipeline("microbatches=2", "--set", "engine=jit", n_layers=4),
        "pipeline runs under engine 'shardflow' (sf.parallelize runs its schedule), not 'jit'",
    ),
    "pp strategy without a pipeline": (
        lambda tmp: ["--set", "strategy=pp", "--set", "mesh={pipe: 8}"],
        "strategy 'pp' puts the stacked layers on mesh axis 'pipe', which only a pipeline runs "
        "them on: set pipeline.stages to its size",
    ),
    # context parallelism: the sequence split over the mesh axis "context"
    "sequence not divisible by the context axis": (
        lambda tmp: ["--set", "mesh={data: 2, context: 4}", "--set", "strategy=cp", "--set", "data.seq_len=30"],
        "data.seq_len 30 is not divisible by 4: strategy 'cp' splits the sequence over mesh axes ('context',) (4 ways)",
    ),
    "zigzag sequence not in 2 chunks per device": (
        lambda tmp: [
            "--set",
            "mesh={data: 2, context: 4}",
            "--set",
            "strategy=cp",
            "--set",
            "model.context=zigzag",
            "--set",
            "data.seq_len=12",
        ],
        "data.seq_len 12 is not divisible by 8: strategy 'cp' splits the sequence over mesh axes "
        "('context',) (4 ways) (model.context 'zigzag': 2 chunks per device)",
    ),
    "ulysses with kv heads not divisible by the context axis": (
        lambda tmp: ["--set", "mesh={data: 1, context: 8}", "--set", "strategy=cp", "--set", "model.context=ulysses"],
        "model.context 'ulysses' splits the attention heads over mesh axes ('context',) (8 ways), "
        "so the kv heads must divide by 8: model.n_kv_heads is 4",
    ),
    "ulysses over the heads' tensor-parallel axis too": (
        lambda tmp: [
            "--set",
            "mesh={context: 4, model: 2}",
            "--set",
            "strategy={seq: context, heads: model, kv_heads: model}",
            "--set",
            "model.context=ulysses",
        ],
        "model.context 'ulysses' splits the attention heads over mesh axes ('model', 'context') "
        "(8 ways), so the kv heads must divide by 8: model.n_kv_heads is 4",
    ),
    "misspelt logical axis in a strategy table": (
        lambda tmp: ["--set", "strategy={batch: data, embd: data}"],
        "strategy {'batch': 'data', 'embd': 'data'}: the rules table names logical axis 'embd', "
        "which the model does not have; its logical axes: batch, embed, head_dim, heads, "
        "kv_heads, layers, mlp, norm, seq, vocab",
    ),
    "pipe axis without a pipeline": (
        lambda tmp: ["--set", "mesh={data: 2, pipe: 4}"],
        "mesh axis 'pipe' has 4 devices but no pipeline runs on it (every one would compute the "
        "same): set pipeline.stages=4, or drop the axis from the mesh",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_config_errors_are_one_line_exit_2_and_write_nothing(name, tmp_path, capsys, monkeypatch):
    make, message = CASES[name]
    compiles = []
    monkeypatch.setattr(steps, "parallelize_step", lambda *a, **k: compiles.append(1))
    extra = make(tmp_path)  # before the default data dir, so a case's --set data.path wins
    out = tmp_path / "run"
    before = sorted(out.rglob("*")) if out.is_dir() else out.exists()
    argv = _argv(out)
    if "data.path=" not in " ".join(extra):
        argv += _data()(tmp_path)
    code = cli.main(argv + extra)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("config error: "), err
    assert message.replace("{tmp}", str(tmp_path)) in err
    assert compiles == []
    assert (sorted(out.rglob("*")) if out.is_dir() else out.exists()) == before


def test_an_unwritable_checkpoint_directory_is_refused_before_compiling(tmp_path, capsys, monkeypatch):
    """(Root writes anywhere, so the directory's permission is what os.access says.)"""
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode, **kw: os.fspath(path) != str(ckpt_dir) and real_access(path, mode, **kw)
    )
    monkeypatch.setattr(steps, "parallelize_step", lambda *a, **k: pytest.fail("compiled"))
    assert cli.main(_argv(tmp_path / "run") + _data()(tmp_path)) == 2
    assert capsys.readouterr().err == (f"config error: the checkpoint directory '{ckpt_dir}' is not writable\n")
    assert list((tmp_path / "run").rglob("*")) == [ckpt_dir]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,message",
    [
        (["--set", "mesh=8"], "config error: mesh must map axis names to sizes"),
        (["--config", "/nonexistent/run.yaml"], "config error: --config /nonexistent/run.yaml: No such"),
    ],
)
def test_the_process_exits_2_without_a_traceback(extra, message, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "shardflow.train", "--out", str(tmp_path / "run"), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_only_numbered_step_folders_count_as_checkpoints_in_the_way(tmp_path):
    """Steps set aside as damaged and orbax's unfinished temporary folders are no steps: a run
    that does not resume may start there (orbax would save every step)."""
    from shardflow.train import config

    ckpt_dir = tmp_path / "checkpoints"
    for name in ("4.damaged", "4.damaged1", "6.orbax-checkpoint-tmp-1234"):
        (ckpt_dir / name).mkdir(parents=True)
    (ckpt_dir / "8").write_text("a file, not a step")
    cfg = config.load(overrides=["checkpoint.resume=false"], out=str(tmp_path))
    config.check_not_overwriting(cfg)
    assert config.checkpoint_steps(ckpt_dir) == []
    for step in (10, 2, 6, 4, 12, 14):
        (ckpt_dir / str(step)).mkdir()
    assert config.checkpoint_steps(ckpt_dir) == [2, 4, 6, 10, 12, 14]
    with pytest.raises(config.ConfigError, match=r"\(steps 2, 4, 6, 10, 12, 14\)"):
        config.check_not_overwriting(cfg)
    (ckpt_dir / "16").mkdir()
    with pytest.raises(config.ConfigError, match=r"\(steps 2, 4, 6, \.\.\., 16; 7 in all\)"):
        config.check_not_overwriting(cfg)
    cfg.checkpoint.resume = True
    config.check_not_overwriting(cfg)


@pytest.mark.parametrize("out", ["5", "[runs, a]"])
def test_out_that_is_not_a_path_is_a_config_error(out, tmp_path, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text(f"out: {out}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(steps, "parallelize_step", lambda *a, **k: pytest.fail("compiled"))
    code = cli.main(["train", "--config", "run.yaml", "--steps", "2", *_data()(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("config error: out must be a directory path (a string), got "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml", "tokens"]
