"""What this machine multiplies fast, and the one map from dtype names to torch dtypes.

`DTYPES` is the only table of the names the config takes (`engine.dtype`,
`trainer.compute_dtype`). `cpu_features` reads, once, the CPU flags that
decide the matmul paths; `resolve_dtype` turns a config name into a torch
dtype, `auto` into the fastest on the device at hand:

- a CPU with native bf16 dot products (`amx_bf16` or `avx512_bf16`, and
  oneDNN's bf16 path in this torch): bfloat16. Measured on an AMD EPYC with
  avx512_bf16 (docs/benchmarks.md): bf16 GEMMs 2.9x fp32 at the training
  shape, a swap step and a decode step faster in bf16;
- any other CPU (AVX2 only): float32. There a bf16 GEMM converts on every
  call and a bf16 swap step was 14x slower than fp32;
- CUDA: bfloat16 where the GPU supports it, else float32.

An explicit name always wins. The choice is a rule on CPU flags, not a timing,
so every start of one machine picks the same.

Not here: which kernel multiplies a given weight (`engine.dense`), settings
(`config`).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Dtype names of the config and the torch dtypes they select (`auto` is resolved first)."""

KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
"""The CPU flags that decide the matmul paths, in the order they are reported."""


def dtype_name(dtype: torch.dtype) -> str:
    """The config name of `dtype` (the inverse of `DTYPES`)."""
    return next(name for name, d in DTYPES.items() if d == dtype)


@dataclass(frozen=True)
class CPUFeatures:
    """The facts about this CPU that decide the dtype and the matmul kernels.

    Attributes:
        model: the CPU model name (`/proc/cpuinfo`), or the platform's machine name.
        flags: which of `KERNEL_FLAGS` the CPU has.
        capability: torch's CPU capability (`DEFAULT`, `AVX2`, `AVX512`, ...).
        onednn_bf16: whether this torch's oneDNN has a bf16 GEMM path here.
    """

    model: str
    flags: frozenset[str]
    capability: str
    onednn_bf16: bool

    @property
    def bf16_class(self) -> str:
        """`amx_bf16`, `avx512_bf16` (native bf16 dot products) or `none`."""
        for flag in ("amx_bf16", "avx512_bf16"):
            if flag in self.flags:
                return flag
        return "none"

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 GEMMs run natively here (what `auto` picks bfloat16 for)."""
        return self.bf16_class != "none" and self.onednn_bf16

    def describe(self) -> str:
        """One line for start-up logs and benchmark facts."""
        flags = " ".join(f for f in KERNEL_FLAGS if f in self.flags) or "none"
        auto = "bfloat16" if self.native_bf16 else "float32"
        return (
            f"{self.model}; flags {flags}; torch capability {self.capability}; "
            f"oneDNN bf16 {'yes' if self.onednn_bf16 else 'no'}; auto dtype {auto}"
        )


def read_cpu_features(cpuinfo: str | None = None) -> CPUFeatures:
    """The features described by `cpuinfo` (the text of /proc/cpuinfo; read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "", frozenset[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = frozenset(value.split()) & frozenset(KERNEL_FLAGS)
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    onednn = torch.backends.mkldnn.is_available() and (probe is None or bool(probe()))
    return CPUFeatures(
        model or platform.machine(),
        flags,
        torch.backends.cpu.get_cpu_capability(),
        onednn,
    )


@functools.cache
def cpu_features() -> CPUFeatures:
    """This machine's `CPUFeatures` (read once per process)."""
    return read_cpu_features()


def auto_dtype(device: torch.device | str, features: CPUFeatures | None = None) -> torch.dtype:
    """The fastest compute dtype on `device` (see the module docstring)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if dev.type == "cpu":
        return torch.bfloat16 if (features or cpu_features()).native_bf16 else torch.float32
    return torch.float32


def resolve_dtype(
    name: str, device: torch.device | str = "cpu", features: CPUFeatures | None = None
) -> torch.dtype:
    """The torch dtype of config name `name` on `device`; `auto`: `auto_dtype`."""
    if name == "auto":
        return auto_dtype(device, features)
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (auto, {', '.join(DTYPES)})") from None
