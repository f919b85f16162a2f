"""Read and write adapters in PEFT's on-disk format, the interchange contract.

A directory holds `adapter_config.json` and `adapter_model.safetensors` with
keys like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
(adapter name stripped, as `peft.PeftModel.save_pretrained` writes them), so
the same directory loads in `peft.PeftModel.from_pretrained` and in vLLM.

The config is validated against the engine's `LoRALimits` before any tensor
is read, so a wrong adapter costs a JSON parse, not a tensor load.
`check_peft_adapter` goes no further than the safetensors header (names,
shapes, dtypes, a file that covers them): for an engine that reads the
tensors itself (vLLM), where the full load would only be thrown away.
Writing goes through `tensor_files` (`peft_files` lays the directory out in
memory, the tensors viewed rather than copied; `save_peft_adapter` writes and
fsyncs it, with each file's sha256 taken from memory).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from clora_feedback.errors import AdapterError
from clora_feedback.lora.tensor_files import Chunk, FileDigest, encode_safetensors, write_files
from clora_feedback.lora.weights import (
    LoRALimits,
    LoRAWeights,
    check_config,
    check_shapes,
    parse_module_key,
)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PEFT_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(layers\.\d+\.\w+\.\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)
# Options this engine does not implement: refusing them beats serving something different.
_UNSUPPORTED_TRUE = ("use_dora", "fan_in_fan_out")
_MUST_BE_EMPTY = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
# A PEFT config is a few hundred bytes, nested three deep: bounding both before parsing
# keeps a hostile file from costing memory or a RecursionError in the JSON decoder.
MAX_CONFIG_BYTES = 1024 * 1024
MAX_CONFIG_DEPTH = 32
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _check_config_shape(text: str, config_path: Path) -> None:
    """Refuse a config over `MAX_CONFIG_BYTES` or nested deeper than `MAX_CONFIG_DEPTH`."""
    if len(text) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{config_path} is larger than {MAX_CONFIG_BYTES} bytes")
    depth = 0
    for char in _JSON_STRING.sub("", text):  # brackets inside strings do not nest
        if char in "[{":
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                raise AdapterError(f"{config_path} is nested deeper than {MAX_CONFIG_DEPTH} levels")
        elif char in "]}":
            depth -= 1


def read_adapter_config(path: Path) -> dict[str, Any]:
    """Parse and sanity-check `adapter_config.json`; raises `AdapterError` with the reason."""
    config_path = Path(path) / CONFIG_NAME
    if not Path(path).is_dir():
        raise AdapterError(f"adapter directory not found: {path}")
    if not config_path.is_file():
        raise AdapterError(f"{config_path} is missing: not a PEFT adapter directory")
    try:
        if config_path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(f"{config_path} is larger than {MAX_CONFIG_BYTES} bytes")
        text = config_path.read_text()
        _check_config_shape(text, config_path)
        config = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} must hold a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not LORA")
    if not isinstance(config.get("r"), int) or not isinstance(
        config.get("lora_alpha"), int | float
    ):
        raise AdapterError("adapter_config.json needs integer `r` and numeric `lora_alpha`")
    for key in _UNSUPPORTED_TRUE:
        if config.get(key):
            raise AdapterError(f"adapter option {key}=true is not supported")
    for key in _MUST_BE_EMPTY:
        if config.get(key):
            raise AdapterError(f"adapter option {key} is not supported (must be empty)")
    if config.get("bias", "none") != "none":
        raise AdapterError("adapter bias training is not supported (bias must be 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise AdapterError("target_modules must be a non-empty list of projection names")
    return config


def load_peft_adapter(path: Path, *, limits: LoRALimits | None = None) -> LoRAWeights:
    """Load a PEFT LoRA directory as fp32 `LoRAWeights`.

    Raises:
        AdapterError: missing files, unsupported options, a rank or target the
            engine cannot serve (checked before reading tensors), or tensors whose
            shapes do not match the base model.
    """
    config = read_adapter_config(path)
    rank = int(config["r"])
    if limits is not None:
        check_config(rank, [str(t).rsplit(".", 1)[-1] for t in config["target_modules"]], limits)
    weights_path = Path(path) / WEIGHTS_NAME
    if not weights_path.is_file():
        raise AdapterError(f"{weights_path} is missing")
    try:
        raw = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"cannot read {weights_path}: {exc}") from exc
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in raw.items():
        match = _PEFT_KEY.match(name)
        if match is None:
            raise AdapterError(f"unexpected tensor {name!r} in {weights_path}")
        halves.setdefault(match.group(1), {})[match.group(2)] = tensor.to(torch.float32)
    tensors = {}
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{key}: needs both lora_A and lora_B")
        parse_module_key(key)
        tensors[key] = (pair["A"], pair["B"])
    if not tensors:
        raise AdapterError(f"{weights_path} holds no LoRA tensors")
    weights = LoRAWeights(
        rank=rank,
        alpha=float(config["lora_alpha"]),
        tensors=tensors,
        use_rslora=bool(config.get("use_rslora")),
    )
    if limits is not None:
        weights.validate(limits)
    return weights


_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})


def check_peft_adapter(path: Path, *, limits: LoRALimits) -> int:
    """Check a PEFT directory against `limits` from its config and the safetensors header
    only: every tensor a LoRA A or B of a served projection, both halves present, shapes
    `[r, in]` and `[out, r]`, a floating dtype, and a file that covers every tensor (a
    truncated one fails). No tensor data is read, so values (finite or not) are the
    writer's promise: the trainer refuses non-finite weights before it publishes, and
    `load_peft_adapter` checks them for directories from elsewhere. Returns the rank.

    Raises:
        AdapterError: as `load_peft_adapter`, but for values.
    """
    config = read_adapter_config(path)
    rank = int(config["r"])
    check_config(rank, [str(t).rsplit(".", 1)[-1] for t in config["target_modules"]], limits)
    weights_path = Path(path) / WEIGHTS_NAME
    if not weights_path.is_file():
        raise AdapterError(f"{weights_path} is missing")
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                match = _PEFT_KEY.match(name)
                if match is None:
                    raise AdapterError(f"unexpected tensor {name!r} in {weights_path}")
                view = f.get_slice(name)
                if view.get_dtype() not in _FLOAT_DTYPES:
                    raise AdapterError(f"{name}: dtype {view.get_dtype()} is not floating point")
                halves.setdefault(match.group(1), {})[match.group(2)] = tuple(view.get_shape())
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"cannot read {weights_path}: {exc}") from exc
    if not halves:
        raise AdapterError(f"{weights_path} holds no LoRA tensors")
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{key}: needs both lora_A and lora_B")
        check_shapes(key, pair["A"], pair["B"], rank, limits)
    return rank


def peft_files(weights: LoRAWeights, *, base_model: str) -> dict[str, list[Chunk]]:
    """`weights` as the two files of a PEFT directory, in memory: name -> chunks (the
    tensors' own memory, viewed, not copied, when they are fp32 on the CPU already)."""
    tensors: dict[str, torch.Tensor] = {}
    for key, (a, b) in sorted(weights.tensors.items()):
        tensors[f"base_model.model.model.{key}.lora_A.weight"] = a.detach().to("cpu", torch.float32)
        tensors[f"base_model.model.model.{key}.lora_B.weight"] = b.detach().to("cpu", torch.float32)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": weights.rank,
        "lora_alpha": weights.alpha,
        "use_rslora": weights.use_rslora,
        "target_modules": list(weights.target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "init_lora_weights": True,
    }
    return {
        WEIGHTS_NAME: encode_safetensors(tensors, {"format": "pt"}),
        CONFIG_NAME: [(json.dumps(config, indent=2) + "\n").encode()],
    }


def save_peft_adapter(
    weights: LoRAWeights, path: Path, *, base_model: str
) -> dict[str, FileDigest]:
    """Write `weights` as a PEFT directory (config + safetensors), each file fsynced.

    The caller makes it visible atomically (write to a temp dir, then rename) and
    fsyncs the directory.

    Returns:
        File name -> its sha256 and size, computed from what was written (no read-back).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return write_files(path, peft_files(weights, base_model=base_model))
