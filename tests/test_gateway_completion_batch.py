"""`POST /v1/completions` with a list of prompts, as OpenAI and vLLM serve it (issue 25 item 8).

Choices are indexed prompt by prompt (`n` each); every prompt is its own
trajectory, named by its choices' `clora.completion_id`; all prompts' sequences
are submitted together, so they share the engine's steps; a prompt's seeded
answers do not depend on the prompts beside it. Through the official `openai`
client and LangChain's `OpenAI(...).batch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from conftest import GatewayServer

PROMPTS = ["Once upon a time", "The capital of France", "def add(a, b):"]


def _extension(obj: Any) -> dict[str, Any]:
    extension: dict[str, Any] = obj.model_extra["clora"]
    return extension


def _trajectory(gateway: GatewayServer, completion_id: str) -> dict[str, Any]:
    response = httpx.get(f"{gateway.url}/v1/trajectories/{completion_id}", timeout=10)
    assert response.status_code == 200, response.text
    record: dict[str, Any] = response.json()
    return record


def test_choices_are_indexed_prompt_by_prompt(module_gateway: GatewayServer) -> None:
    reply = module_gateway.openai().completions.create(
        model="support", prompt=PROMPTS, n=2, max_tokens=4, seed=11
    )
    assert [c.index for c in reply.choices] == list(range(6))
    assert "prompt_token_ids" not in _extension(reply)  # one per trajectory instead
    tokenizer = module_gateway.engine.tokenizer
    for p, prompt in enumerate(PROMPTS):
        pair = reply.choices[2 * p : 2 * p + 2]
        ids = {_extension(c)["completion_id"] for c in pair}
        assert ids == {f"{reply.id}-p{p}"}
        record = _trajectory(module_gateway, f"{reply.id}-p{p}")
        assert record["prompt_token_ids"] == tokenizer.encode(prompt)
        assert record["request"]["prompt"] == prompt
        assert [s["index"] for s in record["samples"]] == [0, 1]
        assert [s["completion_token_ids"] for s in record["samples"]] == [
            _extension(c)["token_ids"] for c in pair
        ]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)


def test_a_prompts_answers_do_not_depend_on_its_neighbours(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    batch = client.completions.create(model="support", prompt=PROMPTS, n=2, max_tokens=5, seed=3)
    alone = client.completions.create(model="support", prompt=PROMPTS[1], n=2, max_tokens=5, seed=3)
    assert [c.text for c in batch.choices[2:4]] == [c.text for c in alone.choices]
    assert "completion_id" not in _extension(alone.choices[0])  # one prompt: the response id
    assert _trajectory(module_gateway, alone.id)["request"]["prompt"] == PROMPTS[1]


def test_token_id_prompts_and_streaming(module_gateway: GatewayServer) -> None:
    stream = module_gateway.openai().completions.create(
        model="support", prompt=[[100, 101, 102], [103, 104]], max_tokens=3, stream=True
    )
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1}
    record = _trajectory(module_gateway, f"{chunk.id}-p1")
    assert record["prompt_token_ids"] == [103, 104]
    assert record["samples"][0]["text"] == texts[1]


def test_all_prompts_share_the_engine_steps(module_gateway: GatewayServer) -> None:
    """Submitted together, three one-token completions take the steps one takes."""

    def steps() -> int:
        health = httpx.get(f"{module_gateway.url}/health", timeout=10).json()
        return int(health["engine"]["steps"])

    client = module_gateway.openai()
    before = steps()
    client.completions.create(model="support", prompt=PROMPTS[0], max_tokens=1)
    one = steps() - before
    before = steps()
    client.completions.create(model="support", prompt=PROMPTS, max_tokens=1)
    assert steps() - before == one


def test_langchain_batch_is_one_request(module_gateway: GatewayServer) -> None:
    from langchain_openai import OpenAI

    llm = OpenAI(
        base_url=module_gateway.base_url,
        api_key="unused",  # type: ignore[arg-type]
        model="support",
        max_tokens=3,
        temperature=0,
        max_retries=0,
    )
    answers = llm.batch(PROMPTS)
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
    listed = httpx.get(
        f"{module_gateway.url}/v1/trajectories", params={"agent": "support", "limit": 3}
    ).json()["data"]
    ids = sorted(r["id"] for r in listed)
    stem = ids[0].rsplit("-p", 1)[0]
    assert ids == [f"{stem}-p{p}" for p in range(3)]
    assert [r["samples"][0]["text"] for r in sorted(listed, key=lambda r: r["id"])] == answers


def test_the_quickstarts_langchain_batch_snippet(module_gateway: GatewayServer) -> None:
    from test_clients_thirdparty import run_snippet

    namespace = run_snippet("langchain-batch", module_gateway)
    answers = namespace["answers"]
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)


def test_a_request_larger_than_the_engine_is_a_400(module_gateway: GatewayServer) -> None:
    """64 prompts x n=16 can never fit the engine's queue: a 400 naming n, not a 429."""
    response = httpx.post(
        f"{module_gateway.url}/v1/completions",
        json={"model": "support", "prompt": ["hi"] * 64, "n": 16, "max_tokens": 1},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"
