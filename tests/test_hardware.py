"""`auto` dtypes follow the CPU: bf16 where it multiplies bf16 natively, fp32 on AVX2 only.

The rule is read from CPU flags (fake /proc/cpuinfo texts here, so every CPU
class is checked on any machine); an explicit dtype always wins; the engine
states what it picked, and on which CPU, when it starts; a trainer set to
another dtype than the engine serves in is warned about.
"""

from __future__ import annotations

import ast
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import clora_feedback.hardware as hardware
from clora_feedback.config import EngineConfig, Settings, TrainerConfig
from clora_feedback.engine.embedded import EmbeddedEngine, resolve_device
from clora_feedback.hardware import (
    DTYPES,
    CPUFeatures,
    dtype_name,
    read_cpu_features,
    resolve_dtype,
)
from clora_feedback.service.parts import dtype_mismatch, serving_dtype

_EPYC_AVX2 = "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx avx2 fma\n"
_EPYC_BF16 = (
    "model name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 fma avx512f avx512_vnni avx512_bf16\n"
)
_XEON_AMX = "model name\t: Intel Xeon\nflags\t\t: avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile\n"


def _cpu(text: str, onednn_bf16: bool = True) -> CPUFeatures:
    return replace(read_cpu_features(text), onednn_bf16=onednn_bf16)


def test_auto_is_bf16_only_where_the_cpu_multiplies_bf16_natively() -> None:
    assert resolve_dtype("auto", "cpu", _cpu(_EPYC_AVX2)) == torch.float32
    assert resolve_dtype("auto", "cpu", _cpu(_EPYC_BF16)) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", _cpu(_XEON_AMX)) == torch.bfloat16
    # bf16 flags but a torch whose oneDNN has no bf16 path: fp32
    assert resolve_dtype("auto", "cpu", _cpu(_EPYC_BF16, onednn_bf16=False)) == torch.float32
    assert _cpu(_XEON_AMX).bf16_class == "amx_bf16"
    assert _cpu(_EPYC_BF16).bf16_class == "avx512_bf16"
    assert _cpu(_EPYC_AVX2).bf16_class == "none"


def test_an_explicit_dtype_wins_and_unknown_names_are_refused() -> None:
    for name, dtype in DTYPES.items():
        assert resolve_dtype(name, "cpu", _cpu(_EPYC_BF16)) == dtype
        assert resolve_dtype(name, "cpu", _cpu(_EPYC_AVX2)) == dtype
        assert dtype_name(dtype) == name
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", "cpu")


def test_cpu_facts_are_read_from_cpuinfo() -> None:
    cpu = _cpu(_EPYC_BF16)
    assert cpu.model == "AMD EPYC 9B14"
    assert cpu.flags == {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"}
    line = cpu.describe()
    assert "AMD EPYC 9B14" in line and "avx512_bf16" in line and "auto dtype bfloat16" in line
    assert "auto dtype float32" in _cpu(_EPYC_AVX2).describe()


def test_engine_and_trainer_default_to_auto() -> None:
    assert EngineConfig().dtype == "auto"
    assert TrainerConfig().compute_dtype == "auto"


def test_a_trainer_in_another_dtype_than_the_engine_is_warned_about() -> None:
    """Behaviour logprobs of one dtype against a trainer's of another drift apart as the
    adapter trains (`benchmarks.precision --serving float32`): say so at start-up."""
    fp32, bf16 = torch.float32, torch.bfloat16

    def settings(**engine: object) -> Settings:
        return Settings.model_validate({"engine": engine})

    embedded = settings(dtype="float32")
    assert serving_dtype(embedded) == (fp32, "engine.dtype")
    warning = dtype_mismatch(embedded, bf16)
    assert warning is not None and "float32" in warning and "bfloat16" in warning
    assert dtype_mismatch(embedded, fp32) is None
    auto = resolve_dtype("auto", resolve_device("auto"))  # what both resolve `auto` to
    assert dtype_mismatch(settings(), auto) is None
    local = settings(kind="vllm", vllm={"local": {"enabled": True, "dtype": "bfloat16"}})
    assert serving_dtype(local) == (bf16, "engine.vllm.local.dtype")
    warning = dtype_mismatch(local, fp32)
    assert warning is not None and "engine.vllm.local.dtype" in warning
    remote = settings(kind="vllm", vllm={"urls": ["http://127.0.0.1:8100"]})
    assert serving_dtype(remote) is None and dtype_mismatch(remote, bf16) is None


def test_the_engine_states_its_dtype_and_cpu_at_start(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="clora_feedback.engine.embedded"):
        engine = EmbeddedEngine(tiny_model_dir, EngineConfig(max_loras=1, max_num_seqs=2))
    want = resolve_dtype("auto", "cpu")
    assert engine.model.dtype == want
    line = next(r.getMessage() for r in caplog.records if "embedded engine:" in r.getMessage())
    assert dtype_name(want) in line and "CPU:" in line and "auto dtype" in line
    explicit = EmbeddedEngine(tiny_model_dir, EngineConfig(max_loras=1, dtype="float32"))
    assert explicit.model.dtype == torch.float32


def test_hardware_sits_below_every_other_module() -> None:
    tree = ast.parse(Path(hardware.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not [m for m in imported if m.startswith("clora_feedback")]
