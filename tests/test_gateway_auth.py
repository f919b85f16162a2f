"""API keys: 401 without a valid key, 403 for admin routes, 404 for another agent's
model (exactly as for an unknown one) and trajectories; /metrics needs the admin key;
open access when no key is configured."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    # Another key's model is as unknown as a name nobody serves (issue 12 item 4).
    with pytest.raises(NotFoundError):
        support.check_model("sales", "sales")
    with pytest.raises(NotFoundError):
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
        with pytest.raises(openai.NotFoundError) as info:
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


def test_another_keys_model_is_as_unknown_as_a_missing_one(keyed: GatewayServer) -> None:
    """Tenant A cannot tell B's agent names from names nobody serves (issue 12 item 4)."""
    errors: list[dict[str, Any]] = []
    with keyed.http(headers={"Authorization": f"Bearer {SUPPORT}"}) as http:
        for model in ("sales", "tiny-base", "no-such-agent"):
            for path, body in (
                ("/v1/chat/completions", {"model": model, "messages": HI}),
                ("/v1/completions", {"model": model, "prompt": "hi"}),
                (f"/v1/models/{model}", None),
            ):
                response = http.request("GET" if body is None else "POST", path, json=body)
                assert response.status_code == 404, (path, response.text)
                error = response.json()["error"]
                # Same words but the name: nothing says whether the model exists.
                errors.append({**error, "message": error["message"].replace(model, "<m>")})
    routes = 3
    for i, error in enumerate(errors):
        assert error == errors[i % routes], error
        assert (error["type"], error["param"], error["code"]) == (
            "not_found_error",
            "model",
            "model_not_found",
        )


def test_metrics_need_the_admin_key_when_keys_are_configured(keyed: GatewayServer) -> None:
    with keyed.http() as http:
        anonymous = http.get("/metrics")
        agent = http.get("/metrics", headers={"Authorization": f"Bearer {SUPPORT}"})
        admin = http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    assert agent.status_code == 403 and "sales" not in agent.text
    assert admin.status_code == 200 and "clora_http_requests_total" in admin.text


def test_metrics_stay_open_without_keys(module_gateway: GatewayServer) -> None:
    with module_gateway.http() as http:
        assert http.get("/metrics").status_code == 200


def test_no_key_reaches_a_store(keyed: GatewayServer) -> None:
    """Whatever is stored (trajectories, registry, feedback) holds an agent name, never a
    key or a hash of one."""
    support = keyed.openai(api_key=SUPPORT)
    reply = support.chat.completions.create(model="support", messages=HI, max_tokens=2)
    support.completions.create(model="support", prompt="hi", max_tokens=2)
    with keyed.http(headers={"Authorization": f"Bearer {SUPPORT}"}) as http:
        stored = http.get(f"/v1/trajectories/{reply.id}").json()
    assert stored["api_key_agent"] == "support"
    data_dir = Path(keyed.app.state.gateway.store.path).parent
    files = [p for p in data_dir.rglob("*") if p.is_file()]
    assert files
    for key in (SUPPORT, ADMIN):
        forms = [
            key,
            hashlib.sha256(key.encode()).hexdigest(),
            hashlib.md5(key.encode()).hexdigest(),
        ]
        for path in files:
            content = path.read_bytes()
            for form in forms:
                assert form.encode() not in content, (path, form)
