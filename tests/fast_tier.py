"""The fast tier (``-m "not slow"``, see conftest.py) runs each hypothesis test on a tenth of its
examples: the same properties on fewer drawn programs. The full suite runs them all."""

import os


def examples(full: int) -> int:
    """Hypothesis's max_examples for a test that draws ``full`` in the full suite."""
    return max(1, full // 10) if os.environ.get("SHARDFLOW_FAST_TIER") == "1" else full
