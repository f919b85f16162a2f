"""The release path as `clora serve` wires it, on the tiny model: trainer versions are candidates
that serve nothing, the gate judges them on held-out feedback, a passing one canaries on a sticky
share of requests (the arm recorded in each reply's versions), and live rewards promote it; the
versions route shows every state, `/metrics` counts the verdicts, operators promote over HTTP and
the CLI, and a restart mid-canary routes the same arm."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import serve_app, wait_for
from release_support import release_settings, sticky_replies

from clora_feedback.cli.adapters import add_adapters_parser
from clora_feedback.client import FeedbackClient
from clora_feedback.config import AgentConfig, EngineConfig, Settings
from clora_feedback.service import build_service


def _settings(model_dir: Path, tmp_path: Path) -> Settings:
    engine = EngineConfig(model=str(model_dir), max_model_len=512, num_threads=1, max_num_seqs=4)
    return release_settings(tmp_path, engine, AgentConfig(name="support"))


def _cli(url: str, *argv: str) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    add_adapters_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["adapters", *argv, "--url", url])
    return int(args.func(args))


@pytest.mark.slow
def test_candidates_are_gated_canaried_and_promoted(tiny_model_dir: Path, tmp_path: Path) -> None:
    service = build_service(_settings(tiny_model_dir, tmp_path))
    assert service.release is not None
    with serve_app(service.app, None) as gw:
        client, http = gw.openai(), httpx.Client(base_url=gw.url, timeout=60)
        ids = []
        for i in range(12):
            reply = client.chat.completions.create(
                model="support", messages=[{"role": "user", "content": f"ticket {i}"}], max_tokens=4
            )
            ids.append(reply.id)
        with FeedbackClient(gw.url) as feedback:
            for i, cid in enumerate(ids):
                feedback.correction("support", completion_id=cid, corrected_content=f"team {i % 3}")
        # Candidates serve nothing until the release path promotes one.
        wait_for(
            lambda: service.registry.versions("support") if _known(service) else False, timeout=120
        )
        assert service.deployer.serving("support") is None
        wait_for(lambda: bool(service.release.canaries()), timeout=120)
        versions = http.get("/v1/adapters/support/versions").json()["data"]
        states = {v["version"]: (v["release"] or {}).get("state") for v in versions}
        assert "canary" in states.values(), states
        assert "passed" not in states.values()  # a pass became the canary
        canary = service.release.canaries()["support"]
        served: dict[int, list[str]] = {}  # live traffic on both arms, sticky by conversation
        for c, reply in sticky_replies(client):
            versions_ = reply.choices[0].model_extra["clora"]["token_versions"]
            served.setdefault(c, []).append(str(reply.model_extra["clora"]["adapter_version"]))
            assert set(map(str, versions_)) <= {served[c][-1]}  # every token: that arm
        assert all(len(set(v)) == 1 for v in served.values()), served  # sticky
        assert {str(canary[0]), "0"} <= {v[0] for v in served.values()}  # both arms served
        assert _cli(gw.url, "promote", "support", "--reason", "looks good") == 0
        assert service.release.canaries() == {}
        assert _promoted(http) and service.deployer.serving("support") == canary[0]
        assert service.deployer.serving("support") is not None
        metrics = http.get("/metrics").text
        assert 'clora_release_verdicts_total{stage="gate",verdict="passed"}' in metrics
        # An abort with no canary running: 404 over HTTP, exit 1 from the CLI.
        refused = http.post("/v1/adapters/nobody/abort", json={})
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "no_canary"
        assert _cli(gw.url, "abort", "nobody") == 1
        assert _cli(gw.url, "versions", "support") == 0


def _known(service: object) -> bool:
    return any(a.agent == "support" for a in service.registry.agents())  # type: ignore[attr-defined]


def _promoted(http: httpx.Client) -> bool:
    versions = http.get("/v1/adapters/support/versions").json().get("data", [])
    return any((v.get("release") or {}).get("state") == "promoted" for v in versions)
