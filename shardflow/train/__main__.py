"""``python -m shardflow.train ...``: the same as ``shardflow train ...``."""

import sys

from shardflow.train.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
