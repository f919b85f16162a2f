"""One adapter version on disk: write it completely (manifest last), hash it, verify it, read it.

A version directory holds

    adapter_config.json          PEFT config      } loadable by peft.PeftModel.from_pretrained
    adapter_model.safetensors    LoRA tensors     } and by vLLM (`lora_path`)
    optimizer.safetensors        optimizer state (optional; how training resumes)
    manifest.json                written last: parent, step, metrics, feedback window,
                                 the sha256 of every other file and the content hash

Every file is fsynced before the manifest is written, and the manifest before
the directory, so a directory whose manifest exists is complete on disk. The
payload files are written in one pass and fsynced together (`tensor_files`),
their digests taken from the bytes written, not read back. The
content hash is the sha256 of `<sha256>  <name>` lines (sorted by name, as
`sha256sum` prints them) over the files other than the manifest.

`VersionDirs` owns the tree `<root>/<agent>/<version>/`: a version is written
into `<agent>/.tmp-<uuid>/` and renamed into place (atomic, then the parent is
fsynced); `collect` deletes what a crash left behind; `prune_payload` deletes a version's
payload and keeps its manifest (retention); `lock` is an exclusive
`flock` on `<root>/.lock` (released by the kernel when its holder dies) that
writers and the collector share, so a collector never mistakes another
process's just-renamed, not-yet-indexed version for a leftover; `.store-id`
names the index the tree belongs to.

Not here: which versions exist and which is active (the index, see `registry`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from clora_feedback.errors import AdapterError, IntegrityError, StoreError
from clora_feedback.lora.peft_io import CONFIG_NAME, WEIGHTS_NAME, load_peft_adapter, peft_files
from clora_feedback.lora.tensor_files import encode_safetensors, write_files
from clora_feedback.lora.weights import LoRALimits, LoRAWeights
from clora_feedback.store.versions import AGENT_NAME

MANIFEST_NAME = "manifest.json"
OPTIMIZER_NAME = "optimizer.safetensors"
MANIFEST_FORMAT = 1
"""Version of the manifest's layout, recorded as its `format` field."""
_LOCK_NAME = ".lock"
_STORE_ID_NAME = ".store-id"
_TMP_PREFIX = ".tmp-"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entry list is what a rename changes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def content_hash(files: Mapping[str, str]) -> str:
    """The content hash of a version.

    Args:
        files: file name -> its sha256 hex digest.

    Returns:
        sha256 hex digest of the `<sha256>  <name>\\n` lines sorted by name.
    """
    lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def payload_names(has_optimizer_state: bool) -> list[str]:
    """The files a version's content hash covers."""
    return [CONFIG_NAME, WEIGHTS_NAME] + ([OPTIMIZER_NAME] if has_optimizer_state else [])


def write_version_dir(
    path: Path,
    weights: LoRAWeights,
    *,
    optimizer_state: Mapping[str, torch.Tensor] | None,
    base_model: str,
    meta: Mapping[str, Any],
) -> dict[str, Any]:
    """Write a complete version directory at `path` (normally a temp dir), fsynced, manifest last.

    Args:
        path: directory to create and fill.
        weights: the adapter: A [r, in] and B [out, r] per projection (saved as fp32).
        optimizer_state: name -> tensor (e.g. Adam moments [P] and step [1]), or None.
        base_model: recorded as the PEFT config's `base_model_name_or_path`.
        meta: JSON-serialisable fields copied into the manifest (agent, version,
            parent, step, metrics, feedback_window, source).

    Returns:
        The manifest as written: `meta` plus `format`, `created_at`, `base_model`,
        `lora` (rank, alpha, use_rslora, target_modules), `files` (name -> sha256,
        bytes) and `content_hash`.
    """
    path = Path(path)
    path.mkdir(parents=True)
    files = peft_files(weights, base_model=base_model)
    if optimizer_state is not None:
        files[OPTIMIZER_NAME] = encode_safetensors(optimizer_state, {"format": "pt"})
    # Every payload file is written, then all are fsynced at once while hashed from memory.
    written = write_files(path, files)
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        **meta,
        "base_model": base_model,
        "created_at": time.time(),
        "lora": {
            "rank": weights.rank,
            "alpha": weights.alpha,
            "use_rslora": weights.use_rslora,
            "target_modules": list(weights.target_modules),
        },
        "files": {
            name: {"sha256": written[name].sha256, "bytes": written[name].size}
            for name in payload_names(optimizer_state is not None)
        },
        "content_hash": content_hash({name: d.sha256 for name, d in written.items()}),
    }
    text = json.dumps(manifest, indent=2, allow_nan=False) + "\n"
    write_files(path, {MANIFEST_NAME: [text.encode()]})  # after the payload is durable
    fsync_path(path)
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    """A version directory's manifest.

    Raises:
        StoreError: missing or not a JSON object.
    """
    file = Path(path) / MANIFEST_NAME
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"cannot read {file}: {exc}", code="manifest_unreadable") from exc
    if not isinstance(manifest, dict):
        raise StoreError(f"{file} does not hold a JSON object", code="manifest_unreadable")
    return manifest


def verify_version_dir(path: Path, expected_hash: str, *, has_optimizer_state: bool) -> None:
    """Recompute the content hash of `path` and compare it with `expected_hash`.

    Raises:
        StoreError: a file is missing (`version_files_missing`) or differs
            (`content_hash_mismatch`, naming the changed files).
    """
    path = Path(path)
    names = payload_names(has_optimizer_state)
    try:
        digests = {name: file_sha256(path / name) for name in names}
    except OSError as exc:
        raise IntegrityError(f"{path}: {exc}", code="version_files_missing") from exc
    if content_hash(digests) == expected_hash:
        return
    try:
        recorded = read_manifest(path).get("files", {})
    except StoreError:
        recorded = {}
    changed = [n for n in names if recorded.get(n, {}).get("sha256") != digests[n]]
    raise IntegrityError(
        f"{path}: content hash mismatch (changed: {', '.join(changed) or 'unknown'}); "
        "the files were modified or corrupted after publishing",
        code="content_hash_mismatch",
    )


def read_version_dir(
    path: Path, *, has_optimizer_state: bool, limits: LoRALimits | None = None
) -> tuple[LoRAWeights, dict[str, torch.Tensor] | None]:
    """Read a version's weights (validated against `limits`) and optimizer state.

    Raises:
        AdapterError: the adapter is malformed or exceeds `limits`, or the optimizer
            state cannot be read.
    """
    weights = load_peft_adapter(Path(path), limits=limits)
    if not has_optimizer_state:
        return weights, None
    file = Path(path) / OPTIMIZER_NAME
    try:
        return weights, load_file(str(file), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"cannot read {file}: {exc}") from exc


class VersionDirs:
    """The version directory tree under `root`. Raises `OSError` (callers translate it once).

    Args:
        root: the adapter store root; created if missing.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._mutex = threading.Lock()  # flock excludes other processes; this, other threads

    def path(self, agent: str, version: int) -> Path:
        """Where version `version` of `agent` lives once placed."""
        return self.root / agent / str(version)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive across threads and processes; hold it from writing a version to indexing it."""
        with self._mutex:
            fd = os.open(self.root / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    def place(
        self, agent: str, version: int, write: Callable[[Path], dict[str, Any]]
    ) -> dict[str, Any]:
        """Run `write(tmp)` on a fresh temp dir, then rename it to `path(agent, version)`.

        Call it holding `lock()`. On failure the temp dir is removed and nothing is placed.

        Returns:
            What `write` returned (the manifest).
        """
        agent_dir = self.root / agent
        if not agent_dir.exists():
            agent_dir.mkdir(parents=True)
            fsync_path(self.root)
        tmp = agent_dir / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            result = write(tmp)
            os.rename(tmp, self.path(agent, version))  # atomic: complete or absent
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_path(agent_dir)
        return result

    def remove(self, agent: str, version: int) -> None:
        """Delete a placed version that could not be indexed."""
        shutil.rmtree(self.path(agent, version), ignore_errors=True)

    def prune_payload(self, agent: str, version: int) -> bool:
        """Delete a version's payload (PEFT files, optimizer state), keeping its manifest.

        Idempotent: the registry marks the version pruned in its index first (the commit
        point), so a crash part-way leaves a marked version whose remaining files the
        next `prune_payload` (the sweep on open) removes; nothing reads a marked version.

        Returns:
            Whether any file was still there.
        """
        path = self.path(agent, version)
        removed = False
        for name in payload_names(True):
            with contextlib.suppress(FileNotFoundError):
                (path / name).unlink()
                removed = True
        if removed:
            fsync_path(path)
        return removed

    def _agent_dirs(self) -> Iterator[Path]:
        for child in self.root.iterdir():
            if child.is_dir() and AGENT_NAME.match(child.name):
                yield child

    def has_versions(self) -> bool:
        """Whether any version directory exists."""
        return any(c.name.isdigit() for d in self._agent_dirs() for c in d.iterdir())

    def collect(self, known: Collection[tuple[str, int]]) -> list[Path]:
        """Delete temp dirs and version dirs not in `known` ((agent, version) pairs).

        Call it holding `lock()`.

        Returns:
            The directories removed.
        """
        removed: list[Path] = []
        for agent_dir in self._agent_dirs():
            leftovers = [
                child
                for child in agent_dir.iterdir()
                if child.is_dir()
                and (
                    child.name.startswith(_TMP_PREFIX)
                    or (child.name.isdigit() and (agent_dir.name, int(child.name)) not in known)
                )
            ]
            for child in leftovers:
                shutil.rmtree(child)
            if leftovers:
                fsync_path(agent_dir)
            removed += leftovers
        return removed

    def store_id(self) -> str | None:
        """The id of the index this tree belongs to, or None when unclaimed."""
        marker = self.root / _STORE_ID_NAME
        return marker.read_text().strip() if marker.is_file() else None

    def set_store_id(self, store_id: str) -> None:
        marker = self.root / _STORE_ID_NAME
        marker.write_text(store_id + "\n")
        fsync_path(marker)
        fsync_path(self.root)
