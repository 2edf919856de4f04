"""The passes, each ``Program -> Program`` (``shardflow.pipeline`` runs them in order)."""
import os

from jax.extend import source_info_util

# Frames of the passes are never "the user's line".
source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)) + os.sep)
