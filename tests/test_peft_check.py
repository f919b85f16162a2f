"""`check_peft_adapter`: the header-only check an engine that reads tensors itself runs
before loading a PEFT directory. It must refuse what `load_peft_adapter` refuses
structurally, without reading tensor data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from clora_feedback.errors import AdapterError
from clora_feedback.lora.peft_io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_peft_adapter,
    load_peft_adapter,
    save_peft_adapter,
)
from clora_feedback.lora.weights import LoRALimits, random_lora_weights

SHAPES = {"q_proj": (32, 32), "v_proj": (32, 16)}
LIMITS = LoRALimits(16, tuple(SHAPES), 2, SHAPES)


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    path = tmp_path / "a"
    save_peft_adapter(random_lora_weights(LIMITS, rank=4, seed=1), path, base_model="tiny")
    return path


def _rewrite(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    """Replace (tensor) or drop (None) tensors of the adapter's safetensors file."""
    tensors = load_file(str(path / WEIGHTS_NAME))
    for name, tensor in edit.items():
        if tensor is None:
            tensors.pop(name)
        else:
            tensors[name] = tensor
    save_file(tensors, str(path / WEIGHTS_NAME))


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def test_a_saved_adapter_passes_with_its_rank(adapter: Path) -> None:
    assert check_peft_adapter(adapter, limits=LIMITS) == 4
    assert load_peft_adapter(adapter, limits=LIMITS).rank == 4  # the full load agrees


def test_a_truncated_file_is_refused(adapter: Path) -> None:
    weights = adapter / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(AdapterError, match="cannot read"):
        check_peft_adapter(adapter, limits=LIMITS)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({A0: torch.zeros(4, 31)}, "expected A"),
        ({B0: None}, "needs both"),
        ({"base_model.model.model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, "unexpected"),
        ({A0: torch.zeros(4, 32, dtype=torch.int32)}, "not floating point"),
        (
            {
                A0.replace("q_proj", "k_proj"): torch.zeros(4, 32),
                B0.replace("q_proj", "k_proj"): torch.zeros(32, 4),
            },
            "not a projection",
        ),
        (
            {
                A0.replace("layers.0", "layers.7"): torch.zeros(4, 32),
                B0.replace("layers.0", "layers.7"): torch.zeros(32, 4),
            },
            "layer 7",
        ),
    ],
)
def test_structural_faults_are_refused(
    adapter: Path, edit: dict[str, torch.Tensor | None], message: str
) -> None:
    _rewrite(adapter, edit)
    with pytest.raises(AdapterError, match=message):
        check_peft_adapter(adapter, limits=LIMITS)


def test_config_limits_apply_before_the_header(adapter: Path) -> None:
    config = json.loads((adapter / CONFIG_NAME).read_text())
    (adapter / CONFIG_NAME).write_text(json.dumps(config | {"r": 32}))
    with pytest.raises(AdapterError, match="rank 32"):
        check_peft_adapter(adapter, limits=LIMITS)
    (adapter / WEIGHTS_NAME).unlink()
    (adapter / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="missing"):
        check_peft_adapter(adapter, limits=LIMITS)


def test_values_are_not_read(adapter: Path) -> None:
    """Non-finite values pass the header check (the writer's promise) but not the full load:
    the check reads no tensor data."""
    _rewrite(adapter, {A0: torch.full((4, 32), float("nan"))})
    assert check_peft_adapter(adapter, limits=LIMITS) == 4
    with pytest.raises(AdapterError, match="non-finite"):
        load_peft_adapter(adapter, limits=LIMITS)
