"""A declared agent before its first version: one answer on every route (issue 25 item 6).

An agent named in the config without an adapter is served by the base model until
training publishes version 1. `/v1/models` lists it at adapter version 0; the admin
routes list it too, with no active version and an empty version list, instead of
leaving it out of `GET /v1/adapters` and answering 404 for its versions. An agent
nobody declared is still a 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import GatewayServer, serve_app

from clora_feedback.config import Settings
from clora_feedback.service import build_service

ADMIN = {"Authorization": "Bearer sk-admin-declared"}


@pytest.fixture(scope="module")
def gateway(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayServer]:
    tmp = tmp_path_factory.mktemp("declared")
    settings = Settings(
        data_dir=tmp / "var",
        adapters_dir=tmp / "adapters",
        engine={"model": str(tiny_model_dir), "max_model_len": 256, "num_threads": 1},  # type: ignore[arg-type]
        agents=[{"name": "fresh"}, {"name": "newer"}],  # type: ignore[list-item]
        admin_api_key="sk-admin-declared",
        trainer={"enabled": False},  # type: ignore[arg-type]
        feedback={"kafka": {"embedded_broker": False}},  # type: ignore[arg-type]
    )
    service = build_service(settings)
    with serve_app(service.app, service.engine) as served:
        yield served


def _get(gateway: GatewayServer, path: str) -> httpx.Response:
    return httpx.get(f"{gateway.url}{path}", headers=ADMIN, timeout=10)


def test_models_adapters_and_versions_agree(gateway: GatewayServer) -> None:
    models = {m["id"]: m["clora"] for m in _get(gateway, "/v1/models").json()["data"]}
    assert models["fresh"] == {"agent": "fresh", "adapter_version": 0}

    listed = {a["agent"]: a for a in _get(gateway, "/v1/adapters").json()["data"]}
    assert set(listed) >= {"fresh", "newer"}
    assert listed["fresh"] == {
        "object": "adapter.agent",
        "agent": "fresh",
        "active_version": None,
        "pinned": False,
        "num_versions": 0,
        "latest_version": None,
        "activated_by": None,
        "activated_at": None,
    }

    versions = _get(gateway, "/v1/adapters/fresh/versions")
    assert versions.status_code == 200, versions.text
    assert versions.json() == {
        "object": "list",
        "agent": "fresh",
        "active_version": None,
        "pinned": False,
        "data": [],
    }


def test_an_agent_nobody_declared_is_still_unknown(gateway: GatewayServer) -> None:
    response = _get(gateway, "/v1/adapters/nobody/versions")
    assert response.status_code == 404
    assert "nobody" not in {a["agent"] for a in _get(gateway, "/v1/adapters").json()["data"]}
