"""Lets a benchmark import shardflow from a checkout that is not pip-installed, or whose editable
install does not map the package-dir layout (the device machine): puts the repository root on
sys.path and finds shardflow.passes / .models / .kernels (and their submodules) in passes/,
models/, kernels/, as pyproject.toml's package-dir does for an install.

    import _checkout  # noqa: F401  (first, before any shardflow import)
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ("passes", "models", "kernels")


class _PackageDirs(importlib.abc.MetaPathFinder):
    """shardflow.<name>[.sub...] for <name> in LAYOUT, from ROOT/<name>[/sub...]."""

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != "shardflow" or parts[1] not in LAYOUT:
            return None
        where = ROOT.joinpath(*parts[1:])
        if (where / "__init__.py").exists():
            return importlib.util.spec_from_file_location(
                fullname, where / "__init__.py", submodule_search_locations=[str(where)]
            )
        if where.with_suffix(".py").exists():
            return importlib.util.spec_from_file_location(fullname, where.with_suffix(".py"))
        return None


sys.path.insert(0, str(ROOT))
sys.meta_path.insert(0, _PackageDirs())
