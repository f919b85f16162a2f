"""The operator console in a real browser: Debian's chromium driven by Playwright (slow).

One gateway built by `build_service` on the tiny model, with the trainer on: six
completions get feedback through the webhook and the trainer publishes
versions 1 and 2 from it. The browser logs in with the admin key, sees the
agent on the agents page with its request and feedback rates, recent reward and
engine replica, sorts by traffic and by reward, opens it, finds one chart point per reward, rolls
back (the page and `GET /v1/adapters` both say v1), sees a rollback made
elsewhere arrive over the live feed without a reload, pins and unpins, and
shows a prompt holding `<script>` as text. Screenshots of both pages go to
tmp_path, or to `docs/` with `CLORA_CONSOLE_SCREENSHOTS=docs`.

Playwright cannot download a browser here: the test launches the system's
`/usr/bin/chromium` (scripts/install.sh --test installs it). Without it the test
is skipped, except in CI (`CI=true`), where it fails.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import GatewayServer, serve_app

from clora_feedback.client import FeedbackClient
from clora_feedback.config import Settings
from clora_feedback.service import Service, build_service

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ADMIN = "sk-admin-browser-77d1"
XSS_PROMPT = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
DOCS = Path(__file__).resolve().parent.parent / "docs"

pytestmark = pytest.mark.slow


def _missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing; CI must run the browser tests (scripts/install.sh --test)")
    pytest.skip(f"{what} is missing (scripts/install.sh --test installs it)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        _missing(str(CHROMIUM))
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright (pip install -e '.[dev]')")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _wait(predicate: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _settings(model_dir: Path, tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine={"model": str(model_dir), "max_model_len": 512, "num_threads": 1},  # type: ignore[arg-type]
        agents=[{"name": "support"}, {"name": "sales"}],  # type: ignore[list-item]
        admin_api_key=ADMIN,
        trainer={  # type: ignore[arg-type]
            "admission": {"min_batch": 4},
            "poll_interval_s": 0.1,
            "lr": 1e-2,
        },
        release={"enabled": False},  # type: ignore[arg-type]  # each trained version serves at once
        feedback={"kafka": {"embedded_broker": False}},  # type: ignore[arg-type]
        console={"show_text": True, "poll_interval_s": 0.3},  # type: ignore[arg-type]
    )


def _train_one_version(
    gateway: GatewayServer, service: Service, prompts: list[str], rewards: list[float], version: int
) -> None:
    client = gateway.openai(api_key=ADMIN)
    ids = [
        client.chat.completions.create(
            model="support", messages=[{"role": "user", "content": p}], max_tokens=6
        ).id
        for p in prompts
    ]
    with FeedbackClient(gateway.url, api_key=ADMIN) as feedback:
        for completion_id, value in zip(ids, rewards, strict=True):
            feedback.reward("support", value, completion_id=completion_id)
    _wait(lambda: any(a.active_version == version for a in service.registry.agents()))


ROUNDS = [  # rewards per round of four completions: each round trains one version
    [0.10, 0.30, 0.20, 0.25],
    [0.30, 0.40, 0.35, 0.45],
    [0.50, 0.45, 0.60, 0.55],
    [0.70, 0.65, 0.80, 0.75],
    [0.85, 0.90, 0.80, 0.95],
]


@pytest.fixture(scope="module")
def trained(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, GatewayServer]]:
    service = build_service(_settings(tiny_model_dir, tmp_path_factory.mktemp("browser")))
    with serve_app(service.app, service.engine) as gateway:
        for version, rewards in enumerate(ROUNDS, start=1):
            prompts = [f"ticket {version}.{i}" for i in range(len(rewards))]
            if version == len(ROUNDS):
                prompts[0] = XSS_PROMPT
            _train_one_version(gateway, service, prompts, rewards, version)
            time.sleep(0.5)  # spread the rounds on the chart's time axis
        yield service, gateway


def _shots(tmp_path: Path) -> Path:
    return DOCS if os.environ.get("CLORA_CONSOLE_SCREENSHOTS") == "docs" else tmp_path


def _login(page: Any, gateway: GatewayServer) -> None:
    page.goto(f"{gateway.url}/console")
    page.get_by_label("Admin API key").fill(ADMIN)
    page.keyboard.press("Enter")  # the form submits from the keyboard
    page.wait_for_selector("#agents-table tbody tr[data-agent='support']")


def test_the_console_in_a_browser(
    browser: Any, trained: tuple[Service, GatewayServer], tmp_path: Path
) -> None:
    service, gateway = trained
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    shots = _shots(tmp_path)

    # Wrong key first: refused on the page, nothing shown.
    page.goto(f"{gateway.url}/console")
    page.get_by_label("Admin API key").fill("sk-wrong")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_selector("#login-error:text('Wrong key.')")
    assert ADMIN not in page.content()

    _login(page, gateway)
    assert "key" not in page.url and ADMIN not in page.url and ADMIN not in page.content()
    last = len(ROUNDS)
    row = page.locator("#agents-table tbody tr[data-agent='support']")
    assert row.locator(".serving").inner_text() == f"v{last}"
    assert row.locator("svg.spark polyline").count() == 1
    sales = page.locator("#agents-table tbody tr[data-agent='sales']")
    assert "no feedback yet" in sales.inner_text()
    assert row.locator(".replica").inner_text() == "embedded"
    requests_rate = float(row.locator(".requests").inner_text().split("/min")[0])
    assert requests_rate > 0 and sales.locator(".requests").inner_text().startswith("0.00/min")
    assert float(row.locator(".reward-recent").inner_text()) > 0
    first_row = "#agents-table tbody tr:first-child"
    page.get_by_label("Order").select_option("desc")
    for sort in ("traffic", "reward"):  # the busier, better rewarded agent comes first
        with page.expect_response(lambda r, s=sort: f"sort={s}&order=desc" in r.url) as answer:
            page.get_by_label("Sort by").select_option(sort)
        assert [r["agent"] for r in answer.value.json()["data"]] == ["support", "sales"]
        page.wait_for_selector(f"{first_row}[data-agent='support']")
    page.get_by_label("Sort by").select_option("name")
    page.get_by_label("Order").select_option("asc")
    page.wait_for_selector(f"{first_row}[data-agent='sales']")
    page.wait_for_selector("#live:text('live')")
    page.screenshot(path=str(shots / "console-agents.png"))

    # The agent's page: one point per reward, a marker per version, the trajectories.
    row.get_by_role("link", name="support").click()
    page.wait_for_selector("#reward-chart svg circle.pt")
    rewards = service.feedback.recent_rewards("support")
    assert len(rewards) == sum(len(r) for r in ROUNDS)
    assert page.locator("#reward-chart circle.pt").count() == len(rewards)
    assert page.locator("#reward-chart line.ver").count() == last
    assert page.locator("#serving-version").inner_text() == f"v{last}"
    assert page.locator("#versions-table tbody tr").count() == last
    assert page.locator("#replica").inner_text() == "embedded"
    assert "/min (5 min)" in page.locator("#requests-rate").inner_text()

    # `<script>` in a prompt is text: shown as typed, never run.
    page.wait_for_selector("#trajectories-table tbody tr")
    prompt = page.locator("#trajectories-table td.prompt", has_text="window.__pwned")
    assert prompt.inner_text() == f"user: {XSS_PROMPT}"
    assert page.locator("#trajectories-table script, #trajectories-table img").count() == 0
    assert page.evaluate("window.__pwned") is None

    # Every form control has a label.
    unlabelled = page.evaluate(
        "[...document.querySelectorAll('input, select')].filter(e => !e.labels.length)"
        ".map(e => e.id)"
    )
    assert unlabelled == []

    # Roll back to v3 through the page, by keyboard: the confirmation names what changes,
    # and its focus starts on Cancel.
    page.get_by_role("button", name="Roll back to version 3").focus()
    page.keyboard.press("Enter")
    confirm = page.locator("#confirm-text").inner_text()
    assert f"serve version 3 instead of version {last}" in confirm
    assert "v4, v5 will be marked rolled back" in confirm
    assert page.evaluate("document.activeElement.id") == "confirm-cancel"
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "confirm-ok"
    page.keyboard.press("Enter")
    page.wait_for_selector("#serving-version:text('v3')")
    listed_adapters = httpx.get(
        f"{gateway.url}/v1/adapters", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    support = next(a for a in listed_adapters.json()["data"] if a["agent"] == "support")
    assert support["active_version"] == 3 and support["activated_by"] == "rollback"
    page.wait_for_selector("#reward-chart line.rb", state="attached")
    assert "rolled back" in page.locator("#versions-table tr[data-version='5']").inner_text()
    page.screenshot(path=str(shots / "console-agent.png"), full_page=True)

    # A change made elsewhere (the admin API) reaches the open page over the live feed.
    moved = httpx.post(
        f"{gateway.url}/v1/adapters/support/rollback",
        json={"version": last},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert moved.status_code == 200, moved.text
    page.wait_for_selector(f"#serving-version:text('v{last}')", timeout=15_000)

    # Pin, then unpin; a cancelled confirmation changes nothing.
    page.locator("#pin-button").click()
    page.locator("#confirm-cancel").click()
    assert not service.registry.is_pinned("support")
    page.locator("#pin-button").click()
    assert "stops publishing new versions" in page.locator("#confirm-text").inner_text()
    page.locator("#confirm-ok").click()
    page.wait_for_selector("#pinned-state:text('pinned: training frozen')")
    assert service.registry.is_pinned("support")
    page.locator("#pin-button").click()
    page.locator("#confirm-ok").click()
    page.wait_for_selector("#pinned-state:text('no')")
    assert not service.registry.is_pinned("support")

    # Phone width: the page reflows; wide tables scroll inside their own box.
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.screenshot(path=str(shots / "console-phone.png"))

    # Logout: back to the login form, and the session is gone on the server.
    page.get_by_role("button", name="Log out").click()
    page.wait_for_selector("#login-view:not([hidden])")
    status = page.evaluate("fetch('/console/api/agents').then(r => r.status)")
    assert status == 401
    assert not errors, errors
    context.close()
