"""The compiler package stands alone: `import shardflow` loads neither the trainer, nor the
models, nor flax (the trainer and the models import the compiler, never the reverse), nor the
solver's scipy and HiGHS (loaded when a program is first solved)."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_importing_the_compiler_loads_no_trainer_models_or_flax():
    check = (
        "import shardflow, sys; "
        "assert not any(m.startswith('flax') for m in sys.modules), "
        "[m for m in sys.modules if m.startswith('flax')]; "
        "bad = [m for m in sys.modules if m.split('.')[:2] in "
        "(['shardflow', 'train'], ['shardflow', 'models'])]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_importing_the_compiler_loads_no_solver_libraries():
    check = (
        "import shardflow, sys; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('scipy', 'highspy')]; "
        "assert not bad, bad[:5]"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
