"""`shardflow train` with a `cluster:` block: it runs hetero.search's best plan for the config's
model and batch on the inventory (8 simulated CPU devices standing in for the kinds), and its
losses are those of the same run configured by hand with the settings it prints; settings that
contradict the plan, plans it cannot express and a device count other than the inventory's are
config errors."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from shardflow.train import cli

TINY = {"preset": "tiny", "d_model": 64, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "head_dim": 8, "ffn_dim": 128}
FAST_AND_SLOW = {"inventory": {"H100": 4, "A100-40GB": 4}, "per_node": 4}


def write_config(path: Path, data_dir, **keys) -> str:
    base = {
        "model": TINY,
        "data": {"path": str(data_dir), "seq_len": 32},
        "batch_size": 16,
        "compute_dtype": "float32",
        "log_every": 1,
        "eval_every": 0,
        "checkpoint": {"every": 0},
    }
    path.write_text(yaml.safe_dump(base | keys, sort_keys=False))
    return str(path)


def train(tmp_path, name, config, *settings):
    out = tmp_path / name
    argv = ["train", "--config", config, "--out", str(out), "--steps", "2", "--no-progress"]
    argv += [arg for key in settings for arg in ("--set", key)]
    return cli.main(argv), out


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_runs_the_cluster_plan_as_the_settings_it_prints(data_dir, tmp_path, capsys):
    """4 H100 + 4 A100-40GB: the run logs the plan (its row, prediction and settings, the CPU
    devices standing in), writes it to cluster_plan.json, and its two losses equal those of a run
    without the block given the printed settings."""
    code, planned = train(tmp_path, "planned", write_config(tmp_path / "c.yaml", data_dir, cluster=FAST_AND_SLOW))
    assert code == 0
    out = capsys.readouterr().out
    assert "cluster plan for 4 x H100, 4 x A100-40GB (8 devices; 8 simulated CPU devices stand in" in out
    assert "pipelines (stage kind x tp)" in out
    (line,) = [s for s in out.splitlines() if s.startswith("runs as: shardflow train ")]
    settings = [k.strip().strip('"') for k in line.split("--set ")[1:]]
    metadata = json.loads((planned / "cluster_plan.json").read_text())
    assert metadata["settings"] == settings and metadata["simulated_on_cpu"] is True
    assert metadata["predicted"]["seconds_per_step"] > 0
    assert sum(s["tp"] for p in metadata["plan"]["pipelines"] for s in p["stages"]) == 8

    code, by_hand = train(tmp_path, "by-hand", write_config(tmp_path / "h.yaml", data_dir), *settings)
    assert code == 0
    assert "cluster plan" not in capsys.readouterr().out
    np.testing.assert_allclose(losses(planned), losses(by_hand), rtol=1e-6)
    assert len(losses(planned)) == 2


def test_a_setting_that_contradicts_the_plan_is_a_config_error_naming_both(data_dir, tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", data_dir, cluster=FAST_AND_SLOW, mesh={"data": 8})
    code, out = train(tmp_path, "run", config, "model.remat=full")
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith("config error: cluster: the plan sets keys the config also gives, differently (") and (
        err.count("\n") == 1
    )
    assert "mesh: the config gives {data: 8}, the plan {" in err
    assert "model.remat: the config gives full, the plan none" in err


def test_a_plan_of_mixed_tensor_parallel_widths_is_a_config_error(data_dir, tmp_path, capsys, monkeypatch):
    """H100 + T4 for the tiny preset, the search's plans narrowed to those that give the T4s
    another tensor-parallel width than the H100s (which one mesh cannot run)."""
    from shardflow import hetero
    from shardflow.train import cluster_plan

    def mixed_widths_only(*args, **kwargs):
        result = search(*args, **kwargs)
        mixed = tuple(c for c in result.candidates if not cluster_plan.trainer_settings(c.plan))
        assert mixed, "the search found no plan of mixed widths to test with"
        return dataclasses.replace(result, candidates=mixed)

    search = hetero.search
    monkeypatch.setattr(hetero, "search", mixed_widths_only)
    cluster = {"inventory": {"H100": 4, "T4": 4}, "per_node": 4}
    model = {"preset": "tiny", "n_layers": 4}
    config = write_config(tmp_path / "c.yaml", data_dir, cluster=cluster, model=model, data={"seq_len": 64})
    code, _ = train(tmp_path, "run", config)
    assert code == 2
    err = capsys.readouterr().err
    assert "config error: cluster: the best plan for 4 x H100, 4 x T4 gives the kinds different tensor-parallel" in err
    assert ": shardflow train cannot run it;" in err


def test_a_mixed_width_plan_names_the_best_plan_the_trainer_runs(tmp_path, capsys):
    """A 1B model on 4 H100 + 4 A100-40GB: the best plan on all 8 mixes widths; the error gives
    the command of the best one that does not, and that command's settings validate."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"cluster": FAST_AND_SLOW, "model": "1b", "batch_size": 16}))
    assert cli.main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "different tensor-parallel widths" in err and "the best plan it runs on all 8 is predicted" in err
    settings = [k.strip().strip('"') for k in err.split(" (without the cluster block)")[0].split("--set ")[1:]]
    from shardflow.train import config as config_lib

    config_lib.validate(config_lib.load(None, ["model=1b", *settings]), 8)


def test_the_inventory_must_be_the_devices(data_dir, tmp_path, capsys):
    cluster = {"inventory": {"H100": 4, "A100-40GB": 2}, "per_node": 4}
    code, _ = train(tmp_path, "run", write_config(tmp_path / "c.yaml", data_dir, cluster=cluster))
    assert code == 2
    err = capsys.readouterr().err
    assert err == "config error: cluster: the inventory (4 x H100, 2 x A100-40GB) has 6 devices, but this run has 8\n"


# ------------------------------------------------------------------------------ placement by kind


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    device_kind: str
    process_index: int


def test_jax_device_kinds_read_as_the_catalogues():
    from shardflow.hetero.devices import CATALOGUE, catalogue_kind

    seen = {
        "NVIDIA H100 80GB HBM3": "H100",
        "NVIDIA H100 PCIe": "H100-PCIe",
        "NVIDIA H200": "H200",
        "NVIDIA GH200 480GB": "GH200",
        "NVIDIA A100-SXM4-40GB": "A100-40GB",
        "NVIDIA A100 80GB PCIe": "A100-80GB",
        "NVIDIA A10G": "A10G",
        "NVIDIA A10": "A10",
        "Tesla V100-SXM2-32GB": "V100-32GB",
        "NVIDIA GeForce RTX 2080 Ti": "RTX-2080Ti",
        "NVIDIA GeForce RTX 3090": "RTX-3090",
        "NVIDIA TITAN RTX": "Titan-RTX",
        "cpu": None,
    }
    for device_kind, kind in seen.items():
        assert catalogue_kind(device_kind, CATALOGUE) == kind, device_kind


def test_each_stage_is_placed_on_devices_of_its_kind_a_group_on_one_host():
    from shardflow.hetero.devices import catalogue_kind
    from shardflow.hetero.simulate import Pipeline, Plan, Stage
    from shardflow.train.cluster_plan import place_by_kind

    # jax's order interleaves the kinds: host 0 has A100s then H100s, host 1 the reverse
    a100, h100 = "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3"
    devices = [FakeDevice(i, a100 if i in (0, 1, 6, 7) else h100, i // 4) for i in range(8)]
    fast_then_slow = Pipeline((Stage("H100", 2, 3), Stage("A100-40GB", 2, 1)), 3)
    plan = Plan((fast_then_slow, fast_then_slow), micro_batch=2)
    grid = np.asarray(place_by_kind(plan, devices)).reshape(2, 2, 2)  # pipe, data, model
    for stage, kind in enumerate(("H100", "A100-40GB")):
        for replica in range(2):
            group = grid[stage, replica]
            assert {catalogue_kind(d.device_kind, [kind]) for d in group} == {kind}
            assert len({d.process_index for d in group}) == 1
    assert sorted(d.id for d in grid.flat) == list(range(8))


def test_devices_not_of_the_plans_kinds_are_a_config_error():
    from shardflow.hetero.simulate import Pipeline, Plan, Stage
    from shardflow.train.cluster_plan import place_by_kind
    from shardflow.train.config import ConfigError

    plan = Plan((Pipeline((Stage("H100", 4, 4),), 1), Pipeline((Stage("A100-40GB", 4, 4),), 1)), micro_batch=2)
    devices = [FakeDevice(i, "NVIDIA H100 80GB HBM3" if i < 6 else "NVIDIA L4", 0) for i in range(8)]
    with pytest.raises(ConfigError, match=r"4 x H100.*4 x A100-40GB.*6 x H100.*NVIDIA L4"):
        place_by_kind(plan, devices)


@dataclasses.dataclass
class Gpu:
    id: int
    device_kind: str
    process_index: int
    bytes_limit: int | None = None  # what memory_stats() reports; None for a device of another host
    platform: str = "gpu"

    def memory_stats(self):
        assert self.process_index == 0, "a device of another host cannot be read"
        return {"bytes_limit": self.bytes_limit}


H100_KIND, A100_KIND = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"


def test_the_solvers_budget_is_the_smallest_device_of_the_mesh():
    """Every device holds blocks of the same shapes, so the smallest bounds the plan: read where
    the device is this process's, by kind elsewhere (a local device of the kind, else the
    catalogue's memory at the share XLA takes here)."""
    from shardflow.hetero.devices import memory_limit

    h100s = [Gpu(i, H100_KIND, 0, 60 * 10**9) for i in range(4)]
    assert memory_limit(h100s + [Gpu(4, A100_KIND, 0, 30 * 10**9)]) == 30 * 10**9
    # an A100 of another host, as this host's A100: its limit
    assert memory_limit(h100s + [Gpu(4, A100_KIND, 0, 31 * 10**9), Gpu(5, A100_KIND, 1)]) == 31 * 10**9
    # an A100 of another host, none here: 40 GB at the 60/80 XLA takes of this host's H100s
    assert memory_limit(h100s + [Gpu(5, A100_KIND, 1)]) == 30 * 10**9
    # H100s of another host, read as this host's
    assert memory_limit(h100s + [Gpu(5, H100_KIND, 1)]) == 60 * 10**9
    # an L4 of another host: 24 GB at the same share
    assert memory_limit(h100s + [Gpu(5, "NVIDIA L4", 1)]) == 18 * 10**9
    with pytest.raises(ValueError, match="NVIDIA B200 devices of other hosts.*not a catalogue kind"):
        memory_limit(h100s + [Gpu(5, "NVIDIA B200", 1)])
    assert memory_limit([Gpu(0, "cpu", 0, platform="cpu")]) is None
    assert memory_limit(h100s + [Gpu(4, A100_KIND, 0)]) is None  # a device here that reports no limit: no bound


def test_a_budget_of_unknown_memory_is_a_sharding_error():
    import types

    import shardflow as sf
    from shardflow.passes.solve.build import budget

    mesh = types.SimpleNamespace(devices=np.array([Gpu(0, H100_KIND, 0, 6e10), Gpu(1, "NVIDIA B200", 1)]))
    with pytest.raises(sf.ShardingError, match="NVIDIA B200.*give the plan a memory_budget"):
        budget(types.SimpleNamespace(memory_budget=None, mesh=mesh))
    assert budget(types.SimpleNamespace(memory_budget=123, mesh=mesh)) == 123
