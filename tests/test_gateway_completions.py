"""`/v1/completions` (legacy text completion) through the official openai client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conftest import GatewayServer


def clora(obj: Any) -> dict[str, Any]:
    extension: dict[str, Any] = obj.model_extra["clora"]
    return extension


def test_text_prompt(module_gateway: GatewayServer) -> None:
    reply = module_gateway.openai().completions.create(
        model="support", prompt="Once upon", max_tokens=7, seed=2
    )
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    tokenizer = module_gateway.engine.tokenizer
    assert clora(reply)["prompt_token_ids"] == tokenizer.encode("Once upon")
    [choice] = reply.choices
    ids = clora(choice)["token_ids"]
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert reply.usage is not None and reply.usage.completion_tokens == len(ids) <= 7
    assert choice.finish_reason in ("stop", "length")


def test_default_max_tokens_is_16(module_gateway: GatewayServer) -> None:
    reply = module_gateway.openai().completions.create(model="support", prompt="abc", temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens <= 16
    if reply.choices[0].finish_reason == "length":
        assert reply.usage.completion_tokens == 16


def test_token_id_prompt_is_used_as_is(module_gateway: GatewayServer) -> None:
    ids = [100, 101, 102, 103]
    reply = module_gateway.openai().completions.create(
        model="tiny-base", prompt=ids, max_tokens=3, temperature=0
    )
    assert clora(reply)["prompt_token_ids"] == ids
    assert reply.usage is not None and reply.usage.prompt_tokens == 4


def test_stream_and_logprobs(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    kwargs: dict[str, Any] = {
        "model": "sales",
        "prompt": "The",
        "max_tokens": 6,
        "seed": 11,
        "logprobs": 2,
    }
    whole = client.completions.create(**kwargs)
    lp = whole.choices[0].logprobs
    ids = clora(whole.choices[0])["token_ids"]
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids)
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [t for c in chunks if c.choices for t in clora(c.choices[0])["token_ids"]] == ids
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)
    with module_gateway.http() as http:
        record = http.get(f"/v1/trajectories/{chunks[0].id}").json()
    assert record["kind"] == "completion" and record["samples"][0]["completion_token_ids"] == ids
