"""Write safetensors files (and small siblings) durably in one pass from memory.

`encode_safetensors` lays a file out as the safetensors format specifies it: an
8-byte little-endian header length, the JSON header (dtype, shape and
`data_offsets` of every tensor, plus `__metadata__`) padded with spaces to a
multiple of 8, then the tensors' bytes back to back. It returns the file as
chunks: the header, then a view of each tensor's own memory, so no tensor is
copied (the safetensors library builds the whole file in memory first). Larger
dtypes come first, so every tensor starts aligned to its element size.

`write_files` writes several files into one directory and makes them durable
together: every file is fsynced (concurrently, in threads: the fsyncs wait on
the disk, not the CPU) while the sha256 of each is computed from the very
chunks written, so nothing is read back. It returns each file's digest and size.

The caller owns the ordering above a file (a temp dir, the manifest written
after these, the directory fsync and the rename: see `store.artifact`), and must
not mutate the tensors until `write_files` returns (the digest is taken from
memory, after the write).

Not here: the PEFT layout (`peft_io`), version directories (`store.artifact`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

Chunk = bytes | memoryview
"""A piece of a file's content, written as is."""

_DTYPES: Mapping[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ALIGN = 8
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


@dataclass(frozen=True)
class FileDigest:
    """What `write_files` wrote: the file's sha256 hex digest and its size in bytes."""

    sha256: str
    size: int


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (a view: nothing is copied when it is a contiguous
    CPU tensor); the caller keeps it alive and unchanged until written."""
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.numel() == 0:
        return memoryview(b"")
    if not (t.is_cpu and t.is_contiguous()):
        t = t.to("cpu").contiguous()
    if t.dim() == 0 or t.dtype == torch.bfloat16:  # numpy has no bf16; a 0-d view cannot cast
        t = t.reshape(-1).view(torch.uint8)
    return t.numpy().data.cast("B")


def encode_safetensors(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> list[Chunk]:
    """`tensors` as a safetensors file, in chunks: the header, then each tensor's bytes.

    Raises:
        ValueError: a dtype the format has no name for, a metadata value that is not a
            string, or a big-endian host (the format stores little-endian).
    """
    if sys.byteorder != "little":
        raise ValueError("safetensors files are little-endian; this host is not")
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("safetensors metadata values must be strings")
        header["__metadata__"] = dict(metadata)
    chunks: list[Chunk] = []
    offset = 0
    for name in order:
        tensor = tensors[name]
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
        data = _tensor_bytes(tensor)
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        offset += data.nbytes
        chunks.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _ALIGN)  # the data starts 8-aligned
    return [struct.pack("<Q", len(text)) + text, *chunks]


def _fsync_pool() -> ThreadPoolExecutor:
    """The fsync threads of this process (a forked child makes its own: it has no threads)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="clora-fsync")
            _pool_pid = os.getpid()
        return _pool


def _digest(chunks: Sequence[Chunk]) -> FileDigest:
    h = hashlib.sha256()
    size = 0
    for chunk in chunks:
        h.update(chunk)  # releases the interpreter lock for large chunks
        size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
    return FileDigest(h.hexdigest(), size)


def write_files(directory: Path, files: Mapping[str, Sequence[Chunk]]) -> dict[str, FileDigest]:
    """Create each file `name` in `directory` with the concatenation of its chunks, and
    return once every one is fsynced; the digests are computed meanwhile, from memory.

    The directory's own entries are not fsynced here (the caller fsyncs the directory
    once, after its last file). A file that exists is replaced.

    Raises:
        OSError: a write or an fsync failed (the files may be partly written).
    """
    directory = Path(directory)
    fds: list[int] = []
    pending: list[Future[None]] = []
    try:
        for name, chunks in files.items():
            fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            pending.append(_fsync_pool().submit(os.fsync, fd))  # its writeback starts now
        digests = {name: _digest(chunks) for name, chunks in files.items()}
        for future in pending:
            future.result()  # raise the first fsync failure
        return digests
    finally:
        for future in pending:
            future.exception()  # no descriptor is closed under a running fsync
        for fd in fds:
            os.close(fd)
