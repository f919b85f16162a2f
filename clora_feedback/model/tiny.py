"""Tiny random Llama models on disk, for unit tests and benchmarks of the plumbing.

`build_tiny_model_dir` writes a complete Hugging Face model directory (config,
safetensors weights, byte-level tokenizer with a ChatML chat template) that
`AutoModelForCausalLM` and `AutoTokenizer` load like any real checkpoint, in well
under a second. The weights are random: the model says nothing meaningful, but
it exercises every code path (GQA, RoPE, tied or untied heads, chat rendering,
stop tokens) exactly like a real Llama-architecture model.

Deliberately not here: any trained weights, any download, any tokenizer merges.
The tokenizer maps every UTF-8 byte to one token so that any text round-trips
exactly and token counts are predictable (one token per byte).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens, in id order: they take ids 0, 1, 2 and the 256 bytes follow."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, the shape SmolLM2-Instruct uses (without its default system prompt)."""

_MANIFEST = "tiny_manifest.json"
_LOGIT_STD = 2.0  # target std of initial logits: peaked enough that sampling is not uniform


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that ByteLevel pre-tokenizers use.

    Printable Latin-1 bytes map to themselves; the remaining 68 bytes are shifted
    to code points from 256 upwards, so every byte has a visible, unique character.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def _build_tokenizer() -> Any:
    """A `PreTrainedTokenizerFast`: 3 special tokens, then one token per byte (id = 3 + byte)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for byte, char in _bytes_to_unicode().items():
        vocab[char] = len(SPECIAL_TOKENS) + byte
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the text is only mapped byte by byte, so
    # decode(encode(s)) == s for every string.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _write_model(out: Path, params: dict[str, Any], vocab_size: int) -> None:
    """Initialise a `LlamaForCausalLM` deterministically and save it as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = int(params["hidden_size"])
    heads = int(params["num_attention_heads"])
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(params["intermediate_size"]),
        num_hidden_layers=int(params["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(params["num_key_value_heads"]),
        head_dim=hidden // heads,
        max_position_embeddings=int(params["max_position_embeddings"]),
        tie_word_embeddings=bool(params["tie_word_embeddings"]),
        bos_token_id=SPECIAL_TOKENS.index(IM_START),
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        rms_norm_eps=1e-5,
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(params["seed"]))
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            # Hidden states reach the head RMS-normalised (std ~1), so a head with
            # std s gives logits with std ~ s * sqrt(hidden). The default init (0.02)
            # yields near-uniform logits; rescale to a useful spread.
            head = model.get_output_embeddings().weight
            head.normal_(0.0, _LOGIT_STD / math.sqrt(hidden))
    model.save_pretrained(out, safe_serialization=True)


def build_tiny_model_dir(
    path: Path,
    *,
    seed: int = 0,
    vocab: str = "bytes",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random-weight Llama model directory in Hugging Face format.

    Idempotent: a directory already built with the same arguments is returned as
    is; different arguments rebuild it. The directory appears atomically (built in
    a sibling temp dir, then renamed), so a concurrent reader never sees half a
    model.

    Args:
        path: Target directory (created; its parent must be writable).
        seed: Seed for `torch.manual_seed` before initialising the weights.
        vocab: Tokenizer kind; only `"bytes"` (3 special tokens + 256 bytes = 259 ids).
        hidden_size: Model width; must be divisible by `num_attention_heads`.
        intermediate_size: MLP width.
        num_hidden_layers: Decoder layers.
        num_attention_heads: Query heads; `head_dim = hidden_size // num_attention_heads`.
        num_key_value_heads: KV heads (GQA when fewer than query heads).
        max_position_embeddings: Context window recorded in the config.
        tie_word_embeddings: Share the input embedding with the LM head.

    Returns:
        `path`, holding `config.json`, `model.safetensors`, the tokenizer files
        (`tokenizer.json`, `tokenizer_config.json`, chat template) and a small
        manifest of the arguments.

    Raises:
        ValueError: `vocab` is not `"bytes"` or the head counts do not divide.
        FileExistsError: `path` exists but is neither empty nor a tiny model directory.
    """
    if vocab != "bytes":
        raise ValueError(f"unknown tiny vocab {vocab!r}; only 'bytes' exists")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError("hidden_size must divide by heads and heads by kv heads")
    params: dict[str, Any] = {
        "seed": seed,
        "vocab": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
    }
    path = Path(path)
    if _manifest_matches(path, params):
        return path

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tokenizer = _build_tokenizer()
        _write_model(tmp, params, vocab_size=len(tokenizer))
        tokenizer.save_pretrained(tmp)
        # Manifest last: its presence means the directory is complete.
        (tmp / _MANIFEST).write_text(json.dumps(params, sort_keys=True))
        if path.exists():
            _remove_previous_tiny(path)
        try:
            os.replace(tmp, path)
        except OSError:
            # Another process won the race; accept its result if it is ours.
            if not _manifest_matches(path, params):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _remove_previous_tiny(path: Path) -> None:
    """Delete an earlier tiny model (or an empty dir) at `path`; refuse anything else."""
    if (path / _MANIFEST).is_file() or (path.is_dir() and not any(path.iterdir())):
        shutil.rmtree(path)
        return
    raise FileExistsError(f"{path} exists and is not a tiny model directory; not overwriting")


def _manifest_matches(path: Path, params: dict[str, Any]) -> bool:
    try:
        return bool(json.loads((path / _MANIFEST).read_text()) == params)
    except (OSError, ValueError):
        return False
