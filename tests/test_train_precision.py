"""bf16 compute with fp32 master weights: gradients close to fp32, state and files stay fp32.

On the tiny random model: a bf16 pass (bf16 base weights and activations, LoRA
factors cast from the fp32 masters, fp32 head and log-softmax) gives the fp32
pass's logprobs and gradients within bf16 tolerance, lands its gradient in the
fp32 master's buffer, leaves the parameters, Adam moments and slot buffers
fp32, saves an fp32 PEFT adapter that loads back exactly, and a run resumed
from the saved version and optimizer state continues exactly like the
original.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clora_feedback.config import EngineConfig, TrainerConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.hardware import resolve_dtype
from clora_feedback.lora.peft_io import load_peft_adapter, save_peft_adapter
from clora_feedback.train.forward import PackedBatch, TrainLoRA, next_token_logprobs
from clora_feedback.train.loss import LossConfig
from clora_feedback.train.policy import DecoderPolicy, cast_base
from clora_feedback.train.state import (
    AdamConfig,
    AgentTrainState,
    LoRALayout,
    TrainingSlot,
    init_lora,
)
from clora_feedback.train.step import AgentBatch, PGSample, SFTSample, train_step

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _policy(model_dir: Path, dtype: torch.dtype) -> DecoderPolicy:
    return DecoderPolicy.from_dir(model_dir, max_lora_rank=8, target_modules=ALL, dtype=dtype)


@pytest.fixture(scope="module")
def fp32(tiny_model_dir: Path) -> DecoderPolicy:
    return _policy(tiny_model_dir, torch.float32)


@pytest.fixture(scope="module")
def bf16(tiny_model_dir: Path) -> DecoderPolicy:
    return _policy(tiny_model_dir, torch.bfloat16)


def _state(policy: DecoderPolicy, seed: int = 0) -> AgentTrainState:
    layout = LoRALayout.build(policy.lora_limits, 8, 16.0, ALL)
    flat = init_lora(layout, seed=seed)
    flat += 0.05 * torch.randn(flat.shape, generator=torch.Generator().manual_seed(seed + 1))
    return AgentTrainState.create("agent", layout, flat)


def _batch(seed: int = 3) -> AgentBatch:
    """Policy-gradient rows sharing a 24-token prompt prefix, plus one supervised row."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 250, (24,), generator=gen).tolist()
    pg = []
    for i in range(3):
        prompt = system + torch.randint(3, 250, (3 + i,), generator=gen).tolist()
        completion = torch.randint(3, 250, (4,), generator=gen).tolist()
        pg.append(PGSample(f"g{i}", prompt, completion, [-5.5] * 4, float(i % 2)))
    sft = [SFTSample([*system, 7, 8, 9], [40, 41, 2])]
    return AgentBatch(_state_placeholder(), pg, sft)


def _state_placeholder() -> AgentTrainState:
    layout = LoRALayout(8, 16.0, (), 0)
    return AgentTrainState.create("none", layout, torch.zeros(0))


def _loss_grad(
    policy: DecoderPolicy, state: AgentTrainState, packed: PackedBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = state.params.clone().requires_grad_(True)
    lp = policy.token_logprobs(packed, TrainLoRA([state.layout], [leaf], _owner(packed)))
    (lp * torch.linspace(-1.0, 1.0, lp.numel())).sum().backward()
    assert leaf.grad is not None
    return lp.detach(), leaf.grad


def _owner(packed: PackedBatch) -> torch.Tensor:
    return torch.zeros(packed.input_ids.shape[0], dtype=torch.long)


def _packed(batch: AgentBatch) -> PackedBatch:
    rows = [(s.prompt_ids, s.completion_ids) for s in batch.pg]
    return PackedBatch.build(rows + [(t.prompt_ids, t.target_ids) for t in batch.sft])


def test_bf16_pass_gives_the_fp32_logprobs_and_gradients_within_bf16_tolerance(
    fp32: DecoderPolicy, bf16: DecoderPolicy
) -> None:
    assert bf16.compute_dtype == torch.bfloat16 and bf16.head.dtype == torch.float32
    state = _state(fp32)
    packed = _packed(_batch())
    lp32, g32 = _loss_grad(fp32, state, packed)
    lp16, g16 = _loss_grad(bf16, state, packed)
    # Logprobs come out fp32 (head and log-softmax in fp32), within bf16 activation noise.
    assert lp16.dtype == torch.float32
    assert float((lp16 - lp32).abs().max()) < 0.05
    # The gradient lands in the fp32 master's buffer and points the same way as fp32's.
    assert g16.dtype == torch.float32 and g16.shape == state.params.shape
    cosine = float(torch.nn.functional.cosine_similarity(g16, g32, dim=0))
    assert cosine > 0.999, cosine
    assert float((g16.norm() - g32.norm()).abs() / g32.norm()) < 0.02
    # ...and is not simply the fp32 one: the pass really ran in bf16.
    assert not torch.equal(g16, g32)


def test_bf16_step_keeps_masters_moments_and_slot_fp32(bf16: DecoderPolicy) -> None:
    state = _state(bf16)
    before = state.params.clone()
    batch = _batch()
    batch.state = state
    slot = TrainingSlot(state.layout.numel, bf16.device)
    result = train_step(bf16, [slot], [batch], LossConfig(), AdamConfig(lr=1e-3))[0]
    assert result.grad_norm > 0 and result.tokens == 15
    for t in (state.params, state.exp_avg, state.exp_avg_sq, slot.params, slot.exp_avg):
        assert t.dtype == torch.float32
    assert not torch.equal(state.params, before)  # the fp32 masters moved
    assert float(state.exp_avg_sq.abs().max()) > 0
    stored = state.optimizer_state()
    assert stored["exp_avg"].dtype == stored["exp_avg_sq"].dtype == torch.float32


def test_bf16_adapter_saves_as_fp32_peft_and_a_resumed_run_continues_exactly(
    bf16: DecoderPolicy, tmp_path: Path
) -> None:
    state = _state(bf16)
    adam, loss = AdamConfig(lr=1e-3), LossConfig()
    slot = TrainingSlot(state.layout.numel, bf16.device)

    def step(s: AgentTrainState) -> None:
        batch = _batch()
        batch.state = s
        train_step(bf16, [slot], [batch], loss, adam)

    step(state)
    save_peft_adapter(state.layout.to_weights(state.params), tmp_path / "v1", base_model="tiny")
    files = load_file(str(tmp_path / "v1" / "adapter_model.safetensors"))
    assert files and all(t.dtype == torch.float32 for t in files.values())
    loaded = load_peft_adapter(tmp_path / "v1", limits=bf16.lora_limits)
    resumed = AgentTrainState.create("agent", state.layout, state.layout.from_weights(loaded))
    torch.testing.assert_close(resumed.params, state.params, atol=0, rtol=0)
    resumed.load_optimizer_state(copy.deepcopy(state.optimizer_state()))
    resumed.baseline = state.baseline
    assert resumed.step == 1
    step(state)
    step(resumed)
    assert resumed.step == state.step == 2
    torch.testing.assert_close(resumed.params, state.params, atol=0, rtol=0)
    torch.testing.assert_close(resumed.exp_avg_sq, state.exp_avg_sq, atol=0, rtol=0)


def test_shared_policy_in_another_dtype_gets_a_cast_copy(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(
        tiny_model_dir, EngineConfig(max_num_seqs=2, max_loras=2, max_model_len=256)
    )
    served = engine.base_weights
    same = DecoderPolicy.shared_with(engine, compute_dtype=torch.float32)
    assert same.base is served and same.head is served.lm_head
    policy = DecoderPolicy.shared_with(engine, compute_dtype=torch.bfloat16)
    assert policy.base is not served and policy.compute_dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in policy.base.tensors())
    assert all(t.dtype == torch.float32 for t in served.tensors())  # the engine's untouched
    assert (policy.base.lm_head is policy.base.embed) == (served.lm_head is served.embed)
    torch.testing.assert_close(
        cast_base(served, torch.bfloat16).layers[0]["qkv"], served.layers[0]["qkv"].bfloat16()
    )
    # the default, `auto`: fp32 under the suite's AVX2-only rule (conftest)
    assert resolve_dtype(TrainerConfig().compute_dtype, "cpu") == torch.float32


def test_next_token_distribution_agrees_with_token_logprobs(
    fp32: DecoderPolicy, bf16: DecoderPolicy
) -> None:
    """The rollout distribution (`next_token_logprobs`) scores what `token_logprobs` scores."""
    state = _state(fp32)
    packed = PackedBatch.build([([5, 6, 7, 8], [9]), ([20, 21], [22])])
    for policy in (fp32, bf16):
        lora = TrainLoRA([state.layout], [state.params], _owner(packed))
        with torch.no_grad():
            table = next_token_logprobs(policy.base, packed, lora, policy.head)
            lp = policy.token_logprobs(packed, lora)
        assert table.shape == (2, policy.base.config.vocab_size) and table.dtype == torch.float32
        torch.testing.assert_close(table.gather(1, torch.tensor([[9], [22]])).squeeze(1), lp)
        torch.testing.assert_close(table.exp().sum(-1), torch.ones(2))
