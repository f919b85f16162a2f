"""The embedded sampler (`engine.sampling`): each control does what OpenAI/vLLM define,
rows with different controls share a batch without changing each other, seeds are pure.

Unit tests on hand-made logits (no model), then the controls end to end on the
embedded engine over the tiny random model (`test_engine_contract.py` runs the
engine-independent part on every engine).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from clora_feedback.config import EngineConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.sampling import (
    RowSampler,
    apply_controls,
    distribution,
    draw,
    sample_batch,
    splitmix64,
    uniform,
)
from clora_feedback.engine.types import GenerationRequest, SamplingParams, choice_seed
from clora_feedback.errors import InvalidRequestError

V = 12


def _rows(*params: SamplingParams) -> list[RowSampler]:
    return [RowSampler.create(p, stop_ids=(V - 1,)) for p in params]


def _logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _ramp() -> torch.Tensor:
    """[1, V] logits with token 0 the most likely, then 1, 2, ..."""
    return -torch.arange(V, dtype=torch.float32)[None] * 0.5


# ---------------------------------------------------------------- seeds


def test_splitmix64_matches_the_reference_sequence() -> None:
    # Vigna's splitmix64.c with the state starting at 0.
    assert [splitmix64(0, i) for i in range(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]
    assert all(0.0 <= uniform(s, t) < 1.0 for s in (0, 2**64 - 1) for t in range(50))


def test_choice_seeds_wrap_modulo_2_64() -> None:
    assert choice_seed(7, 2) == 9
    assert choice_seed(2**64 - 1, 0) == 2**64 - 1 and choice_seed(2**64 - 1, 1) == 0
    assert choice_seed(-1, 0) == 2**64 - 1  # the same 64-bit pattern
    assert choice_seed(-(2**63), 0) == 2**63


def test_engine_seeds_outside_64_bits_are_refused_by_name() -> None:
    for seed in (-1, 2**64):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(seed=seed).check(V)
        assert err.value.param == "seed"
    SamplingParams(seed=2**64 - 1).check(V)


def test_parameter_ranges_are_checked_by_name() -> None:
    cases = {
        "logit_bias": SamplingParams(logit_bias=((V, 1.0),)),
        "top_k": SamplingParams(top_k=-1),
        "min_tokens": SamplingParams(max_tokens=4, min_tokens=5),
    }
    for param, params in cases.items():
        with pytest.raises(InvalidRequestError) as err:
            params.check(V)
        assert err.value.param == param


# ---------------------------------------------------------------- each control


def test_default_rows_take_the_fast_path() -> None:
    logits = _ramp().repeat(3, 1)
    rows = _rows(SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=3))
    assert apply_controls(logits, rows) is logits  # no copy, no per-control work


def test_logit_bias_forces_or_bans_a_token() -> None:
    for temperature in (0.0, 1.0):
        forced = _rows(*(SamplingParams(temperature=temperature, logit_bias=((7, 100.0),)),) * 4)
        assert {c.token_id for c in sample_batch(_ramp().repeat(4, 1), forced)} == {7}
    banned = _rows(SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)))
    assert sample_batch(_ramp(), banned)[0].token_id == 1


def test_penalties_count_generated_tokens_presence_flat_frequency_per_time() -> None:
    logits = _logits([2.0, 0.6] + [-9.0] * (V - 2))  # token 0 leads token 1 by 1.4
    presence = _rows(SamplingParams(temperature=0.0, presence_penalty=1.0))[0]
    frequency = _rows(SamplingParams(temperature=0.0, frequency_penalty=1.0))[0]
    picks: dict[str, list[int | None]] = {"presence": [], "frequency": []}
    for _ in range(3):
        for name, row in (("presence", presence), ("frequency", frequency)):
            picks[name].append(sample_batch(logits, [row])[0].token_id)
    # presence: 2.0 - 1 = 1.0 still beats 0.6 however often token 0 came;
    # frequency: after one 0: 1.0 > 0.6; after two: 0.0 < 0.6, then 1 (0.6 - 1 < 0.0).
    assert picks["presence"] == [0, 0, 0]
    assert picks["frequency"] == [0, 0, 1]


def test_penalties_ignore_the_prompt() -> None:
    # A fresh row has generated nothing: the penalty changes nothing on its first token.
    row = _rows(SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0))
    assert sample_batch(_ramp(), row)[0].token_id == 0


def test_min_tokens_blocks_the_stop_tokens_until_reached() -> None:
    eos = V - 1
    logits = _logits([0.0] * (V - 1) + [50.0])  # EOS is by far the most likely
    row = _rows(SamplingParams(temperature=1.0, seed=3, min_tokens=3))[0]
    tokens = [sample_batch(logits, [row])[0].token_id for _ in range(4)]
    assert eos not in tokens[:3] and tokens[3] == eos


def test_top_k_keeps_the_k_most_likely() -> None:
    seen = Counter(
        sample_batch(_ramp(), _rows(SamplingParams(seed=s, top_k=3)))[0].token_id
        for s in range(300)
    )
    assert set(seen) == {0, 1, 2}
    top1 = [sample_batch(_ramp(), _rows(SamplingParams(seed=s, top_k=1)))[0] for s in range(20)]
    assert {c.token_id for c in top1} == {0}  # top_k=1 is greedy at any temperature


def test_distribution_semantics() -> None:
    logits = _ramp()
    plain = distribution(logits, [SamplingParams()])[0]
    assert torch.allclose(plain, torch.softmax(logits[0], -1))
    hot = distribution(logits, [SamplingParams(temperature=2.0)])[0]
    assert torch.allclose(hot, torch.softmax(logits[0] / 2.0, -1))
    nucleus = distribution(logits, [SamplingParams(top_p=0.6)])[0]
    mass = torch.softmax(logits[0], -1)
    kept = int((mass.cumsum(-1) - mass < 0.6).sum())  # the smallest prefix reaching 0.6
    assert (nucleus[:kept] > 0).all() and (nucleus[kept:] == 0).all()
    assert nucleus.sum().item() == pytest.approx(1.0)


def test_seeded_draws_follow_the_distribution() -> None:
    logits = _ramp()
    probs = torch.softmax(logits[0], -1).tolist()
    n = 4000
    counts = Counter(
        sample_batch(logits, _rows(SamplingParams(seed=s)))[0].token_id for s in range(n)
    )
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in enumerate(probs) if n * p >= 5)
    assert chi2 < 40  # 11 degrees of freedom: p < 1e-4 by chance; a biased draw is far above


def test_the_two_level_draw_is_the_exact_inverse_cdf() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 5000  # several blocks, the last one partial
    logits = torch.randn(3, vocab, generator=gen) * 4
    logits[:, ::7] = float("-inf")  # zero-probability tokens are never drawn
    probs = torch.softmax(logits, -1)
    uniforms = torch.rand(400, generator=gen, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    for b in range(3):
        tokens = draw(probs[b : b + 1].expand(400, -1), uniforms).tolist()
        for u, token in zip(uniforms.tolist(), tokens, strict=True):
            assert probs[b, token] > 0
            target = u * cdf[b, -1].item()
            low = cdf[b, token - 1].item() if token else 0.0
            assert low - 1e-6 <= target <= cdf[b, token].item() + 1e-6


def test_logprobs_are_raw_whatever_the_controls() -> None:
    logits = _ramp()
    raw = torch.log_softmax(logits[0], -1)
    row = _rows(SamplingParams(temperature=0.5, top_k=2, seed=1, logit_bias=((5, 100.0),)))
    choice = sample_batch(logits, row)[0]
    assert choice.token_id == 5 and choice.logprob == pytest.approx(raw[5].item())


# ---------------------------------------------------------------- a batch of different rows


MIXED = (
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(seed=11, temperature=0.7, top_k=4, top_p=0.9),
    SamplingParams(temperature=0.0, presence_penalty=1.5, logit_bias=((3, 2.0), (0, -1.0))),
    SamplingParams(seed=5, frequency_penalty=0.8, min_tokens=4),
    SamplingParams(seed=2**64 - 1, temperature=1.3),
)


def test_a_mixed_batch_equals_each_row_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(len(MIXED), V, generator=gen) * 2 for _ in range(12)]
    seeded = [p if p.seed is not None else replace(p, seed=99) for p in MIXED]
    together, alone = _rows(*seeded), _rows(*seeded)
    batch_tokens: list[list[int | None]] = [[] for _ in MIXED]
    solo_tokens: list[list[int | None]] = [[] for _ in MIXED]
    for logits in steps:
        for b, choice in enumerate(sample_batch(logits, together)):
            batch_tokens[b].append(choice.token_id)
        for b, row in enumerate(alone):
            solo_tokens[b].append(sample_batch(logits[b : b + 1], [row])[0].token_id)
    assert batch_tokens == solo_tokens
    assert V - 1 not in batch_tokens[4][:4]  # min_tokens held in the batch too


# ---------------------------------------------------------------- on the embedded engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    config = EngineConfig(max_num_seqs=4, max_loras=2, max_model_len=512, num_threads=1)
    eng = EmbeddedEngine(tiny_model_dir, config, model_name="tiny-base")
    eng.start_thread()
    yield eng
    eng.stop_thread()


async def _generate(engine: EmbeddedEngine, rid: str, prompt: list[int], **sp: object) -> list[int]:
    stream = engine.add_request(GenerationRequest(rid, None, prompt, SamplingParams(**sp)))  # type: ignore[arg-type]
    return [t.token_id async for chunk in stream for t in chunk.tokens]


async def test_frequency_penalty_stops_a_repeating_model(engine: EmbeddedEngine) -> None:
    prompt = list(engine.tokenizer.encode("Once upon"))
    greedy = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    plain = await _generate(engine, "plain", prompt, **greedy)
    penalized = await _generate(engine, "pen", prompt, frequency_penalty=2.0, **greedy)
    assert max(Counter(plain).values()) >= 3  # the tiny model loops
    assert max(Counter(penalized).values()) < max(Counter(plain).values())
    assert len(set(penalized)) > len(set(plain))


async def test_min_tokens_prevents_an_early_eos(engine: EmbeddedEngine) -> None:
    prompt = list(engine.tokenizer.encode("abc"))
    force_eos = tuple((t, 100.0) for t in sorted(engine.eos_token_ids))
    early = await _generate(
        engine, "early", prompt, max_tokens=10, temperature=0.0, logit_bias=force_eos
    )
    held = await _generate(
        engine, "held", prompt, max_tokens=10, temperature=0.0, logit_bias=force_eos, min_tokens=5
    )
    assert len(early) == 1 and early[0] in engine.eos_token_ids
    assert (
        len(held) == 6
        and not set(held[:5]) & engine.eos_token_ids
        and held[5] in engine.eos_token_ids
    )


async def test_logit_bias_outside_the_vocabulary_is_refused(engine: EmbeddedEngine) -> None:
    vocab = engine.model.config.vocab_size
    with pytest.raises(InvalidRequestError) as err:
        await _generate(engine, "bad", [5, 6], logit_bias=((vocab, 1.0),))
    assert err.value.param == "logit_bias"
