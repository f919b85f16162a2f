"""Screenshots of the operator console from a running `clora demo` (the real default model).

Starts `clora demo` (SmolLM2-135M on CPU, simulated users, real training) with
the console showing trajectory text (`CLORA_CONSOLE__SHOW_TEXT=true`: the users
are simulated, so their prompts may be shown), reads the console URL it prints,
waits until the `support` agent serves its second trained version (about two
minutes on two CPU cores; at the latest 30 s before the demo ends), then drives Debian's chromium with Playwright for Python at 1280 px and saves:

    <out-dir>/console-agents.png   the agents page
    <out-dir>/console-agent.png    the top 1,400 px of the `support` agent's page

It then lets the demo finish (it writes its own results under `--demo-out`).
The demo gateway has no keys, so the console needs no login. With `--url` it
photographs a console already running instead (an open gateway, or not: then
`--key` logs in).

    python3 scripts/console_screenshots.py --out-dir docs

Not here: the browser test (tests/test_console_browser.py, the tiny model).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
URL_LINE = re.compile(r"^console: (\S+)/console\b")


def start_demo(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    """Start `clora demo`, echo its output, and return it with the gateway's base URL."""
    command = [
        sys.executable, "-m", "clora_feedback.cli", "demo",
        "--minutes", str(args.minutes), "--versions", "0",
        "--data-dir", str(args.data_dir), "--out", str(args.demo_out),
    ]  # fmt: skip
    env = {**os.environ, "CLORA_CONSOLE__SHOW_TEXT": "true"}
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)  # fmt: skip
    assert demo.stdout is not None
    found = threading.Event()
    url: list[str] = []

    def echo() -> None:
        assert demo.stdout is not None
        for line in demo.stdout:
            print("demo |", line, end="", flush=True)
            match = URL_LINE.match(line.strip())
            if match and not url:
                url.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=echo, daemon=True).start()
    found.wait(args.timeout_s)
    if not url:
        demo.kill()
        raise SystemExit("the demo printed no console URL")
    return demo, url[0]


def wait_for_training(base: str, agent: str, versions: int, timeout_s: float) -> None:
    """Until `agent` serves version >= `versions` and has rewards (through the console's API),
    or `timeout_s` passed (then the pages are shot as they are: a demo runs once)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base, timeout=30.0) as http:
        http.get("/console/api/session")  # an open gateway starts a session without a login
        while True:
            detail = http.get(f"/console/api/agents/{agent}")
            if detail.status_code == 200:
                d = detail.json()
                if (d["active_version"] or 0) >= versions and d["rewards"]:
                    print(f"{agent}: serving v{d['active_version']}, {len(d['rewards'])} rewards")
                    return
            if time.monotonic() > deadline:
                print(f"{agent} had no trained version after {timeout_s:.0f} s; shooting anyway")
                return
            time.sleep(5.0)


def screenshots(base: str, agent: str, out_dir: Path, key: str | None) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page: Any = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{base}/console")
        if key:
            page.get_by_label("Admin API key").fill(key)
            page.keyboard.press("Enter")
        page.wait_for_selector(f"#agents-table tbody tr[data-agent='{agent}'] svg.spark")
        page.wait_for_selector("#live:text('live')")
        page.screenshot(path=str(out_dir / "console-agents.png"), full_page=True)
        page.locator(f"#agents-table tbody tr[data-agent='{agent}']").get_by_role(
            "link", name=agent
        ).click()
        page.wait_for_selector("#reward-chart svg circle.pt")
        page.wait_for_selector("#trajectories-table tbody tr")
        time.sleep(1.0)  # let a live reload triggered meanwhile settle
        # The top of the page (summary, chart, versions, the newest trajectories): the
        # demo's prompts are long, and the full page would be several screens tall.
        page.set_viewport_size({"width": 1280, "height": 1400})
        page.screenshot(path=str(out_dir / "console-agent.png"))
        browser.close()
    print(f"wrote {out_dir / 'console-agents.png'} and {out_dir / 'console-agent.png'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("docs"))
    parser.add_argument("--url", help="A running gateway's base URL (no demo is started).")
    parser.add_argument("--key", help="The admin key, when that gateway has keys.")
    parser.add_argument("--agent", default="support", help="The agent whose page is shot.")
    parser.add_argument("--minutes", type=float, default=3.0, help="The demo's length.")
    parser.add_argument("--versions", type=int, default=2,
                        help="Wait until the agent serves at least this version.")  # fmt: skip
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/demo-shots"))
    parser.add_argument("--demo-out", type=Path, default=Path("/tmp/demo-shots/out"))
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.url:
        base = args.url.rstrip("/").removesuffix("/console")
        screenshots(base, args.agent, args.out_dir, args.key)
        return 0
    demo, base = start_demo(args)
    try:
        # The demo's clock starts once the URL is printed; shoot 30 s before its end at the
        # latest (its gateway stops with it).
        left = args.minutes * 60 - 30
        wait_for_training(base, args.agent, args.versions, min(args.timeout_s, max(left, 5.0)))
        screenshots(base, args.agent, args.out_dir, None)
    except BaseException:
        demo.terminate()
        raise
    return demo.wait()


if __name__ == "__main__":
    sys.exit(main())
