"""The trainer's model seam: a policy sharing the engine's base tensors == one with its own copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clora_feedback.config import EngineConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.train.forward import PackedBatch, TrainLoRA
from clora_feedback.train.loss import LossConfig
from clora_feedback.train.policy import DecoderPolicy, PolicyModel
from clora_feedback.train.state import (
    AdamConfig,
    AgentTrainState,
    LoRALayout,
    TrainingSlot,
    init_lora,
)
from clora_feedback.train.step import AgentBatch, SFTSample, train_step


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> EmbeddedEngine:
    return EmbeddedEngine(
        tiny_model_dir, EngineConfig(max_num_seqs=2, max_loras=2, max_model_len=256)
    )


def _own_copy(engine: EmbeddedEngine, model_dir: Path) -> DecoderPolicy:
    limits = engine.lora_limits
    return DecoderPolicy.from_dir(
        model_dir,
        max_lora_rank=limits.max_rank,
        target_modules=tuple(limits.target_modules),
        model_name=engine.model_name,
        max_model_len=256,
    )


def _lora(policy: PolicyModel) -> tuple[AgentTrainState, TrainLoRA]:
    limits = policy.lora_limits
    layout = LoRALayout.build(limits, 4, 8.0, tuple(limits.target_modules))
    flat = init_lora(layout, seed=1) + 0.05 * torch.randn(
        layout.numel, generator=torch.Generator().manual_seed(2)
    )  # non-zero B, so the adapter changes the logprobs
    state = AgentTrainState.create("a", layout, flat)
    return state, TrainLoRA([layout], [state.params], torch.tensor([0, 0]))


def test_shared_policy_reads_the_engines_tensors_in_place(engine: EmbeddedEngine) -> None:
    shared = DecoderPolicy.shared_with(engine)
    served = [t.data_ptr() for t in engine.base_weights.tensors()]
    assert [t.data_ptr() for t in shared.base.tensors()] == served
    assert shared.base is engine.model.base
    assert shared.lora_limits == engine.lora_limits
    assert (shared.max_model_len, shared.model_name) == (engine.max_model_len, engine.model_name)
    assert shared.tokenizer is engine.tokenizer and shared.device == engine.device


def test_own_copy_gives_the_same_logprobs_on_separate_storage(
    engine: EmbeddedEngine, tiny_model_dir: Path
) -> None:
    shared, own = DecoderPolicy.shared_with(engine), _own_copy(engine, tiny_model_dir)
    served = {t.data_ptr() for t in engine.base_weights.tensors()}
    assert served.isdisjoint(t.data_ptr() for t in own.base.tensors())
    assert own.lora_limits == shared.lora_limits and own.max_model_len == shared.max_model_len
    batch = PackedBatch.build([([5, 6, 7, 8], [9, 10, 11]), ([20, 21], [22, 23, 24, 25])])
    _, lora = _lora(shared)
    with torch.no_grad():
        with_adapter = shared.token_logprobs(batch, lora)
        torch.testing.assert_close(own.token_logprobs(batch, lora), with_adapter, atol=0, rtol=0)
        reference = shared.token_logprobs(batch, None)
        torch.testing.assert_close(own.token_logprobs(batch, None), reference, atol=0, rtol=0)
    assert (with_adapter - reference).abs().max() > 1e-3  # the adapter is really applied


def test_training_on_the_shared_policy_leaves_the_served_base_untouched(
    engine: EmbeddedEngine,
) -> None:
    shared = DecoderPolicy.shared_with(engine)
    before = [t.clone() for t in engine.base_weights.tensors()]
    state, _ = _lora(shared)
    slot = TrainingSlot(state.layout.numel, shared.device)
    batch = AgentBatch(state, sft=[SFTSample([3, 4, 5], [40, 41, 2])])
    result = train_step(shared, [slot], [batch], LossConfig(), AdamConfig(lr=1e-2))[0]
    assert result.grad_norm > 0 and state.step == 1
    for old, now in zip(before, engine.base_weights.tensors(), strict=True):
        assert torch.equal(old, now) and not now.requires_grad
