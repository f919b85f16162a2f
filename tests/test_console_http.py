"""The operator console's HTTP contract, without a browser (fast).

A real gateway built by `build_service` on the tiny model (trainer off), with an
admin key and an agent key: login refuses a wrong key (401) and an agent's key
(403); the JSON reads need the session cookie; every action needs the CSRF token;
logout ends the session; the key never appears in what the console serves; an
open gateway (no keys) starts a session without a login; failed logins from one
address are limited (429 with `Retry-After`). The agents page pages, searches
and sorts 1,000 agents quickly; its rows carry requests and feedback per minute,
the recent reward and the engine replica, and sort by reward and by traffic. The
console's routes are in `/openapi.json`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import GatewayServer, serve_app

from clora_feedback.config import Settings
from clora_feedback.errors import OverloadedError
from clora_feedback.feedback.store import Incoming
from clora_feedback.gateway.console import live, views
from clora_feedback.gateway.console.sessions import COOKIE_NAME, LoginLimiter, SessionStore
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.schemas.feedback import Reward
from clora_feedback.service import Service, build_service

ADMIN = "sk-admin-console-4f1c"
AGENT = "sk-agent-console-9a2e"


def _settings(model_dir: Path, tmp_path: Path, **extra: object) -> Settings:
    return Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine={"model": str(model_dir), "max_model_len": 256, "num_threads": 1},  # type: ignore[arg-type]
        trainer={"enabled": False},  # type: ignore[arg-type]
        feedback={"kafka": {"embedded_broker": False}},  # type: ignore[arg-type]
        **extra,  # type: ignore[arg-type]
    )


def _publish(service: Service, agent: str, versions: int) -> None:
    limits = service.engine.lora_limits
    for v in range(1, versions + 1):
        service.registry.publish(
            agent,
            random_lora_weights(limits, rank=2, seed=v, target_modules=("q_proj",)),
            optimizer_state=None,
            base_model="tiny-base",
            parent=v - 1 or None,
            step=v,
            metrics={"loss": 1.0 / v, "reward_mean": 0.2 * v, "staleness_mean": 0.5},
            feedback_window={"samples": 4},
        )


@pytest.fixture(scope="module")
def keyed(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, GatewayServer]]:
    tmp = tmp_path_factory.mktemp("console")
    service = build_service(
        _settings(
            tiny_model_dir,
            tmp,
            admin_api_key=ADMIN,
            agents=[{"name": "support", "api_keys": [AGENT]}, {"name": "sales"}],
        )
    )
    _publish(service, "support", 2)
    with serve_app(service.app, service.engine) as gateway:
        yield service, gateway


def _reward(agent: str, completion_id: str, value: float) -> Incoming:
    event = Reward(
        event_id=f"e-{completion_id}", agent=agent, completion_id=completion_id, source="t",
        value=value,
    )  # fmt: skip
    return Incoming(event, "test")


def _login(http: httpx.Client, key: str = ADMIN) -> httpx.Response:
    return http.post("/console/api/login", json={"key": key})


def test_the_page_and_its_assets_ship_in_the_package(keyed: tuple[Service, GatewayServer]) -> None:
    _, gateway = keyed
    with gateway.http() as http:
        page = http.get("/console")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "http://" not in page.text and "https://" not in page.text  # no CDN
        for name in ("console.js", "console.css"):
            asset = http.get(f"/console/static/{name}")
            assert asset.status_code == 200 and asset.content
            assert "https://" not in asset.text
        script = http.get("/console/static/console.js").text
        assert "innerHTML" not in script and "insertAdjacentHTML" not in script
        assert http.get("/console/static/../__init__.py").status_code == 404
        assert http.get("/console/static/nope.js").json()["error"]["type"] == "not_found_error"


def test_login_refuses_a_wrong_key_and_an_agent_key(keyed: tuple[Service, GatewayServer]) -> None:
    _, gateway = keyed
    with gateway.http() as http:
        wrong = _login(http, "sk-wrong")
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        agent = _login(http, AGENT)
        assert agent.status_code == 403 and agent.json()["error"]["code"] == "admin_required"
        assert COOKIE_NAME not in http.cookies
        assert http.get("/console/api/agents").status_code == 401
        assert http.get("/console/api/session").status_code == 401
        # A bearer key is not a console session: the console reads only its cookie.
        bearer = http.get("/console/api/agents", headers={"Authorization": f"Bearer {ADMIN}"})
        assert bearer.status_code == 401
        assert bearer.json()["error"]["code"] == "console_login_required"


def test_login_sets_a_strict_httponly_cookie_and_hides_the_key(
    keyed: tuple[Service, GatewayServer],
) -> None:
    _, gateway = keyed
    with gateway.http() as http:
        response = _login(http)
        assert response.status_code == 200, response.text
        cookie = response.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
        assert ADMIN not in cookie and ADMIN not in response.text
        session = http.get("/console/api/session").json()
        assert session["csrf_token"] == response.json()["csrf_token"] and not session["open"]
        agents = http.get("/console/api/agents")
        assert agents.status_code == 200 and ADMIN not in agents.text
        names = [row["agent"] for row in agents.json()["data"]]
        assert names == ["sales", "support"]


def test_actions_need_the_csrf_token(keyed: tuple[Service, GatewayServer]) -> None:
    service, gateway = keyed
    with gateway.http() as http:
        token = _login(http).json()["csrf_token"]
        for path in ("pin", "unpin"):
            refused = http.post(f"/console/api/agents/support/{path}")
            assert refused.status_code == 403
            assert refused.json()["error"]["code"] == "csrf_token_invalid"
            forged = http.post(
                f"/console/api/agents/support/{path}", headers={"X-CSRF-Token": "forged"}
            )
            assert forged.status_code == 403
        missing = http.post("/console/api/agents/support/rollback", json={"version": 1})
        assert missing.status_code == 403
        assert service.registry.agent("support").active_version == 2
        headers = {"X-CSRF-Token": token}
        pinned = http.post("/console/api/agents/support/pin", headers=headers)
        assert pinned.status_code == 200 and service.registry.is_pinned("support")
        assert http.post("/console/api/agents/support/unpin", headers=headers).status_code == 200
        assert not service.registry.is_pinned("support")
        # Same answers as the admin route: already active is 409, unknown version 404.
        again = http.post(
            "/console/api/agents/support/rollback", json={"version": 2}, headers=headers
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_active"
        unknown = http.post(
            "/console/api/agents/support/rollback", json={"version": 9}, headers=headers
        )
        assert unknown.status_code == 404


def test_logout_ends_the_session(keyed: tuple[Service, GatewayServer]) -> None:
    _, gateway = keyed
    with gateway.http() as http:
        token = _login(http).json()["csrf_token"]
        old = http.cookies[COOKIE_NAME]
        assert http.post("/console/api/logout").status_code == 403  # CSRF here too
        out = http.post("/console/api/logout", headers={"X-CSRF-Token": token})
        assert out.status_code == 200
        assert http.get("/console/api/agents").status_code == 401
        # The old cookie replayed by hand is dead on the server, not only in the browser.
    with gateway.http(cookies={COOKIE_NAME: old}) as replay:
        assert replay.get("/console/api/agents").status_code == 401


def test_agent_detail_and_trajectories(
    keyed: tuple[Service, GatewayServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(views, "WINDOW_TTL_S", 0.0)  # read the window afresh
    _, gateway = keyed
    client = gateway.openai(api_key=ADMIN)
    client.chat.completions.create(
        model="support", messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    with gateway.http() as http:
        _login(http)
        detail = http.get("/console/api/agents/support").json()
        assert detail["active_version"] == 2 and detail["rewards"] == []
        assert detail["replica"] == "embedded" and detail["window_s"] == 300.0
        assert detail["requests_per_min"] >= 0.2 and detail["feedback_per_min"] == 0.0
        assert detail["reward_recent"] is None and detail["reward_judged"] == 0
        assert [v["version"] for v in detail["versions"]] == [1, 2]
        assert detail["versions"][1]["samples"] == 4 and detail["versions"][1]["loss"] == 0.5
        assert [e["kind"] for e in detail["timeline"]] == ["publish", "publish"]
        page = http.get("/console/api/agents/support/trajectories").json()
        assert page["show_text"] is False and "prompt" not in page["data"][0]
        assert page["data"][0]["adapter_version"] == 2 and page["data"][0]["feedback"] == []
        assert http.get("/console/api/agents/nobody").status_code == 404
        assert http.get("/console/api/agents?sort=bogus").status_code == 400


def test_an_open_gateway_needs_no_login(tiny_model_dir: Path, tmp_path: Path) -> None:
    service = build_service(_settings(tiny_model_dir, tmp_path, agents=[{"name": "support"}]))
    with serve_app(service.app, service.engine) as gateway, gateway.http() as http:
        session = http.get("/console/api/session")
        assert session.status_code == 200 and session.json()["open"] is True
        assert "HttpOnly" in session.headers["set-cookie"]
        assert http.get("/console/api/agents").json()["total"] == 1
        # Still no action without the token: another site's page cannot post here.
        assert http.post("/console/api/agents/support/pin").status_code == 403


def test_a_thousand_agents_page_fast(tiny_model_dir: Path, tmp_path: Path) -> None:
    service = build_service(_settings(tiny_model_dir, tmp_path, admin_api_key=ADMIN))
    for i in range(1000):
        service.registry.next_version(f"agent-{i:04d}")  # known to the registry, no files
    with serve_app(service.app, service.engine) as gateway, gateway.http() as http:
        _login(http)
        started = time.perf_counter()
        page = http.get("/console/api/agents", params={"offset": 975, "limit": 25}).json()
        elapsed = time.perf_counter() - started
        assert page["total"] == 1000 and len(page["data"]) == 25
        assert page["data"][-1]["agent"] == "agent-0999"
        found = http.get("/console/api/agents", params={"q": "0042"}).json()
        assert [r["agent"] for r in found["data"]] == ["agent-0042"]
        desc = http.get("/console/api/agents", params={"order": "desc", "limit": 1}).json()
        assert desc["data"][0]["agent"] == "agent-0999"
        assert elapsed < 2.0, f"a page of 1,000 agents took {elapsed:.2f} s"
        for sort in ("reward", "traffic"):
            started = time.perf_counter()
            params = {"sort": sort, "order": "desc", "offset": 500}
            sorted_page = http.get("/console/api/agents", params=params).json()
            elapsed = time.perf_counter() - started
            assert sorted_page["total"] == 1000 and len(sorted_page["data"]) == 25
            assert elapsed < 2.0, f"a page of 1,000 agents sorted by {sort} took {elapsed:.2f} s"


def test_rates_replica_and_the_sorts_by_reward_and_traffic(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = [{"name": "alpha"}, {"name": "beta"}, {"name": "gamma"}]
    service = build_service(_settings(tiny_model_dir, tmp_path, agents=agents))
    with serve_app(service.app, service.engine) as gateway, gateway.http() as http:
        client = gateway.openai(api_key="unused")
        served = {
            agent: [
                client.chat.completions.create(
                    model=agent, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                ).id
                for _ in range(n)
            ]
            for agent, n in (("alpha", 1), ("beta", 3))
        }
        deadline = time.monotonic() + 30
        while service.trajectories.store.count() < 4:  # written behind the responses
            assert time.monotonic() < deadline
            time.sleep(0.05)
        events = [
            _reward(agent, cid, value)
            for agent, value in (("alpha", 1.0), ("beta", -1.0))
            for cid in served[agent]
        ]
        assert len(service.feedback.apply(events).joined) == 4
        monkeypatch.setattr(views, "WINDOW_TTL_S", 3600.0)  # the first read serves until reset
        http.get("/console/api/session")

        def order(sort: str) -> list[str]:
            params = {"sort": sort, "order": "desc"}
            return [
                r["agent"] for r in http.get("/console/api/agents", params=params).json()["data"]
            ]

        assert order("traffic") == ["beta", "alpha", "gamma"]
        assert order("reward") == ["alpha", "beta", "gamma"]  # gamma: no reward, lowest
        rows = {r["agent"]: r for r in http.get("/console/api/agents").json()["data"]}
        assert rows["beta"]["requests_per_min"] == pytest.approx(3 * 60 / 300, abs=0.01)
        assert rows["beta"]["feedback_per_min"] == pytest.approx(3 * 60 / 300, abs=0.01)
        assert rows["beta"]["reward_judged"] == 3
        assert rows["alpha"]["reward_recent"] > rows["beta"]["reward_recent"]
        assert rows["gamma"]["requests_per_min"] == 0.0 and rows["gamma"]["reward_recent"] is None
        assert {r["replica"] for r in rows.values()} == {"embedded"}

        # One read of the window serves every page for `WINDOW_TTL_S`.
        client.chat.completions.create(
            model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        while service.trajectories.store.count() < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gamma = http.get("/console/api/agents/gamma").json()
        assert gamma["requests_per_min"] == 0.0  # the cached read
        monkeypatch.setattr(views, "WINDOW_TTL_S", 0.0)
        gamma = http.get("/console/api/agents/gamma").json()
        assert gamma["requests_per_min"] == pytest.approx(60 / 300, abs=0.01)


def test_failed_logins_are_limited_per_address(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = _settings(
        tiny_model_dir, tmp_path, admin_api_key=ADMIN, console={"login_failures_per_minute": 2}
    )
    service = build_service(settings)
    with serve_app(service.app, service.engine) as gateway, gateway.http() as http:
        assert _login(http, "sk-wrong-1").status_code == 401
        assert _login(http, AGENT).status_code == 401  # no agent key here: just wrong
        for key in ("sk-wrong-3", ADMIN):  # the right key too: not checked while limited
            refused = _login(http, key)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert error["code"] == "too_many_login_attempts"
            assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert COOKIE_NAME not in http.cookies


def test_the_login_limit_slides_and_a_success_clears_it() -> None:
    now = [100.0]
    limiter = LoginLimiter(2, window_s=60.0, max_addresses=2, clock=lambda: now[0])
    limiter.failed("a")
    now[0] += 30
    limiter.failed("a")
    with pytest.raises(OverloadedError) as exc:
        limiter.check("a")
    assert exc.value.retry_after_s == 30.0  # until the first failure is a minute old
    limiter.check("b")  # another address is not limited
    now[0] += 30
    limiter.check("a")  # the first failure left the window
    limiter.failed("a")
    with pytest.raises(OverloadedError):
        limiter.check("a")
    limiter.succeeded("a")
    limiter.check("a")
    for address in ("a", "b", "c"):  # bounded: the least recently failed is forgotten
        limiter.failed(address)
        limiter.failed(address)
    limiter.check("a")
    with pytest.raises(OverloadedError):
        limiter.check("c")


def test_sessions_expire() -> None:
    now = [1000.0]
    store = SessionStore(60.0, 2, clock=lambda: now[0])
    first = store.create()
    assert store.get(first.id) == first
    now[0] += 61
    with pytest.raises(Exception, match="log in"):
        store.get(first.id)
    a, b, c = store.create(), store.create(), store.create()
    assert len(store) == 2  # bounded: the oldest went first
    with pytest.raises(Exception, match="log in"):
        store.get(a.id)
    assert store.get(c.id) == c and store.get(b.id) == b


def test_the_console_routes_are_documented(keyed: tuple[Service, GatewayServer]) -> None:
    _, gateway = keyed
    with gateway.http() as http:
        paths = http.get("/openapi.json").json()["paths"]
    assert set(paths["/console/api/login"]["post"]["responses"]) >= {"200", "401", "403", "429"}
    assert "409" in paths["/console/api/agents/{agent}/rollback"]["post"]["responses"]
    assert "/console/api/events" in paths and "/console" in paths


def _events(http: httpx.Client, **headers: str) -> list[tuple[str, str, str]]:
    """(id, event, data) of every event of one response of the live feed (it ends by itself)."""
    out: list[tuple[str, str, str]] = []
    fields: dict[str, str] = {}
    with http.stream("GET", "/console/api/events", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                if "event" in fields:
                    out.append((fields.get("id", ""), fields["event"], fields.get("data", "")))
                fields = {}
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
    return out


def test_the_live_feed_pushes_changes_and_resumes(
    keyed: tuple[Service, GatewayServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live, "STREAM_S", 2.0)  # each response ends by itself, sooner
    service, gateway = keyed
    with gateway.http() as http:
        assert http.get("/console/api/events").status_code == 401
        _login(http)
        first = _events(http)
        assert first[0][1] == "ready" and json.loads(first[0][2]) == {"resumed": False}
        last_id = first[-1][0]
        resumed = _events(http, **{"Last-Event-ID": last_id})
        assert json.loads(resumed[0][2]) == {"resumed": True}  # nothing changed meanwhile

        def publish_soon() -> None:
            time.sleep(0.5)
            active = service.registry.agent("support").active_version
            service.registry.publish(
                "support",
                random_lora_weights(
                    service.engine.lora_limits, rank=2, seed=99, target_modules=("q_proj",)
                ),
                optimizer_state=None,
                base_model="tiny-base",
                parent=active,
                step=99,
                metrics={"loss": 0.1},
                feedback_window=None,
            )

        publisher = threading.Thread(target=publish_soon)
        publisher.start()
        pushed = _events(http, **{"Last-Event-ID": last_id})
        publisher.join()
        changed = [json.loads(data) for _, event, data in pushed if event == "agents"]
        assert changed and changed[0]["changed"][0]["agent"] == "support"
        assert (
            changed[0]["changed"][0]["num_versions"]
            == service.registry.agent("support").num_versions
        )
        again = _events(http, **{"Last-Event-ID": last_id})
        assert json.loads(again[0][2]) == {"resumed": False}  # the page must reread
