"""The `shardflow` command: `shardflow train`, `shardflow explain`, `shardflow prepare` and
`shardflow sample`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardflow.train.devices import configure_host_platform, maybe_initialize_distributed
from shardflow.train.interrupt import Interrupted, last_checkpoint_line


def _prepare(args) -> int:
    from shardflow.train import data

    try:
        out = data.prepare(
            args.input, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size, val_fraction=args.val_fraction
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"prepare error: {e}", file=sys.stderr)
        return 2
    meta = (out / "meta.json").read_text()
    print(f"wrote {out}: {meta}")
    return 0


def main(argv=None) -> int:
    from shardflow.train import sample

    parser = argparse.ArgumentParser(prog="shardflow")
    commands = parser.add_subparsers(dest="command")
    train_parser = commands.add_parser(
        "train", help="pretrain a language model (no arguments: tiny model on the stdlib)"
    )
    add_arguments(train_parser)
    add_explain_arguments(
        commands.add_parser(
            "explain",
            help="show the training step's plan (collectives, modelled step time and "
            "memory per device) without training or writing anything",
        )
    )
    plan_parser = commands.add_parser(
        "plan",
        help="the best plans for a config's model on a cluster of mixed device kinds, with predicted time and memory",
    )
    add_explain_arguments(plan_parser)
    plan_parser.add_argument("--cluster", required=True, metavar="FILE", help="YAML: a cluster block with an inventory")
    prep = commands.add_parser("prepare", help="tokenise text files into a training data dir")
    prep.add_argument("--input", nargs="+", required=True, metavar="FILE")
    prep.add_argument("--out", required=True, metavar="DIR")
    prep.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|bpe|FILE",
        help="byte (default), bpe (trained on the inputs), or a Hugging Face tokenizer.json file",
    )
    prep.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    prep.add_argument("--val-fraction", type=float, default=0.005)
    sample.add_arguments(
        commands.add_parser("sample", help="generate text from a run's newest checkpoint or a Hugging Face model")
    )
    args = parser.parse_args(argv)
    if args.command == "train":
        return run_from_args(args)
    if args.command == "explain":
        return explain_from_args(args)
    if args.command == "plan":
        return plan_from_args(args)
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "sample":
        return sample.run_from_args(args)
    parser.print_help()
    return 2


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    """The config a run is made of: `shardflow explain`'s arguments, and the first of `train`'s."""
    parser.add_argument("--config", help="YAML file of config keys (see shardflow/train/config.py)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. optimizer.lr=3e-4",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_explain_arguments(parser)
    parser.add_argument("--steps", type=int, help="total optimizer steps")
    parser.add_argument("--out", help="run directory (checkpoints, metrics.jsonl, tb/)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def explain_from_args(args) -> int:
    configure_host_platform()
    import shardflow as sf
    from shardflow.train import config as config_lib
    from shardflow.train.planning import explain

    try:
        cfg = config_lib.load(args.config, args.overrides)
        maybe_initialize_distributed()
        print(explain(cfg))
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except sf.ShardingError as e:
        print(f"sharding error: {e}", file=sys.stderr)
        return 2
    return 0


def plan_from_args(args) -> int:
    from shardflow.train import config as config_lib
    from shardflow.train.cluster_plan import cluster_block, plan_text

    try:
        print(plan_text(config_lib.load(args.config, args.overrides), cluster_block(args.cluster)))
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


def run_from_args(args) -> int:
    configure_host_platform()
    import shardflow as sf
    from shardflow.train import config as config_lib
    from shardflow.train.checkpoint import CheckpointError
    from shardflow.train.loop import train

    cfg = None
    try:
        cfg = config_lib.load(args.config, args.overrides, steps=args.steps, out=args.out)
        maybe_initialize_distributed()
        summary = train(cfg, progress=not args.no_progress)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 1
    except sf.ShardingError as e:
        print(f"sharding error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        at = f" after step {e.step}" if isinstance(e, Interrupted) and e.step else ""
        print(f"interrupted{at}" + (f"; {last_checkpoint_line(cfg)}" if cfg else ""), file=sys.stderr)
        return 130
    if summary["stopped"]:
        return 1
    losses = summary["losses"]
    if losses:
        first, last = losses[min(losses)], losses[max(losses)]
        print(
            f"done: step {max(losses)}, loss {first:.3f} (step {min(losses)}) -> {last:.3f}; "
            f"metrics in {Path(cfg.out) / 'metrics.jsonl'}"
        )
    else:
        print(
            f"nothing to train: {cfg.out} already holds a checkpoint at step "
            f"{summary['start_step']} of {cfg.steps} (raise --steps or pick another --out)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
