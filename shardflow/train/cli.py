"""The `shardflow` command: `shardflow train`, `shardflow explain`, `shardflow prepare` and
`shardflow sample`."""

from __future__ import annotations

import argparse
import sys


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
    from shardflow.train import loop, sample

    parser = argparse.ArgumentParser(prog="shardflow")
    commands = parser.add_subparsers(dest="command")
    train_parser = commands.add_parser(
        "train", help="pretrain a language model (no arguments: tiny model on the stdlib)"
    )
    loop.add_arguments(train_parser)
    loop.add_explain_arguments(
        commands.add_parser(
            "explain",
            help="show the training step's plan (collectives, modelled step time and "
            "memory per device) without training or writing anything",
        )
    )
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
        return loop.run_from_args(args)
    if args.command == "explain":
        return loop.explain_from_args(args)
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "sample":
        return sample.run_from_args(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
