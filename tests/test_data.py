"""Token files, `prepare`, and batches that are a pure function of the step."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardflow.train import data


@pytest.fixture(scope="module")
def sources():
    return data.stdlib_sources(max_bytes=200_000)[:20]


def test_byte_prepare_round_trips_the_text(tmp_path, sources):
    out = data.prepare(sources[:3], tmp_path, tokenizer="byte", val_fraction=0.01)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    tokens = np.concatenate([np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "val.bin", np.uint16)])
    expected = b"".join(p.read_bytes().replace(b"\0", b"") + b"\0" for p in sources[:3])
    assert tokens.tobytes()[::2] == expected  # little-endian uint16: low byte is the token
    assert meta["train_tokens"] + meta["val_tokens"] == len(expected)


def test_bpe_prepare_trains_a_tokenizer(tmp_path, sources):
    out = data.prepare(sources, tmp_path, tokenizer="bpe", vocab_size=600)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and 256 < meta["vocab_size"] <= 600
    tokens = data.TokenFile(out).tokens
    assert tokens.max() < meta["vocab_size"]
    raw = sum(p.stat().st_size for p in sources)
    assert len(tokens) + meta["val_tokens"] < raw / 1.5  # BPE compresses source code
    assert (out / "tokenizer.json").exists()


def test_batches_are_a_pure_function_of_step(tmp_path, sources):
    dataset = data.TokenFile(data.prepare(sources[:5], tmp_path))
    a = dataset.windows(dataset.window_starts(7, (2, 4), 16, seed=0), 16)
    b = dataset.windows(dataset.window_starts(7, (2, 4), 16, seed=0), 16)
    c = dataset.windows(dataset.window_starts(8, (2, 4), 16, seed=0), 16)
    assert a.shape == (2, 4, 17)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_global_batch_shards_match_the_full_batch(tmp_path, sources):
    dataset = data.TokenFile(data.prepare(sources[:5], tmp_path))
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "model"))
    batch = data.global_batch(dataset, 3, (2, 8), 16, 0, NamedSharding(mesh, P(None, "data")))
    windows = dataset.windows(dataset.window_starts(3, (2, 8), 16, 0), 16)
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), windows[..., :-1])
    np.testing.assert_array_equal(np.asarray(batch["targets"]), windows[..., 1:])
    assert batch["inputs"].sharding.spec == P(None, "data")
    assert {s.data.shape for s in batch["inputs"].addressable_shards} == {(2, 2, 16)}


def test_prepare_rejects_missing_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        data.prepare([tmp_path / "nope.txt"], tmp_path / "out")


def test_bpe_prepare_says_when_the_text_yields_a_smaller_vocabulary(tmp_path, capsys):
    from tokenizers import Tokenizer

    src = tmp_path / "a.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    out = data.prepare([src], tmp_path / "d", tokenizer="bpe", vocab_size=32000)
    real = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    assert 256 < real < 32000
    assert (
        f"warning: the text yields a BPE vocabulary of {real:,} tokens, fewer than the 32,000 asked for"
    ) in capsys.readouterr().err
    # what training checks model.vocab_size against
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == real
    assert data.TokenFile(out).vocab_size == real
