"""models.hf against transformers itself: tiny random Llama / Mistral / GPT-2 checkpoints built
locally, imported (whole, from sharded files, onto a mesh) and exported, logits compared with
transformers' own float32 logits; unsupported checkpoints refused with the key named."""

import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from shardflow.models import hf

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 128, 16
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def hf_libs():
    """(transformers, torch), imported on first use. transformers imports Hugging Face's
    `kernels` package, which the repository's own top-level kernels/ folder (the source of
    shardflow.kernels) shadows while the repository root is on sys.path, as under
    `python -m pytest`: the first import runs with the root off the path."""
    if "transformers" not in sys.modules:
        saved = list(sys.path)
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
        try:
            import transformers

            _ = transformers.LlamaForCausalLM, transformers.GPT2LMHeadModel  # load the lazy modules
        finally:
            sys.path[:] = saved
    import torch
    import transformers

    return transformers, torch


def make_hf_model(kind: str, **overrides):
    """A transformers model with every parameter random (norm scales and biases too, so a
    mapping that dropped one would show)."""
    transformers, torch = hf_libs()
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, **overrides)
        model = transformers.GPT2LMHeadModel(config)
    else:
        cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        }[kind]
        model = cls[1](cls[0](**{**TINY, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_scale = p.ndim == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight")
            p.copy_((1.0 if is_scale else 0.0) + 0.2 * torch.randn_like(p))
    return model.eval()


def hf_logits(model, tokens) -> np.ndarray:
    _, torch = hf_libs()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def random_tokens(seq=SEQ, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (2, seq))


CASES = {
    "llama": ("llama", dict(rope_theta=5000.0, rms_norm_eps=1e-5)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=SEQ)),
    "gpt2": ("gpt2", {}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    """(transformers model, its save_pretrained directory)."""
    kind, overrides = CASES[request.param]
    model = make_hf_model(kind, **overrides)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return model, directory


@pytest.mark.slow
def test_imported_logits_equal_transformers(saved):
    model, directory = saved
    tokens = random_tokens()
    ours = np.asarray(hf.load_model(directory)(jnp.asarray(tokens)))
    reference = hf_logits(model, tokens)
    assert np.abs(reference).max() > 1.0  # logits large enough for 1e-4 to mean something
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_exported_directory_loads_in_transformers_with_our_logits(saved, tmp_path):
    transformers, _ = hf_libs()
    model, directory = saved
    ours = hf.load_model(directory)
    hf.save(tmp_path, ours)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    tokens = random_tokens(seed=1)
    np.testing.assert_allclose(hf_logits(loaded, tokens), np.asarray(ours(jnp.asarray(tokens))), atol=1e-4, rtol=0)
    assert hf.read_config(tmp_path) == ours.cfg


def test_sharded_files_import_and_export(tmp_path):
    """save_pretrained's several files with their index in; several files of ours out."""
    transformers, _ = hf_libs()
    model = make_hf_model("llama")
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    tokens = random_tokens()
    ours = hf.load_model(tmp_path / "hf")
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(model, tokens), atol=1e-4, rtol=0)
    hf.save(tmp_path / "ours", ours, max_shard_bytes=40_000)
    files = sorted((tmp_path / "ours").glob("model-*-of-*.safetensors"))
    assert len(files) > 1 and not (tmp_path / "ours" / hf.SINGLE_FILE).exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    np.testing.assert_allclose(hf_logits(loaded, tokens), hf_logits(model, tokens), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,strategy,mesh_shape",
    [
        ("llama", "tp", {"data": 4, "model": 2}),
        ("llama", "2d", {"data": 2, "model": 4}),
        ("gpt2", "tp", {"data": 2, "model": 4}),
    ],
)
def test_import_onto_a_mesh_places_each_parameter_and_keeps_the_logits(kind, strategy, mesh_shape, tmp_path):
    transformers, _ = hf_libs()
    four_way = mesh_shape.get("model") == 4 and kind == "llama"
    overrides = {"num_key_value_heads": 4} if four_way else {}
    model = make_hf_model(kind, **overrides)
    model.save_pretrained(tmp_path / "hf")
    mesh = Mesh(np.asarray(jax.devices()).reshape(tuple(mesh_shape.values())), tuple(mesh_shape))
    cfg, params = hf.load(tmp_path / "hf", mesh=mesh, rules=strategy)

    from flax import nnx

    from shardflow import models

    specs = models.param_specs(nnx.eval_shape(lambda: models.build(cfg)), models.get_rules(strategy), mesh)
    arrays = jax.tree.leaves(params)
    assert all(x.sharding.mesh == mesh for x in arrays)
    assert all(jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding.spec == s, params, specs)))
    assert any(any(axis is not None for axis in x.sharding.spec) for x in arrays)  # some split

    sharded = hf.load_model(tmp_path / "hf", mesh=mesh, rules=strategy)
    tokens = random_tokens()
    np.testing.assert_allclose(np.asarray(sharded(jnp.asarray(tokens))), hf_logits(model, tokens), atol=1e-4, rtol=0)
    hf.save(tmp_path / "out", sharded)  # gathered from the mesh
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    np.testing.assert_allclose(hf_logits(loaded, tokens), hf_logits(model, tokens), atol=1e-4, rtol=0)


def test_a_split_that_does_not_divide_is_an_error_naming_the_parameter(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)  # 2 kv heads
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))
    with pytest.raises(
        ValueError,
        match=r"layers/attn/wk: dimension 2 \(size 2\) is split over "
        r"mesh axes \('model',\) \(4 ways\)",
    ):
        hf.load(tmp_path, mesh=mesh, rules="tp")


def test_the_original_gpt2_layout_imports(tmp_path):
    """Tensor names without the "transformer." prefix, the causal-mask buffers stored, and the
    tied head stored too, as in the original GPT-2 checkpoints."""
    from safetensors.numpy import load_file, save_file

    model = make_hf_model("gpt2")
    model.save_pretrained(tmp_path)
    tensors = {name.removeprefix("transformer."): array for name, array in load_file(tmp_path / hf.SINGLE_FILE).items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    tensors["lm_head.weight"] = tensors["wte.weight"]
    save_file(tensors, tmp_path / hf.SINGLE_FILE, metadata={"format": "pt"})
    tokens = random_tokens()
    np.testing.assert_allclose(
        np.asarray(hf.load_model(tmp_path)(jnp.asarray(tokens))), hf_logits(model, tokens), atol=1e-4, rtol=0
    )
    tensors["lm_head.weight"] = tensors["wte.weight"] + 1
    save_file(tensors, tmp_path / hf.SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(hf.HFCheckpointError, match="lm_head.weight differs from the embedding"):
        hf.load(tmp_path)


def test_a_bfloat16_checkpoint_imports_as_float32(tmp_path):
    transformers, torch = hf_libs()
    make_hf_model("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    cfg, params = hf.load(tmp_path)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = random_tokens()
    np.testing.assert_allclose(
        np.asarray(hf.load_model(tmp_path)(jnp.asarray(tokens))), hf_logits(reference, tokens), atol=1e-4, rtol=0
    )


def test_mistral_refuses_sequences_longer_than_its_window(tmp_path):
    make_hf_model("mistral", sliding_window=SEQ).save_pretrained(tmp_path)
    model = hf.load_model(tmp_path)
    assert model.cfg.sliding_window == SEQ
    model(jnp.asarray(random_tokens(SEQ)))
    with pytest.raises(
        ValueError,
        match=rf"a sequence of {SEQ + 1} tokens is longer than "
        rf"model.sliding_window \({SEQ}\)",
    ):
        model(jnp.asarray(random_tokens(SEQ + 1)))


@pytest.mark.slow
def test_mistral_without_a_window_is_plain_attention(tmp_path):
    model = make_hf_model("mistral", sliding_window=None)
    model.save_pretrained(tmp_path)
    ours = hf.load_model(tmp_path)
    assert ours.cfg.sliding_window is None
    tokens = random_tokens(40)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(model, tokens), atol=1e-4, rtol=0)


def test_an_unsupported_architecture_is_named(tmp_path):
    transformers, _ = hf_libs()
    transformers.Qwen2Config(**TINY).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        hf.HFCheckpointError, match="architecture Qwen2ForCausalLM is not supported; shardflow.models.hf reads"
    ):
        hf.load(tmp_path)


@pytest.mark.parametrize(
    "kind,overrides,message",
    [
        ("llama", dict(attention_bias=True), "attention_bias = true is not supported"),
        ("llama", dict(hidden_act="gelu"), 'hidden_act = "gelu" is not supported'),
        (
            "llama",
            dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
            r'rope_parameters.rope_type = "linear" is not supported|rope_scaling = \{',
        ),  # 5.x | 4.x
        ("gpt2", dict(activation_function="relu"), 'activation_function = "relu" is not supported'),
    ],
)
def test_an_unsupported_config_value_is_named(kind, overrides, message, tmp_path):
    make_hf_model(kind, **overrides).save_pretrained(tmp_path)
    with pytest.raises(hf.HFCheckpointError, match=message):
        hf.load(tmp_path)


def test_an_unknown_config_key_is_named(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.HFCheckpointError, match="key 'quantization_config'"):
        hf.read_config(tmp_path)


def test_a_tensor_of_another_shape_is_named(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        hf.HFCheckpointError,
        match=r"tensor 'model.layers.0.mlp.gate_proj.weight' "
        r"has shape \(96, 64\), but config.json makes "
        r"it \(128, 64\)",
    ):
        hf.load(tmp_path)


# --- Hugging Face tokenizers by file, and `shardflow sample` ---------------------------------

from shardflow import train  # noqa: E402
from shardflow.train import cli, config, data, sample  # noqa: E402

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def corpus():
    return data.stdlib_sources(max_bytes=300_000)[:10]


@pytest.fixture(scope="module")
def tokenizer_file(corpus, tmp_path_factory):
    """A byte-level BPE tokenizer.json of 300 tokens, trained here with the tokenizers library."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        [str(f) for f in corpus],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def prepared(corpus, tokenizer_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens")
    assert (
        cli.main(["prepare", "--input", *map(str, corpus), "--out", str(out), "--tokenizer", str(tokenizer_file)]) == 0
    )
    return out


@pytest.mark.slow
def test_prepare_encodes_with_a_tokenizer_file(corpus, tokenizer_file, prepared):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["tokenizer"] == "file" and meta["document_separator"] == EOT
    assert meta["vocab_size"] == tok.get_vocab_size() == 300
    expected = []
    for path in corpus:
        expected += tok.encode(path.read_text(errors="replace"), add_special_tokens=False).ids
        expected.append(tok.token_to_id(EOT))
    stored = np.concatenate([np.fromfile(prepared / f"{split}.bin", meta["dtype"]) for split in ("train", "val")])
    np.testing.assert_array_equal(stored, expected)
    assert (prepared / "tokenizer.json").read_text() == tokenizer_file.read_text()


@pytest.mark.parametrize(
    "tokenizer,message",
    [
        ("missing.json", "tokenizer '.*missing.json' is neither 'byte', 'bpe' nor a tokenizer.json"),
        ("not-a-tokenizer.json", "tokenizer '.*not-a-tokenizer.json' is not a Hugging Face tokenizer.json"),
    ],
)
def test_prepare_refuses_a_tokenizer_it_cannot_load(tokenizer, message, corpus, tmp_path, capsys):
    (tmp_path / "not-a-tokenizer.json").write_text('{"vocab": [1, 2]}')
    argv = [
        "prepare",
        "--input",
        str(corpus[0]),
        "--out",
        str(tmp_path / "d"),
        "--tokenizer",
        str(tmp_path / tokenizer),
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepare error: ") and re.search(message, err), err
    assert not (tmp_path / "d").exists()


@pytest.fixture(scope="module")
def run(prepared, tmp_path_factory):
    """A tiny Llama trained 4 steps on the tokenizer file's tokens: (run dir, final params)."""
    out = tmp_path_factory.mktemp("run")
    cfg = config.load(
        None,
        [
            f"data.path={prepared}",
            "data.seq_len=32",
            "batch_size=8",
            "model={preset: tiny, d_model: 64, n_layers: 1, head_dim: 8, vocab_size: 384}",
            "engine=jit",
            "eval_every=0",
            "checkpoint.every=2",
            "log_every=2",
        ],
        steps=4,
        out=str(out),
    )
    return out, train.train(cfg, progress=False)["params"]


@pytest.mark.slow
def test_sample_restores_the_newest_checkpoints_parameters(run):
    out, params = run
    model, step, _ = sample.restore_run(out)
    from flax import nnx

    assert step == 4
    restored = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, restored, jax.device_get(params))


@pytest.mark.slow
def test_sample_prints_the_requested_tokens_greedy_deterministic(run, tokenizer_file, capsys):
    out, _ = run
    argv = ["sample", "--checkpoint", str(out), "--prompt", "def main(", "--max-new-tokens", "12", "--temperature", "0"]
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert first.out.startswith("def main(") and len(first.out) > len("def main(\n")
    assert "sampled 12 tokens from step 4 of" in first.err
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == first.out

    model, _, tokenizer = sample.restore_run(out)
    prompt = tokenizer.encode("def main(")
    greedy = sample.generate(model, prompt, 12, temperature=0)
    assert len(greedy) == 12 and tokenizer.decode(prompt + greedy) + "\n" == first.out
    assert sample.generate(model, prompt, 12, temperature=1.0, top_k=1, seed=5) == greedy
    draws = {tuple(sample.generate(model, prompt, 12, seed=s)) for s in range(3)}
    assert len(draws) > 1  # temperature 1 over the whole vocabulary: the seed matters


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-new-tokens", "40"], "make 43 positions, more than the model's 32 \\(max_seq_len\\)"),
        (["--temperature", "-1"], "--temperature must be a number >= 0, got -1.0"),
        (["--top-k", "0"], "--top-k must be in \\[1, 128\\]"),
    ],
)
def test_sample_argument_errors_are_one_line(argv, message, tmp_path, capsys):
    make_hf_model("llama", max_position_embeddings=32).save_pretrained(tmp_path)
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models

    words = Tokenizer(tok_models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "tokenizer.json"))
    capsys.readouterr()
    assert cli.main(["sample", "--hf", str(tmp_path), "--prompt", "a b c", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sample error: ") and re.search(message, err), err


def test_sample_from_a_directory_without_a_run_is_one_line(tmp_path, capsys):
    assert cli.main(["sample", "--checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"sample error: {tmp_path} is not a `shardflow train` run directory (no config.json)\n"
    )


@pytest.mark.slow
def test_greedy_sampling_from_a_hugging_face_directory_is_transformers_greedy(tokenizer_file, tmp_path, capsys):
    _, torch = hf_libs()
    model = make_hf_model("llama", vocab_size=300)
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tokenizer_file.read_text())
    ours, tokenizer = sample.load_hf(tmp_path)
    prompt = tokenizer.encode("import os\n")
    with torch.no_grad():
        reference = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert sample.generate(ours, prompt, 10, temperature=0) == reference
    assert (
        cli.main(
            ["sample", "--hf", str(tmp_path), "--prompt", "import os\n", "--max-new-tokens", "10", "--temperature", "0"]
        )
        == 0
    )
    assert capsys.readouterr().out == tokenizer.decode(prompt + reference) + "\n"


@pytest.mark.parametrize(
    "window,message",
    [
        (16, "config error: data.seq_len 32 exceeds model.sliding_window 16"),
        (0, "config error: model.sliding_window must be a positive integer or null, got 0"),
    ],
)
def test_the_trainer_checks_a_sliding_window_before_it_starts(window, message, tmp_path, capsys):
    code = cli.main(
        [
            "train",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "run"),
            "--set",
            f"model={{preset: tiny, sliding_window: {window}}}",
            "--set",
            "data.seq_len=32",
        ]
    )
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sample_skips_a_step_whose_parameters_do_not_match_their_checksums(run, tmp_path, capsys):
    import json
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    sums_path = out / "checkpoints" / "4" / "checksums.json"
    sums = json.loads(sums_path.read_text())
    name = next(n for n in sorted(sums) if n.startswith("params"))
    sums[name] = [(sums[name][0] + 1) % 2**32, sums[name][1]]
    sums_path.write_text(json.dumps(sums))
    _, step, _ = sample.restore_run(out)
    assert step == 2
    err = capsys.readouterr().err
    assert "skipped checkpoint step 4: DamagedCheckpoint" in err and "do not match" in err, err
