"""Sampling controls on the wire: seeds, penalties, `logit_bias` and vLLM's `top_k`,
`min_tokens`, `ignore_eos`, through a real gateway on both completion endpoints.

Bad values are 400s naming the parameter (never a 5xx); good ones change the
output as OpenAI/vLLM define. The official client sends the vLLM extensions in
`extra_body`, as vLLM's own docs show.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web
from transformers import AutoTokenizer
from vllm_stand_in import serve, start_up_answer

from clora_feedback.config import EngineConfig
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.engine.vllm import VLLMEngine
from clora_feedback.errors import InvalidRequestError

if TYPE_CHECKING:
    from conftest import GatewayServer

HI = [{"role": "user", "content": "hello there"}]
ROUTES = {
    "/v1/chat/completions": {"model": "support", "messages": HI, "max_tokens": 4},
    "/v1/completions": {"model": "support", "prompt": "Once upon", "max_tokens": 4},
}


def _post(gateway: GatewayServer, route: str, **fields: Any) -> Any:
    with gateway.http() as http:
        return http.post(route, json={**ROUTES[route], **fields})


def _token_ids(body: dict[str, Any], index: int = 0) -> list[int]:
    ids: list[int] = body["choices"][index]["clora"]["token_ids"]
    return ids


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 10**30}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"999999": 1.0}}, "logit_bias"),  # beyond the vocabulary
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens (4)
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_sampling_values_are_400s_naming_the_parameter(
    module_gateway: GatewayServer, route: str, fields: dict[str, Any], param: str
) -> None:
    response = _post(module_gateway, route, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_64_bit_seed_works_and_choice_seeds_wrap(
    module_gateway: GatewayServer, route: str
) -> None:
    sampled = {"temperature": 1.0, "max_tokens": 6}
    top = _post(module_gateway, route, seed=2**64 - 1, n=2, **sampled)
    assert top.status_code == 200, top.text
    # Choice i is seeded (seed + i) mod 2**64: 2**64 - 1 is -1's pattern, its second choice 0.
    minus_one = _post(module_gateway, route, seed=-1, **sampled).json()
    zero = _post(module_gateway, route, seed=0, **sampled).json()
    assert _token_ids(top.json(), 0) == _token_ids(minus_one)
    assert _token_ids(top.json(), 1) == _token_ids(zero)
    lowest = _post(module_gateway, route, seed=-(2**63), n=2, **sampled)
    assert lowest.status_code == 200, lowest.text


def test_logit_bias_forces_and_bans_tokens(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    [a] = module_gateway.engine.tokenizer.encode("a")
    forced = client.completions.create(
        model="support", prompt="Once upon", max_tokens=5, temperature=0, logit_bias={str(a): 100}
    )
    assert forced.choices[0].text == "aaaaa"
    chat = client.chat.completions.create(
        model="support",
        messages=HI,
        max_tokens=3,
        temperature=0.9,
        seed=1,
        logit_bias={str(a): 100},
    )
    assert chat.choices[0].message.content == "aaa"
    plain = client.completions.create(model="support", prompt="abc", max_tokens=1, temperature=0)
    first = plain.choices[0].model_extra["clora"]["token_ids"][0]
    banned = client.completions.create(
        model="support", prompt="abc", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].model_extra["clora"]["token_ids"] != [first]


def test_penalties_change_a_repeating_greedy_output(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    greedy = {"model": "support", "prompt": "Once upon", "max_tokens": 24, "temperature": 0}
    ignore_eos = {"ignore_eos": True}
    plain = client.completions.create(**greedy, extra_body=ignore_eos)
    penalized = client.completions.create(**greedy, frequency_penalty=2.0, extra_body=ignore_eos)
    present = client.completions.create(**greedy, presence_penalty=2.0, extra_body=ignore_eos)

    def distinct(reply: Any) -> int:
        return len(set(reply.choices[0].model_extra["clora"]["token_ids"]))

    assert distinct(penalized) > distinct(plain) and distinct(present) > distinct(plain)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_vllm_extensions_are_honoured(module_gateway: GatewayServer, route: str) -> None:
    eos = min(module_gateway.engine.eos_token_ids)
    force_eos = {"logit_bias": {str(eos): 100}, "temperature": 0, "max_tokens": 8}
    early = _post(module_gateway, route, **force_eos).json()
    assert _token_ids(early) == [eos]
    held = _post(module_gateway, route, min_tokens=3, **force_eos).json()
    assert len(_token_ids(held)) == 4 and _token_ids(held)[3] == eos
    past = _post(module_gateway, route, ignore_eos=True, **force_eos).json()
    assert _token_ids(past) == [eos] * 8 and past["choices"][0]["finish_reason"] == "length"
    greedy = _post(module_gateway, route, temperature=0, max_tokens=8, ignore_eos=True).json()
    top1 = _post(
        module_gateway, route, temperature=1.0, seed=5, top_k=1, max_tokens=8, ignore_eos=True
    ).json()
    assert _token_ids(top1) == _token_ids(greedy)


# ---------------------------------------------------------------- the vLLM engine's request body


async def test_the_vllm_body_carries_every_control_in_vllms_ranges(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    async def start_up(request: web.Request) -> web.Response:  # a vLLM server's start-up answers
        answer = await start_up_answer(request, tokenizer)
        assert answer is not None, request.path
        return answer

    async with serve(start_up) as url:
        config = EngineConfig(kind="vllm", vllm={"urls": [url]})  # type: ignore[arg-type]
        engine = VLLMEngine(tiny_model_dir, config, model_name="t")
        await engine.start()
        try:
            sp = SamplingParams(
                max_tokens=8,
                seed=2**64 - 1,
                top_k=5,
                min_tokens=2,
                presence_penalty=0.5,
                frequency_penalty=-0.25,
                logit_bias=((3, 100.0), (7, -1.5)),
                ignore_eos=True,
            )
            body = engine.completion_body(GenerationRequest("r", None, [5, 6], sp))
            # vLLM's seed is signed 64-bit and -1 means "unseeded": the top bit is dropped.
            assert body["seed"] == 2**63 - 1
            assert (body["top_k"], body["min_tokens"], body["ignore_eos"]) == (5, 2, True)
            assert (body["presence_penalty"], body["frequency_penalty"]) == (0.5, -0.25)
            assert body["logit_bias"] == {"3": 100.0, "7": -1.5}
            plain = engine.completion_body(
                GenerationRequest("p", None, [5, 6], SamplingParams(seed=0))
            )
            assert plain["seed"] == 0 and not {"top_k", "logit_bias", "min_tokens"} & set(plain)
            with pytest.raises(InvalidRequestError) as err:
                engine.completion_body(
                    GenerationRequest("v", None, [5], SamplingParams(logit_bias=((10**6, 1.0),)))
                )
            assert err.value.param == "logit_bias"
        finally:
            await engine.stop()
