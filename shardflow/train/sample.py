"""`shardflow sample`: text from a trainer run's newest checkpoint, or a Hugging Face model.

    shardflow sample --checkpoint runs/default --prompt "def main(" --max-new-tokens 200
    shardflow sample --hf path/to/llama-dir --prompt "Once upon a time" --temperature 0

A run directory (``shardflow train --out DIR``) holds the run's config (``config.json``, the
same keys as the YAML config) and its checkpoints (``checkpoints/STEP``). The config gives the
model; the run's data directory gives the tokenizer (bytes, or the ``tokenizer.json`` of a BPE
or Hugging Face tokenizer that ``shardflow prepare`` put there); the newest checkpoint that
restores gives the parameters — only those are read, not the optimizer state. A Hugging Face
directory is imported by ``shardflow.models.hf``, its ``tokenizer.json`` encoding the prompt
with the tokenizer's own special tokens (a BOS, for Llama).

Decoding recomputes the whole prefix at every step: the models scan their stacked layers over
depth with nothing to carry a KV cache, so one jitted ``fori_loop`` runs the model on a buffer
of prompt + new tokens each step and reads the logits at the last filled position (causal
attention makes the unfilled positions after it irrelevant). Cost grows with the square of
the length — for inspecting small models, not serving. Parameters and logits are float32, on
one device. An empty prompt starts a document (after the document separator the training data
put between documents). ``--temperature 0`` is greedy and so deterministic; otherwise the
draws are a function of ``--seed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path


class SampleError(ValueError):
    """Arguments or a directory that cannot be sampled from; printed as one line, exit 2."""


@dataclasses.dataclass
class Tokenizer:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    document_start: list[int]  # what an empty prompt starts with


def _byte_tokenizer() -> Tokenizer:
    return Tokenizer(
        lambda text: list(text.encode("utf-8")), lambda ids: bytes(ids).decode("utf-8", errors="replace"), [0]
    )


def _load(path: Path):
    from shardflow.train.data import load_tokenizer_file

    try:
        return load_tokenizer_file(path)
    except (OSError, ValueError) as e:
        raise SampleError(str(e)) from None


def _file_tokenizer(tok, *, special_tokens: bool, document_start: list[int]) -> Tokenizer:
    """``tok``, a loaded ``tokenizers.Tokenizer``, as the sampler's Tokenizer."""
    return Tokenizer(
        lambda text: tok.encode(text, add_special_tokens=special_tokens).ids,
        lambda ids: tok.decode(list(ids)),
        document_start,
    )


def run_tokenizer(cfg) -> Tokenizer:
    """The tokenizer a trainer run's data was prepared with."""
    from shardflow.train.data import END_OF_TEXT

    if cfg.data.path is None:  # the embedded corpus: bytes
        return _byte_tokenizer()
    data_dir = Path(cfg.data.path)
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise SampleError(f"the run's data dir {data_dir} (its tokenizer) cannot be read: {e}") from None
    kind = meta.get("tokenizer", "byte")
    if kind == "byte":
        return _byte_tokenizer()
    path = data_dir / "tokenizer.json"
    if not path.is_file():
        raise SampleError(f"the run's data dir {data_dir} has no tokenizer.json (tokenizer {kind!r})")
    tok = _load(path)
    separator = meta.get("document_separator", END_OF_TEXT[0] if kind == "bpe" else None)
    start = [] if separator is None else [tok.token_to_id(separator)]
    return _file_tokenizer(tok, special_tokens=False, document_start=start)


def restore_run(run_dir):
    """(model, step, tokenizer) from a trainer run directory's newest restorable checkpoint."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from shardflow import models
    from shardflow.train import checkpoint
    from shardflow.train import config as config_lib

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise SampleError(f"{run_dir} is not a `shardflow train` run directory (no config.json)")
    try:
        cfg = config_lib.load(str(run_dir / "config.json"))
        model_cfg = config_lib.model_config(cfg)
    except config_lib.ConfigError as e:
        raise SampleError(f"{run_dir / 'config.json'}: {e}") from None
    # Parameters do not depend on how attention splits a sequence or what is rematerialised.
    model_cfg = dataclasses.replace(model_cfg, context="auto", context_blocks=1, remat="none")
    steps = config_lib.checkpoint_steps(run_dir / "checkpoints")
    if not steps:
        raise SampleError(f"{run_dir / 'checkpoints'} holds no checkpoint to sample from")
    abstract = nnx.eval_shape(lambda: models.build(model_cfg))
    graphdef, _ = nnx.split(abstract)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {
        "params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
            nnx.to_pure_dict(nnx.state(abstract)),
        )
    }
    failures = []
    with ocp.PyTreeCheckpointer() as checkpointer:
        for step in reversed(steps):
            try:
                restored = checkpointer.restore(
                    (run_dir / "checkpoints" / str(step) / "default").absolute(),
                    args=ocp.args.PyTreeRestore(
                        item=target,
                        partial_restore=True,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    ),
                )
                checkpoint.verify_checksums(run_dir / "checkpoints" / str(step), step, restored, partial=True)
            except Exception as e:  # whatever orbax makes of missing, broken or altered files
                failures.append(f"step {step}: {type(e).__name__}: {str(e).splitlines()[0]}")
                continue
            for failure in failures:
                print(f"warning: skipped checkpoint {failure}", file=sys.stderr)
            return nnx.merge(graphdef, restored["params"]), step, run_tokenizer(cfg)
    raise SampleError(f"no checkpoint in {run_dir / 'checkpoints'} restores: " + "; ".join(failures))


def load_hf(directory):
    """(model, tokenizer) from a Hugging Face model directory with its tokenizer.json."""
    from shardflow.models import hf

    directory = Path(directory)
    model = hf.load_model(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise SampleError(f"{directory} has no tokenizer.json to encode the prompt with")
    return model, _file_tokenizer(_load(path), special_tokens=True, document_start=[])


def generate(
    model, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None, seed: int = 0
) -> list[int]:
    """``max_new_tokens`` token ids following ``prompt`` (a non-empty list of ids)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    cfg = model.cfg
    total = len(prompt) + max_new_tokens
    limit = min(cfg.max_seq_len, cfg.sliding_window or cfg.max_seq_len)
    limit_name = "max_seq_len / sliding_window" if cfg.sliding_window else "max_seq_len"
    if not (math.isfinite(temperature) and temperature >= 0):
        raise SampleError(f"--temperature must be a number >= 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
        raise SampleError(f"--top-k must be in [1, {cfg.vocab_size}] (the vocabulary), got {top_k}")
    if max_new_tokens < 1:
        raise SampleError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not prompt:
        raise SampleError("the prompt encodes to no tokens")
    if total > limit:
        raise SampleError(
            f"the prompt ({len(prompt)} tokens) and --max-new-tokens "
            f"({max_new_tokens}) make {total} positions, more than the model's "
            f"{limit} ({limit_name})"
        )
    graphdef, state = nnx.split(model)

    def pick(logits, key):
        if temperature == 0:
            return jnp.argmax(logits)
        if top_k is not None:
            logits = jnp.where(logits < jax.lax.top_k(logits, top_k)[0][-1], -jnp.inf, logits)
        return jax.random.categorical(key, logits / temperature)

    @jax.jit
    def decode(state, buffer, key):
        model = nnx.merge(graphdef, state)

        def step(t, buffer):
            logits = model(buffer)[0, t - 1].astype(jnp.float32)
            token = pick(logits, jax.random.fold_in(key, t))
            return buffer.at[0, t].set(token.astype(buffer.dtype))

        return jax.lax.fori_loop(len(prompt), total, step, buffer)

    buffer = jnp.zeros((1, total), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt))
    state = jax.tree.map(lambda x: x.astype(jnp.float32), state)
    out = decode(state, buffer, jax.random.key(seed))
    return [int(t) for t in jax.device_get(out)[0, len(prompt) :]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="OUT_DIR", help="a `shardflow train` run directory (its --out)")
    source.add_argument(
        "--hf", metavar="DIR", help="a Hugging Face model directory (config.json, safetensors, tokenizer.json)"
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None, help="draw among the k likeliest")
    parser.add_argument("--seed", type=int, default=0)


def run_from_args(args) -> int:
    from shardflow.models.hf import HFCheckpointError

    try:
        if args.checkpoint is not None:
            model, step, tokenizer = restore_run(args.checkpoint)
            source = f"step {step} of {args.checkpoint}"
        else:
            (model, tokenizer), source = load_hf(args.hf), args.hf
        prompt = tokenizer.encode(args.prompt) if args.prompt else []
        ids = generate(
            model,
            prompt or tokenizer.document_start,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
    except (SampleError, HFCheckpointError) as e:
        print(f"sample error: {e}", file=sys.stderr)
        return 2
    print(tokenizer.decode(prompt + ids))
    print(
        f"sampled {len(ids)} tokens from {source} (temperature {args.temperature}"
        f"{f', top-k {args.top_k}' if args.top_k else ''}, seed {args.seed})",
        file=sys.stderr,
    )
    return 0
