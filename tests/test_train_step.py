"""Trainer core: differentiable forward == PEFT, batched multi-tenant grads == alone, steps learn."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.model.tiny import build_tiny_model_dir
from clora_feedback.train.forward import PackedBatch, TrainLoRA
from clora_feedback.train.loss import LossConfig
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.state import (
    AdamConfig,
    AgentTrainState,
    LoRALayout,
    TrainingSlot,
    adam_step,
    init_lora,
)
from clora_feedback.train.step import AgentBatch, PGSample, SFTSample, train_step

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", seed=5)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> DecoderPolicy:
    return DecoderPolicy.from_dir(model_dir, max_lora_rank=16, target_modules=ALL)


def _state(model: DecoderPolicy, agent: str, rank: int, seed: int) -> AgentTrainState:
    layout = LoRALayout.build(model.lora_limits, rank, 2.0 * rank, ALL)
    flat = init_lora(layout, seed=seed)
    flat += (
        torch.randn(flat.shape, generator=torch.Generator().manual_seed(seed)) * 0.05
    )  # non-zero B too
    return AgentTrainState.create(agent, layout, flat)


def _pg(seed: int, n: int = 3) -> list[PGSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 250, (4 + i,), generator=gen).tolist()
        completion = torch.randint(3, 250, (3 + 2 * i,), generator=gen).tolist()
        out.append(
            PGSample(f"g{i % 2}", prompt, completion, [-5.5] * len(completion), float(i) - 1.0)
        )
    return out


def test_forward_matches_peft(model: DecoderPolicy, model_dir: Path, tmp_path: Path) -> None:
    state = _state(model, "a", 4, 0)
    save_peft_adapter(state.layout.to_weights(state.params), tmp_path / "a", base_model="tiny")
    seqs = [([5, 6, 7, 8], [9, 10, 11]), ([20, 21], [22, 23, 24, 25, 26])]
    lp = model.token_logprobs(
        PackedBatch.build(seqs),
        TrainLoRA([state.layout], [state.params], torch.tensor([0, 0])),
    )
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "a")).eval()
    expected = []
    with torch.no_grad():
        for prompt, completion in seqs:
            logits = peft_model(torch.tensor([prompt + completion])).logits[0].float()
            table = torch.log_softmax(logits, -1)
            expected += [table[len(prompt) - 1 + k, tok] for k, tok in enumerate(completion)]
    torch.testing.assert_close(lp, torch.stack(expected), atol=1e-4, rtol=0)
    # Adapter disabled = base model (the KL reference policy).
    base_lp = model.token_logprobs(PackedBatch.build(seqs), None)
    with torch.no_grad(), peft_model.disable_adapter():  # PEFT injected its layers into `base`
        ref = torch.log_softmax(
            peft_model(torch.tensor([seqs[0][0] + seqs[0][1]])).logits[0].float(), -1
        )
    torch.testing.assert_close(
        base_lp[:3],
        torch.stack([ref[3 + k, t] for k, t in enumerate(seqs[0][1])]),
        atol=1e-4,
        rtol=0,
    )


def test_batched_multi_tenant_step_equals_each_agent_alone(model: DecoderPolicy) -> None:
    agents = [_state(model, f"a{i}", rank, seed=i) for i, rank in enumerate((2, 8, 4))]
    batches = [
        AgentBatch(agents[0], pg=_pg(1)),
        AgentBatch(agents[1], pg=_pg(2, n=2), sft=[SFTSample([7, 8, 9], [40, 41, 2])]),
        AgentBatch(agents[2], sft=[SFTSample([3, 4], [50, 51, 52, 2]), SFTSample([5], [60, 2])]),
    ]
    cfg, adam = LossConfig(), AdamConfig(lr=1e-2)
    alone_batches = copy.deepcopy(batches)
    capacity = max(a.layout.numel for a in agents)
    together = train_step(
        model, [TrainingSlot(capacity, model.device) for _ in range(3)], batches, cfg, adam
    )
    alone = [
        train_step(model, [TrainingSlot(capacity, model.device)], [b], cfg, adam)[0]
        for b in alone_batches
    ]
    for t, a, bt, ba in zip(together, alone, batches, alone_batches, strict=True):
        assert t.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert t.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
        _assert_same_adam_step(bt.state, ba.state, adam)
        scale = float(ba.state.exp_avg.abs().max())  # exp_avg = 0.1 * grad after one step
        torch.testing.assert_close(bt.state.exp_avg, ba.state.exp_avg, atol=1e-4 * scale, rtol=1e-4)
        assert bt.state.step == 1 and t.grad_norm > 0


def _assert_same_adam_step(got: AgentTrainState, want: AgentTrainState, adam: AdamConfig) -> None:
    """Parameters after one step agree to 1e-6, except as far as Adam amplifies gradient noise.

    The batched and the single-agent pass sum the same fp32 terms in different
    orders, so their gradients differ by rounding (|dg| ~ 1e-9 of the largest
    gradient; the exp_avg check bounds it). Adam's first step moves each
    parameter by lr * g / (|g| + eps), about lr * sign(g), whose slope
    lr * eps / (|g| + eps)^2 turns that rounding into up to ~1e4 * |dg| where
    |g| is near eps (1e-8). The bound below is exactly that propagation (mean
    value theorem; through g = 0 if the signs differ), so a real gradient error
    on any parameter with a non-negligible gradient still fails.
    """
    b1 = adam.betas[0]
    g_got, g_want = got.exp_avg / (1 - b1), want.exp_avg / (1 - b1)
    smallest = torch.where(
        g_got * g_want > 0, torch.minimum(g_got.abs(), g_want.abs()), torch.zeros_like(g_got)
    )
    slope = adam.lr * adam.eps / (smallest + adam.eps) ** 2
    bound = 1e-6 + 1e-5 * want.params.abs() + 2 * slope * (g_got - g_want).abs()
    diff = (got.params - want.params).abs()
    assert bool((diff <= bound).all()), f"max excess {float((diff - bound).max())}"


def test_repeated_steps_learn_the_correction(model: DecoderPolicy) -> None:
    state = _state(model, "sft", 8, 3)
    target = SFTSample([10, 11, 12], [100, 101, 102, 103, 2])
    slot = TrainingSlot(state.layout.numel, model.device)
    first = train_step(
        model, [slot], [AgentBatch(state, sft=[target])], LossConfig(), AdamConfig(lr=5e-3)
    )[0]
    for _ in range(15):
        last = train_step(
            model, [slot], [AgentBatch(state, sft=[target])], LossConfig(), AdamConfig(lr=5e-3)
        )[0]
    assert last.sft_loss < 0.5 * first.sft_loss
    assert state.step == 16 and state.exp_avg.abs().sum() > 0
    assert slot.owner is None  # swapped back out


def test_policy_gradient_raises_rewarded_sample_probability(model: DecoderPolicy) -> None:
    state = _state(model, "pg", 4, 4)
    good = PGSample("x", [9, 9, 9], [30, 31, 32], [], 1.0)
    bad = PGSample("x", [9, 9, 9], [70, 71, 72], [], 0.0)
    batch = PackedBatch.build(
        [(good.prompt_ids, good.completion_ids), (bad.prompt_ids, bad.completion_ids)]
    )

    def logps() -> torch.Tensor:
        with torch.no_grad():
            lora = TrainLoRA([state.layout], [state.params], torch.tensor([0, 0]))
            return model.token_logprobs(batch, lora).view(2, 3)  # [sample, token]

    before = logps().sum(1)
    slot = TrainingSlot(state.layout.numel, model.device)
    for _ in range(5):
        now = logps()  # on-policy: behaviour logprobs are the current policy's
        samples = [
            PGSample(s.group, s.prompt_ids, s.completion_ids, now[i].tolist(), s.reward)
            for i, s in enumerate((good, bad))
        ]
        step = train_step(
            model, [slot], [AgentBatch(state, pg=samples)], LossConfig(), AdamConfig(lr=1e-2)
        )
        assert step[0].ratio_mean == pytest.approx(1.0, abs=1e-5)
    after = logps().sum(1)
    assert after[0] - before[0] > 1.0 and after[1] < before[1], (before, after)


def test_shared_prompt_prefix_is_computed_once_with_the_same_values_and_gradients(
    model: DecoderPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows sharing a long prompt prefix (two agents, mixed ranks): the shared-prefix pass
    gives the per-row pass's logprobs and gradients, and the KL reference (no adapter) too."""
    import clora_feedback.train.forward as forward

    gen = torch.Generator().manual_seed(11)
    system = torch.randint(3, 250, (40,), generator=gen).tolist()
    seqs = []
    for i in range(5):
        question = torch.randint(3, 250, (2 + i,), generator=gen).tolist()
        answer = torch.randint(3, 250, (3 + (i % 3),), generator=gen).tolist()
        seqs.append((system + question, answer))
    packed = PackedBatch.build(seqs)
    assert forward.shared_prefix_len(packed) == 40  # the questions differ from their first token on
    agents = [_state(model, "a", 4, 21), _state(model, "b", 8, 22)]
    owner = torch.tensor([0, 0, 0, 1, 1])

    def run() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        leaves = [s.params.clone().requires_grad_(True) for s in agents]
        lora = TrainLoRA([s.layout for s in agents], leaves, owner)
        lp = model.token_logprobs(packed, lora)
        (lp * torch.linspace(-1.0, 1.0, lp.numel())).sum().backward()
        with torch.no_grad():
            ref = model.token_logprobs(packed, None)
        return lp.detach(), ref, [leaf.grad for leaf in leaves]  # type: ignore[misc]

    shared = run()
    monkeypatch.setattr(forward, "MIN_SHARED_PREFIX", 10_000)  # force the per-row pass
    assert forward.shared_prefix_len(packed) == 0
    per_row = run()
    torch.testing.assert_close(shared[0], per_row[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1], per_row[1], atol=1e-5, rtol=1e-5)
    for g_shared, g_rows in zip(shared[2], per_row[2], strict=True):
        assert float(g_rows.abs().max()) > 0
        torch.testing.assert_close(g_shared, g_rows, atol=1e-5, rtol=1e-4)


def test_no_prefix_is_shared_into_a_scored_position() -> None:
    """The prefix stops before the first scored position of any row, and at the first difference."""
    from clora_feedback.train.forward import shared_prefix_len

    common = list(range(3, 23))  # 20 tokens
    assert (
        shared_prefix_len(PackedBatch.build([([*common, 30], [31]), ([*common, 40], [41])])) == 20
    )
    # A row whose prompt ends inside the common part caps it (its first scored position).
    short = PackedBatch.build([(common[:18], [50, 51]), ([*common, 60], [61])])
    assert shared_prefix_len(short) == 17
    assert shared_prefix_len(PackedBatch.build([(common, [1])])) == 0  # one row: nothing to share
    assert shared_prefix_len(PackedBatch.build([([5] * 8, [1]), ([5] * 8, [2])])) == 0  # too short


def _textbook_adamw(
    params: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    cfg: AdamConfig,
) -> None:
    """AdamW as the paper writes it (Loshchilov & Hutter), one elementwise op at a time."""
    norm = float(grad.norm())
    if cfg.max_grad_norm > 0 and norm > cfg.max_grad_norm:
        grad = grad * (cfg.max_grad_norm / (norm + 1e-12))
    b1, b2 = cfg.betas
    m.mul_(b1).add_(grad, alpha=1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    lr = cfg.lr_at(step)
    denom = (v / (1 - b2**step)).sqrt() + cfg.eps
    params.mul_(1 - lr * cfg.weight_decay).addcdiv_(m, denom, value=-lr / (1 - b1**step))


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_the_fused_adam_step_is_textbook_adamw(clip: float) -> None:
    cfg = AdamConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=clip, warmup_steps=2)
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(1000, generator=gen)
    got = [params.clone(), torch.zeros(1000), torch.zeros(1000)]
    want = [params.clone(), torch.zeros(1000), torch.zeros(1000)]
    for step in range(1, 5):
        grad = torch.randn(1000, generator=gen) * step
        norm = adam_step(got[0], grad, got[1], got[2], step, cfg)
        _textbook_adamw(want[0], grad, want[1], want[2], step, cfg)
        assert norm == pytest.approx(float(grad.norm()))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(got[0], params)
