"""Provenance: which base model an adapter version was made on, and the check before loading it.

`BaseIdentity` is the served base model's identity, computed once per process at
start-up (`base_identity(model_dir, name)`) by the composition root and handed to
the registry, which records it in every version's manifest (`"base"`) and checks
it whenever a version is loaded. Its parts:

- `weights`: method `sampled-v1`, a sha256 over every `*.safetensors` file of the
  model directory (sorted by name) of: the file name, its size, its whole header
  (the 8-byte length and the JSON table of tensor names, dtypes, shapes and
  offsets) and four 64 KiB windows of the tensor data at evenly spaced offsets.
  Reading ~256 KiB per file, its cost does not grow with the model: a few
  milliseconds for SmolLM2-135M (measured in `tests/test_provenance.py`'s
  timing note and docs/architecture.md), where a full sha256 of the 270 MB
  weights takes about a second per start-up. It catches another model, another
  dtype or shape, a re-quantised or fine-tuned copy (any change in size, header or
  the sampled bytes); not an edit confined to bytes outside the windows (a
  deliberate forgery), which is not what it guards against.
- `tokenizer`: sha256 over the tokenizer files present (`tokenizer.json`,
  `tokenizer.model`, `vocab.json`, `merges.txt`, `added_tokens.json`,
  `special_tokens_map.json`), name and digest each.
- `chat_template`: sha256 of the template text (`chat_template.jinja`, else the
  `chat_template` field of `tokenizer_config.json`); None when the model has none.

The LoRA config (rank, alpha, target modules) is recorded by `artifact` in the
manifest's `lora`; shapes are checked against the engine once, by
`lora.weights.check_shapes` when the tensors are read.

`mismatch(recorded, served)` names the parts that differ; `check_manifest` turns
that into a `BaseMismatchError`. A manifest from before provenance (no `base`)
is accepted with a warning; so is a weights digest made by another method.

Not here: where versions live (`artifact`, `registry`), reading tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from clora_feedback.errors import BaseMismatchError
from clora_feedback.lora.peft_io import read_adapter_config

log = logging.getLogger(__name__)

WEIGHTS_METHOD = "sampled-v1"
"""How `BaseIdentity.weights` is computed (recorded with it; see the module docstring)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
)
_WINDOWS = 4
_WINDOW_BYTES = 64 * 1024
_PARTS = ("weights", "tokenizer", "chat_template")
_WARNED: set[str] = set()  # versions already warned about (no digests)
_PART_NAMES = {
    "weights": "base weights",
    "tokenizer": "tokenizer",
    "chat_template": "chat template",
}


@dataclass(frozen=True)
class BaseIdentity:
    """The served base model's identity, recorded in each version's manifest as `base`."""

    name: str
    """The base model's name (the engine's `model_name`); informative, never compared."""
    weights: str
    """sha256 hex digest of the weights by `weights_method`."""
    tokenizer: str | None
    """sha256 hex digest of the tokenizer files; None when the directory has none."""
    chat_template: str | None
    """sha256 hex digest of the chat template text; None when the model has none."""
    weights_method: str = WEIGHTS_METHOD
    """The weights digest's method (`sampled-v1`)."""
    seconds: float = 0.0
    """How long computing it took (logged at start-up; not recorded in manifests)."""

    def as_manifest(self) -> dict[str, Any]:
        """The manifest's `base` object."""
        out = asdict(self)
        del out["seconds"]
        return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_digest(model_dir: Path) -> str:
    """The `sampled-v1` digest of `model_dir`'s safetensors files (module docstring)."""
    digest = hashlib.sha256()
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            head = f.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            digest.update(head + f.read(min(header_len, max(size - 8, 0))))
            start = 8 + header_len
            span = max(size - start - _WINDOW_BYTES, 0)
            for i in range(_WINDOWS):
                f.seek(start + span * i // max(_WINDOWS - 1, 1))
                digest.update(f.read(_WINDOW_BYTES))
    return digest.hexdigest()


def tokenizer_digest(model_dir: Path) -> str | None:
    """sha256 over `<name>  <sha256>` lines of the tokenizer files present, or None."""
    lines = [
        f"{name}  {_sha256((Path(model_dir) / name).read_bytes())}\n"
        for name in TOKENIZER_FILES
        if (Path(model_dir) / name).is_file()
    ]
    return _sha256("".join(lines).encode()) if lines else None


def chat_template_text(model_dir: Path) -> str | None:
    """The chat template: `chat_template.jinja`, else `tokenizer_config.json`'s field."""
    jinja = Path(model_dir) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = Path(model_dir) / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return json.dumps(template, sort_keys=True)
    return template if isinstance(template, str) else None


def base_identity(model_dir: Path, name: str) -> BaseIdentity:
    """Compute the identity of the base model in `model_dir` (once per process).

    Raises:
        OSError: a file cannot be read (the model directory was validated before).
    """
    started = time.perf_counter()
    template = chat_template_text(model_dir)
    identity = BaseIdentity(
        name=name,
        weights=weights_digest(model_dir),
        tokenizer=tokenizer_digest(model_dir),
        chat_template=None if template is None else _sha256(template.encode()),
    )
    seconds = time.perf_counter() - started
    log.info("base model %s: identity %s... computed in %.1f ms", name, identity.weights[:12],
             seconds * 1000)  # fmt: skip
    return BaseIdentity(**{**identity.as_manifest(), "seconds": seconds})


def mismatch(recorded: Mapping[str, Any], served: BaseIdentity) -> tuple[str, ...]:
    """The parts of `recorded` (a manifest's `base`) that differ from `served`.

    A weights digest made by another method cannot be compared: skipped (a warning).
    """
    differs = []
    for part in _PARTS:
        if part == "weights" and recorded.get("weights_method") != served.weights_method:
            log.warning("weights digest method %r is not %r: not compared",
                        recorded.get("weights_method"), served.weights_method)  # fmt: skip
            continue
        if recorded.get(part) != getattr(served, part):
            differs.append(part)
    return tuple(differs)


def check_manifest(manifest: Mapping[str, Any], served: BaseIdentity | None, *, what: str) -> None:
    """Refuse a version whose manifest records another base than `served`.

    Args:
        manifest: the version's manifest (`artifact.read_manifest`).
        served: the served base's identity; None skips the check (no identity known).
        what: names the version in messages (e.g. `agent 'a' version 3`).

    Raises:
        BaseMismatchError: a recorded digest differs; the message names each part.
    """
    if served is None:
        return
    recorded = manifest.get("base")
    if not isinstance(recorded, Mapping):
        if what not in _WARNED:  # once per version and process: the trainer reloads it
            _WARNED.add(what)
            log.warning("%s: its manifest records no base model digests (made before "
                        "provenance); loading it unchecked beyond its shapes", what)  # fmt: skip
        return
    differs = mismatch(recorded, served)
    if differs:
        names = ", ".join(_PART_NAMES[p] for p in differs)
        raise BaseMismatchError(
            f"{what} was made on another base model than the served {served.name!r}: "
            f"{names} differ (recorded base {recorded.get('name')!r})",
            differs=differs,
        )


def check_name_hint(config: Mapping[str, Any], served: BaseIdentity | None, *, what: str) -> None:
    """A PEFT directory without our manifest: its `base_model_name_or_path` is only a hint.

    Names legitimately differ (a hub id, a local path, a snapshot hash), so a different
    last path component is logged, never refused; the shapes are checked when the
    tensors are read.
    """
    hint = str(config.get("base_model_name_or_path") or "").rstrip("/")
    if served is None or not hint:
        return
    if hint.rsplit("/", 1)[-1].lower() != served.name.rstrip("/").rsplit("/", 1)[-1].lower():
        log.warning("%s: adapter_config.json names base %r, the served base is %r "
                    "(a hint only: the shapes decide)", what, hint, served.name)  # fmt: skip


def check_source(path: Path, served: BaseIdentity | None) -> dict[str, Any]:
    """Check an adapter directory from outside the registry before it is imported.

    A directory with our `manifest.json` (a copied version) is checked by its base
    digests; a plain PEFT directory by its config's `base_model_name_or_path`, a hint
    that is only logged. Shapes are checked when the tensors are read.

    Returns:
        Its `adapter_config.json`.

    Raises:
        AdapterError: the config is missing or malformed.
        BaseMismatchError: its manifest records another base model.
    """
    config = read_adapter_config(path)
    what = f"adapter {str(path)!r}"
    manifest = path / "manifest.json"  # `artifact.MANIFEST_NAME`
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            recorded = {}
        check_manifest(recorded if isinstance(recorded, dict) else {}, served, what=what)
    else:
        check_name_hint(config, served, what=what)
    return config
