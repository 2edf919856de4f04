"""Token data: ``shardflow prepare`` writes flat token files; training memory-maps them.

A prepared directory holds ``train.bin`` and ``val.bin`` (flat little-endian uint16 or uint32
token ids) and ``meta.json`` (vocab size, dtype, tokenizer). Tokenizers:

- ``byte`` (default): token = byte value, vocabulary 256; documents are separated by byte 0,
  which never occurs in text files.
- ``bpe``: byte-level BPE trained on the inputs with the ``tokenizers`` library; the trained
  ``tokenizer.json`` is saved alongside; documents end with ``<|endoftext|>`` (id 0).
- a Hugging Face ``tokenizer.json`` file (``tokenizers.Tokenizer.from_file``), copied alongside;
  text is encoded without the tokenizer's own special tokens, and documents end with its
  end-of-text token (the first of ``END_OF_TEXT`` in its vocabulary; meta.json's
  ``document_separator`` names it, or is null where it has none).

With no data path the trainer uses an embedded corpus that exists on every machine: the
``.py`` sources of the running Python's standard library, byte-tokenised once into a cache dir.

A batch is a pure function of (seed, step): resuming at step s reads exactly the batches an
uninterrupted run would have read. Each process reads only the rows of its own devices.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from shardflow.train.config import ConfigError

DEFAULT_CORPUS_BYTES = 24 << 20  # enough text for minutes of CPU training, quick to build


def stdlib_sources(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """The standard library's .py files in a fixed order, up to about max_bytes of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    return files


def _token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def _tokenize_bytes(files) -> tuple[np.ndarray, int]:
    chunks = []
    for path in files:
        chunks.append(np.frombuffer(Path(path).read_bytes().replace(b"\0", b""), np.uint8))
        chunks.append(np.zeros(1, np.uint8))  # document separator
    return np.concatenate(chunks).astype(np.uint16), 256


def _tokenize_bpe(files, vocab_size: int, out: Path) -> tuple[np.ndarray, int]:
    from tokenizers import ByteLevelBPETokenizer

    eot = "<|endoftext|>"
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train([str(f) for f in files], vocab_size=vocab_size, special_tokens=[eot], show_progress=False)
    tokenizer.save(str(out / "tokenizer.json"))
    eot_id = tokenizer.token_to_id(eot)
    texts = [Path(f).read_text(errors="replace") for f in files]
    ids = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot_id)
    vocab = tokenizer.get_vocab_size()
    return np.asarray(ids, _token_dtype(vocab)), vocab


END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def load_tokenizer_file(path):
    """A Hugging Face tokenizer.json as a ``tokenizers.Tokenizer``: FileNotFoundError where
    there is no such file, a ValueError where it is not one."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {str(path)!r} is neither 'byte', 'bpe' nor a tokenizer.json file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library's own parse errors
        raise ValueError(f"tokenizer {str(path)!r} is not a Hugging Face tokenizer.json: {e}") from None


def _tokenize_with(tokenizer, files) -> tuple[np.ndarray, int, str | None]:
    eot = next((t for t in END_OF_TEXT if tokenizer.token_to_id(t) is not None), None)
    texts = [Path(f).read_text(errors="replace") for f in files]
    ids = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        if eot is not None:
            ids.append(tokenizer.token_to_id(eot))
    vocab = tokenizer.get_vocab_size()
    return np.asarray(ids, _token_dtype(vocab)), vocab, eot


def prepare(inputs, out, *, tokenizer: str = "byte", vocab_size: int = 8192, val_fraction: float = 0.005) -> Path:
    """Tokenise text files into ``out``/{train,val}.bin + meta.json; returns ``out``.
    ``tokenizer``: "byte", "bpe" or the path of a Hugging Face tokenizer.json."""
    files = [Path(f) for f in inputs]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise FileNotFoundError(f"prepare needs existing input files; missing: {missing or 'all'}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if tokenizer == "bpe" and vocab_size < 257:
        raise ValueError(f"a BPE vocabulary needs more than the 256 byte tokens, got vocab_size {vocab_size}")
    from_file = None if tokenizer in ("byte", "bpe") else load_tokenizer_file(tokenizer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    extra = {}
    if from_file is not None:
        tokens, vocab, eot = _tokenize_with(from_file, files)
        if Path(tokenizer).resolve() != (out / "tokenizer.json").resolve():
            shutil.copyfile(tokenizer, out / "tokenizer.json")
        extra = {"tokenizer_file": str(Path(tokenizer).absolute()), "document_separator": eot}
    elif tokenizer == "byte":
        tokens, vocab = _tokenize_bytes(files)
    elif tokenizer == "bpe":
        tokens, vocab = _tokenize_bpe(files, vocab_size, out)
        if vocab < vocab_size:
            print(
                f"warning: the text yields a BPE vocabulary of {vocab:,} tokens, fewer than the "
                f"{vocab_size:,} asked for; meta.json records {vocab:,}, the size training "
                "checks model.vocab_size against",
                file=sys.stderr,
            )
    n_val = max(int(len(tokens) * val_fraction), 1)
    tokens[:-n_val].tofile(out / "train.bin")
    tokens[-n_val:].tofile(out / "val.bin")
    meta = {
        "vocab_size": vocab,
        "dtype": np.dtype(tokens.dtype).name,
        "tokenizer": tokenizer if from_file is None else "file",
        "train_tokens": int(len(tokens) - n_val),
        "val_tokens": int(n_val),
        "documents": len(files),
        **extra,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return out


def default_corpus_dir() -> Path:
    """The byte-tokenised standard library, built on first use (atomically) and cached."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardflow"
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    target = cache / f"stdlib-bytes-{version}-{DEFAULT_CORPUS_BYTES >> 20}mb"
    if (target / "meta.json").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".building-"))
    prepare(stdlib_sources(), tmp, tokenizer="byte")
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class TokenFile:
    """A memory-mapped token file and the batches drawn from it."""

    def __init__(self, directory, split: str = "train"):
        directory = Path(directory)
        meta_path = directory / "meta.json"
        self.path = directory / f"{split}.bin"
        if not meta_path.exists():
            raise ConfigError(
                f"{directory} is not a prepared data dir (no meta.json); "
                "create one with `shardflow prepare --input FILES --out DIR`"
            )
        try:
            self.meta = json.loads(meta_path.read_text())
            self.vocab_size = int(self.meta["vocab_size"])
            dtype = np.dtype(self.meta["dtype"])
        except (ValueError, KeyError, TypeError) as e:
            problem = f"no key {e}" if isinstance(e, KeyError) else str(e)
            raise ConfigError(
                f"{meta_path} is not a `shardflow prepare` meta.json ({problem}); prepare the data again"
            ) from None
        if not self.path.is_file() or self.path.stat().st_size == 0:
            raise ConfigError(f"{self.path} is {'empty' if self.path.is_file() else 'missing'}; prepare the data again")
        try:
            self.tokens = np.memmap(self.path, dtype=dtype, mode="r")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.path} cannot be read as {dtype} tokens: {e}") from None

    def __len__(self):
        return len(self.tokens)

    def check_fits(self, seq_len: int) -> None:
        """Batches need more than one window (seq_len inputs and the next token) of tokens."""
        if len(self.tokens) < seq_len + 2:
            raise ConfigError(
                f"{self.path} has {len(self.tokens)} tokens, too few for sequences "
                f"of data.seq_len {seq_len} (at least {seq_len + 2})"
            )

    def window_starts(self, step: int, shape: tuple, seq_len: int, seed: int) -> np.ndarray:
        """Random start offsets for every sequence of the batch at ``step``, shape ``shape``."""
        self.check_fits(seq_len)
        rng = np.random.default_rng([seed, step])
        return rng.integers(0, len(self.tokens) - seq_len - 1, size=shape)

    def windows(self, starts: np.ndarray, seq_len: int) -> np.ndarray:
        """Token windows of length seq_len + 1 (inputs and shifted targets) as int32."""
        flat = starts.reshape(-1)
        rows = (
            np.stack([self.tokens[s : s + seq_len + 1] for s in flat])
            if flat.size
            else np.zeros((0, seq_len + 1), self.tokens.dtype)
        )
        return rows.astype(np.int32).reshape(starts.shape + (seq_len + 1,))


def global_batch(data: TokenFile, step: int, shape: tuple, seq_len: int, seed: int, sharding, order=None):
    """{"inputs", "targets"} of shape ``shape + (seq_len,)`` as jax.Arrays with ``sharding``;
    ``order``: the window's token positions in the order to store them (a context-parallel
    layout's; None: natural).

    Only rows that live on this process's devices are read from disk.
    """
    import jax

    starts = data.window_starts(step, shape, seq_len, seed)
    full_shape = tuple(shape) + (seq_len,)

    def reader(shift):
        def read(index):
            rows = data.windows(starts[index[:-1]], seq_len)[..., shift : shift + seq_len]
            return (rows if order is None else rows[..., order])[..., index[-1]]

        return read

    return {
        "inputs": jax.make_array_from_callback(full_shape, sharding, reader(0)),
        "targets": jax.make_array_from_callback(full_shape, sharding, reader(1)),
    }
