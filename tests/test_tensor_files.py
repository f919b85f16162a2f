"""`lora.tensor_files`: safetensors written from memory, read back by the safetensors library.

Covers the encoding (every dtype the trainer and PEFT use, odd shapes, alignment, metadata),
the digests taken from memory (equal to the file read back), a failing fsync surfacing as
`OSError`, and a PEFT directory written this way loading as PEFT and as our adapter.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from clora_feedback.lora import tensor_files
from clora_feedback.lora.peft_io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_peft_adapter,
    load_peft_adapter,
    save_peft_adapter,
)
from clora_feedback.lora.tensor_files import encode_safetensors, write_files
from clora_feedback.lora.weights import LoRALimits, random_lora_weights

SHAPES = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32)}
LIMITS = LoRALimits(8, tuple(SHAPES), 2, SHAPES)


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "f64": torch.randn(7, dtype=torch.float64, generator=g),
        "bf16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, generator=g).half(),
        "step": torch.tensor([12], dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "flags": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(4, 3, generator=g).t(),  # not contiguous
        "view": torch.randn(40, generator=g)[10:22].view(3, 4),  # shares a larger storage
    }


def test_the_library_reads_back_every_tensor_exactly(tmp_path: Path) -> None:
    tensors = _mixed()
    digests = write_files(tmp_path, {"x.safetensors": encode_safetensors(tensors, {"a": "b"})})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"a": "b"}
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert digests["x.safetensors"].sha256 == hashlib.sha256(raw).hexdigest()
    assert digests["x.safetensors"].size == len(raw)


def test_the_data_starts_aligned_and_each_tensor_on_its_element_size(tmp_path: Path) -> None:
    tensors = _mixed()
    write_files(tmp_path, {"x.safetensors": encode_safetensors(tensors)})
    raw = (tmp_path / "x.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    assert (8 + size) % 8 == 0
    header = json.loads(raw[8 : 8 + size])
    assert "__metadata__" not in header
    for name, entry in header.items():
        assert entry["data_offsets"][0] % tensors[name].element_size() == 0, name
    spans = sorted(tuple(e["data_offsets"]) for e in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no gap


def test_a_dtype_without_a_safetensors_name_is_refused() -> None:
    with pytest.raises(ValueError, match="complex64"):
        encode_safetensors({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="strings"):
        encode_safetensors({"a": torch.zeros(1)}, {"n": 1})  # type: ignore[dict-item]


def test_digests_cover_every_file_and_a_failing_fsync_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files: dict[str, list[tensor_files.Chunk]] = {
        "a.bin": [b"hello ", memoryview(b"world")],
        "b.json": [b"{}\n"],
    }
    digests = write_files(tmp_path, files)
    for name in files:
        raw = (tmp_path / name).read_bytes()
        assert digests[name] == tensor_files.FileDigest(hashlib.sha256(raw).hexdigest(), len(raw))
    assert (tmp_path / "a.bin").read_bytes() == b"hello world"

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(tensor_files.os, "fsync", broken)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Input/output"):
        write_files(tmp_path, {"c.bin": [b"x"]})
    assert len(os.listdir("/proc/self/fd")) == before  # every descriptor closed


def test_a_peft_directory_written_from_memory_loads_as_written(tmp_path: Path) -> None:
    weights = random_lora_weights(LIMITS, rank=4, seed=3)
    digests = save_peft_adapter(weights, tmp_path / "a", base_model="tiny")
    assert set(digests) == {WEIGHTS_NAME, CONFIG_NAME}
    for name, digest in digests.items():
        assert digest.sha256 == hashlib.sha256((tmp_path / "a" / name).read_bytes()).hexdigest()
    assert check_peft_adapter(tmp_path / "a", limits=LIMITS) == 4
    back = load_peft_adapter(tmp_path / "a", limits=LIMITS)
    assert back.rank == 4 and back.alpha == weights.alpha
    assert set(back.tensors) == set(weights.tensors)
    for key, (a, b) in weights.tensors.items():
        assert torch.equal(back.tensors[key][0], a) and torch.equal(back.tensors[key][1], b)
    config = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    assert config["base_model_name_or_path"] == "tiny" and config["r"] == 4


def test_a_forked_child_writes_with_threads_of_its_own(tmp_path: Path) -> None:
    write_files(tmp_path, {"parent.bin": [b"p"]})  # the parent's fsync threads exist now
    pid = os.fork()
    if pid == 0:  # the child: no thread of the parent's pool runs here
        signal.alarm(60)  # a guard against a hang (a pool without threads), not a timing
        try:
            digests = write_files(tmp_path, {"child.bin": [b"c"]})
            os._exit(0 if digests["child.bin"].size == 1 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "child.bin").read_bytes() == b"c"
