"""Lets a benchmark import shardflow from a checkout that is not pip-installed, or whose editable
install does not map the package-dir layout (the device machine): puts the repository root on
sys.path and maps passes/, models/, kernels/ to shardflow.passes / .models / .kernels by hand.

    import _checkout  # noqa: F401  (first, before any shardflow import)
"""
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
try:
  importlib.import_module("shardflow.kernels")
except ImportError:
  for name in ("kernels", "passes", "models"):
    if (ROOT / name / "__init__.py").exists():
      sys.modules[f"shardflow.{name}"] = importlib.import_module(name)
