"""API keys: 401 without a valid key, 403 for another agent's model or admin routes,
404 for another agent's trajectories; open access when no key is configured."""

from __future__ import annotations

from typing import TYPE_CHECKING

import openai
import pytest

from clora_feedback.config import AgentConfig, Settings
from clora_feedback.errors import AuthenticationError, NotFoundError, PermissionDeniedError
from clora_feedback.gateway.auth import OPEN_ACCESS, KeyAuthenticator, Principal

if TYPE_CHECKING:
    from conftest import GatewayFactory, GatewayServer

HI = [{"role": "user", "content": "hi"}]
ADMIN = "sk-admin"
SUPPORT = "sk-support"
SALES = "sk-sales"
SHARED = "sk-shared"


def keyed_settings() -> Settings:
    return Settings(
        admin_api_key=ADMIN,
        agents=[
            AgentConfig(name="support", api_keys=[SUPPORT, SHARED]),
            AgentConfig(name="sales", api_keys=[SALES, SHARED]),
        ],
    )


def test_open_when_no_keys_are_configured() -> None:
    auth = KeyAuthenticator(Settings(agents=[AgentConfig(name="a")]))
    assert auth.authenticate(None) is OPEN_ACCESS
    assert auth.authenticate("Bearer anything") is OPEN_ACCESS


def test_key_table() -> None:
    auth = KeyAuthenticator(keyed_settings())
    assert auth.authenticate(f"Bearer {ADMIN}").admin
    assert auth.authenticate(f"Bearer {SUPPORT}") == Principal(
        admin=False, agents=frozenset({"support"})
    )
    assert auth.authenticate(f"bearer {SHARED}").agents == frozenset({"support", "sales"})
    for header in (None, "", "Bearer", f"Basic {ADMIN}", "Bearer sk-unknown"):
        with pytest.raises(AuthenticationError):
            auth.authenticate(header)


def test_principal_rules() -> None:
    support = Principal(admin=False, agents=frozenset({"support"}))
    support.check_model("support", "support")
    with pytest.raises(PermissionDeniedError):
        support.check_model("sales", "sales")
    with pytest.raises(PermissionDeniedError):
        support.check_model("base", None)  # the bare base model is for admins
    with pytest.raises(PermissionDeniedError):
        support.check_admin()
    with pytest.raises(NotFoundError):
        support.check_trajectory("sales", "chatcmpl-x")
    support.check_trajectory("support", "chatcmpl-x")
    Principal(admin=True).check_model("base", None)


@pytest.fixture
def keyed(start_gateway: GatewayFactory) -> GatewayServer:
    settings = keyed_settings()
    return start_gateway(
        admin_api_key=settings.admin_api_key,
        agents=[a.model_dump(mode="json") for a in settings.agents],
    )


def test_http_authentication_and_permissions(keyed: GatewayServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        keyed.openai(api_key="sk-wrong").chat.completions.create(
            model="support", messages=HI, max_tokens=1
        )
    with keyed.http() as http:
        no_key = http.post("/v1/chat/completions", json={"model": "support", "messages": HI})
        assert (
            no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
        )
        # Authentication is checked before the body.
        assert http.post("/v1/chat/completions", json={}).status_code == 401
        assert http.get("/health").status_code == 200  # operations routes need no key

    support = keyed.openai(api_key=SUPPORT)
    reply = support.chat.completions.create(model="support", messages=HI, max_tokens=2)
    for model in ("sales", "tiny-base"):
        with pytest.raises(openai.PermissionDeniedError) as info:
            support.chat.completions.create(model=model, messages=HI, max_tokens=1)
        assert info.value.param == "model"
    assert [m.id for m in support.models.list()] == ["support"]
    assert {m.id for m in keyed.openai(api_key=ADMIN).models.list()} == {
        "tiny-base",
        "support",
        "sales",
    }

    with keyed.http(headers={"Authorization": f"Bearer {SUPPORT}"}) as http:
        denied = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"}
        )
        assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
        assert (
            http.post("/v1/unload_lora_adapter", json={"lora_name": "support"}).status_code == 403
        )
        assert http.get(f"/v1/trajectories/{reply.id}").status_code == 200


def test_trajectories_are_scoped_by_key(keyed: GatewayServer) -> None:
    support_reply = keyed.openai(api_key=SUPPORT).chat.completions.create(
        model="support", messages=HI, max_tokens=2
    )
    sales_reply = keyed.openai(api_key=SALES).chat.completions.create(
        model="sales", messages=HI, max_tokens=2
    )
    base_reply = keyed.openai(api_key=ADMIN).chat.completions.create(
        model="tiny-base", messages=HI, max_tokens=2
    )

    with keyed.http(headers={"Authorization": f"Bearer {SUPPORT}"}) as http:
        own = http.get(f"/v1/trajectories/{support_reply.id}").json()
        assert own["agent"] == "support" and own["api_key_agent"] == "support"
        for other in (sales_reply.id, base_reply.id):
            hidden = http.get(f"/v1/trajectories/{other}")
            assert hidden.status_code == 404  # indistinguishable from a missing id
        listed = http.get("/v1/trajectories").json()["data"]
        assert [r["id"] for r in listed] == [support_reply.id]
        assert http.get("/v1/trajectories", params={"agent": "sales"}).status_code == 403

    with keyed.http(headers={"Authorization": f"Bearer {SHARED}"}) as http:
        both = [r["id"] for r in http.get("/v1/trajectories").json()["data"]]
        assert both == [sales_reply.id, support_reply.id]

    with keyed.http(headers={"Authorization": f"Bearer {ADMIN}"}) as http:
        everything = [r["id"] for r in http.get("/v1/trajectories").json()["data"]]
        assert everything == [base_reply.id, sales_reply.id, support_reply.id]
        assert http.get(f"/v1/trajectories/{sales_reply.id}").json()["api_key_agent"] == "sales"
        assert http.get(f"/v1/trajectories/{base_reply.id}").json()["agent"] == "tiny-base"
