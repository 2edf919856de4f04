"""benchmarks/attention.py's timing and variant modes on CPU, the GPU kernels replaced by the
Triton kernels in interpret mode (the modes themselves run on the device machine)."""

import functools
import importlib.util
import re
import sys
from pathlib import Path

import jax
import pytest

from shardflow.kernels import flash_attention_gpu

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "attention.py"


@pytest.fixture
def bench(monkeypatch):
    if str(SCRIPT.parent) not in sys.path:
        monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("attention_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ANCHOR_SHAPES", [(1, 128, 4, 2, 64)])
    for name in ("forward", "backward"):
        interpreted = functools.partial(getattr(flash_attention_gpu, name), interpret=True)
        monkeypatch.setattr(flash_attention_gpu, name, interpreted)
    return module


def test_time_samples_pipelines_calls(bench):
    calls = []
    samples = bench.time_samples(lambda: calls.append(1) or jax.numpy.zeros(()), (), iters=25)
    assert len(calls) == 20 and len(samples) == 2  # whole batches of PIPELINED calls
    assert all(t > 0 for t in samples)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["--fwd", "--bwd"])
def test_kernel_variants(bench, direction, tmp_path, monkeypatch, capsys):
    variant = tmp_path / "variant.py"
    variant.write_text(
        "from . import flash_attention_gpu\n"
        "def forward(q, k, v, *, causal, scale):\n"
        "  return flash_attention_gpu.forward(q, k, v, None, 0, causal=causal, scale=scale,\n"
        "                                     allow_mosaic=False)\n"
        "def backward(q, k, v, out, lse, dout, *, causal, scale):\n"
        "  return flash_attention_gpu.backward(q, k, v, None, 0, out, lse, dout, causal=causal,\n"
        "                                      scale=scale, allow_mosaic=False)\n"
    )
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "attention.py",
            direction,
            "--causal",
            "yes",
            "--rounds",
            "1",
            "--iters",
            "10",
            "--warmup",
            "0",
            "--variants",
            f"same={variant}",
        ],
    )
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert ("backward" if direction == "--bwd" else "forward") + " alone" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| 1,128,4/2,64")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "yes"  # --causal yes: the causal row only
    assert float(cells[2]) > 0 and float(cells[5]) > 0  # wall ms of the variant and of Triton
    assert cells[3] == cells[6] == "nan"  # device ms: a GPU profiler trace, none here
    assert re.fullmatch(r"same 0\.0e\+00", cells[8])  # the variant is the reference kernel


@pytest.mark.slow
def test_table(bench, monkeypatch, capsys):
    """The table's rows and ratios, its three contenders replaced by CPU-runnable ones."""
    from shardflow.attention import attention

    def contenders(causal, group):
        return {
            name: functools.partial(attention, causal=causal, backend=backend)
            for name, backend in (("cudnn", "xla"), ("ours", "interpret"), ("triton_mha", "xla"))
        }

    monkeypatch.setattr(bench, "implementations", contenders)
    monkeypatch.setattr(
        sys, "argv", ["attention.py", "--shapes", "1,256,4,4,64", "--causal", "yes", "--iters", "10", "--warmup", "0"]
    )
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "TFLOP/s from device time" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1,")]
    assert len(rows) == 1  # --shapes and --causal, not the anchors
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[0] == "1,256,4/4,64" and len(cells) == 13 and cells[1] == "yes"
    assert all(c == "nan" for c in cells[2:11])  # device time: a GPU profiler trace, none here
    assert all(float(c) > 0 for c in cells[11:])  # wall-clock ratios ours/cuDNN
