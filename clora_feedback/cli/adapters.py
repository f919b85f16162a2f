"""`clora adapters ...`: inspect and steer a running gateway's adapter versions over HTTP.

    clora adapters list                               agents, active version, pinned
    clora adapters versions AGENT                     versions with status and metrics
    clora adapters show AGENT VERSION                 one version with its manifest
    clora adapters rollback AGENT VERSION [--reason]  serve and train from VERSION again
    clora adapters pin AGENT | unpin AGENT            freeze / resume training
    clora adapters gate AGENT VERSION                 run the offline gate on VERSION now
    clora adapters promote AGENT [VERSION]            serve VERSION (default: the canary)
    clora adapters abort AGENT                        stop the live canary (share 0 at once)
    clora adapters prune [--keep-last N]              one retention pass, on the stores

Every action takes `--url` (default: `http://<host>:<port>` from the settings
`clora serve` uses), `--api-key` (default: the settings' `admin_api_key`, i.e.
`CLORA_ADMIN_API_KEY`), `--config` and `--json` (print the raw response).
Exit status: 0 on success, 1 when the gateway refuses (its OpenAI-style error
message is printed), 2 when it cannot be reached.

`prune` is the exception: it opens the stores of the settings directly (the
registry and, with `retention.trajectory_ttl_s`, the trajectories) and runs one
retention pass (`store.retention`), safe beside running gateways (the registry's
locks and transactions serialise it with their moves).

Not here: the routes (`clora_feedback.gateway.adapters`); wiring into `clora`
(`clora_feedback.cli.main` calls `add_adapters_parser`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

_ACTIVE_MARK = "*"
_MAX_REASON = 70


def add_adapters_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `adapters` and its actions to `subparsers` (from `ArgumentParser.add_subparsers`).

    Each action sets `func` to `run_adapters`, which returns the exit status.
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, help="Gateway URL (default: from the settings).")
    common.add_argument(
        "--api-key", default=None, help="Admin API key (default: the settings' admin_api_key)."
    )
    common.add_argument("--config", type=Path, default=None, help="JSON or YAML settings file.")
    common.add_argument("--json", action="store_true", help="Print the raw JSON response.")
    common.add_argument("--timeout", type=float, default=30.0, help="HTTP timeout in seconds.")

    parser = subparsers.add_parser(
        "adapters", help="List, inspect, roll back and pin agents' adapter versions."
    )
    actions = parser.add_subparsers(dest="adapters_action", required=True)
    actions.add_parser("list", parents=[common], help="Agents with their active version.")
    versions = actions.add_parser("versions", parents=[common], help="An agent's versions.")
    versions.add_argument("agent")
    show = actions.add_parser("show", parents=[common], help="One version with its manifest.")
    show.add_argument("agent")
    show.add_argument("version", type=int)
    rollback = actions.add_parser(
        "rollback", parents=[common], help="Serve and train from an earlier version again."
    )
    rollback.add_argument("agent")
    rollback.add_argument("version", type=int)
    rollback.add_argument("--reason", default=None, help="Recorded on the versions it marks.")
    for name, text in (("pin", "Freeze training."), ("unpin", "Let training publish again.")):
        actions.add_parser(name, parents=[common], help=text).add_argument("agent")
    gate = actions.add_parser(
        "gate", parents=[common], help="Judge a version against serving on the eval cases now."
    )
    gate.add_argument("agent")
    gate.add_argument("version", type=int)
    promote = actions.add_parser(
        "promote", parents=[common], help="Serve a version to everyone (default: the canary)."
    )
    promote.add_argument("agent")
    promote.add_argument("version", type=int, nargs="?", default=None)
    abort = actions.add_parser("abort", parents=[common], help="Stop the agent's live canary.")
    abort.add_argument("agent")
    for release in (gate, promote, abort):
        release.add_argument("--reason", default=None, help="Recorded with the verdict.")
    prune = actions.add_parser(
        "prune",
        parents=[common],
        help="Prune old versions' weights (manifests stay) and expire trajectories, now.",
    )
    prune.add_argument(
        "--keep-last", type=int, default=None, help="Default: the settings' retention.keep_last."
    )
    parser.set_defaults(func=run_adapters)
    for action in actions.choices.values():
        action.set_defaults(func=run_adapters)
    return parser


def _connection(args: argparse.Namespace) -> tuple[str, str | None]:
    """The gateway URL and admin key: from the arguments, else from the settings."""
    url, key = args.url, args.api_key
    if url is None or key is None:
        from clora_feedback.config import load_settings

        settings = load_settings(args.config)
        if url is None:
            host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
            url = f"http://{host}:{settings.port}"
        if key is None:
            key = settings.admin_api_key
    return url.rstrip("/"), key


def _request(args: argparse.Namespace, client: httpx.Client) -> httpx.Response:
    action = args.adapters_action
    if action == "list":
        return client.get("/v1/adapters")
    if action == "versions":
        return client.get(f"/v1/adapters/{args.agent}/versions")
    if action == "show":
        return client.get(f"/v1/adapters/{args.agent}/versions/{args.version}")
    if action == "rollback":
        body: dict[str, Any] = {"version": args.version}
        if args.reason:
            body["reason"] = args.reason
        return client.post(f"/v1/adapters/{args.agent}/rollback", json=body)
    if action in ("gate", "promote", "abort"):
        release: dict[str, Any] = {"reason": args.reason} if args.reason else {}
        if getattr(args, "version", None) is not None:
            release["version"] = args.version
        timeout = max(args.timeout, 180.0) if action == "gate" else args.timeout
        return client.post(f"/v1/adapters/{args.agent}/{action}", json=release, timeout=timeout)
    return client.post(f"/v1/adapters/{args.agent}/{action}")


def run_adapters(args: argparse.Namespace, *, client: httpx.Client | None = None) -> int:
    """Run one `clora adapters` action; prints the result and returns the exit status.

    Args:
        args: parsed arguments (from `add_adapters_parser`).
        client: an httpx client to use instead of connecting to `--url` (tests).
    """
    if args.adapters_action == "prune":
        return _prune(args)
    try:
        if client is None:
            url, key = _connection(args)
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            with httpx.Client(base_url=url, headers=headers, timeout=args.timeout) as owned:
                response = _request(args, owned)
        else:
            response = _request(args, client)
    except httpx.HTTPError as exc:
        print(f"error: cannot reach the gateway: {exc}", file=sys.stderr)
        return 2
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if response.status_code >= 400 or not isinstance(payload, dict):
        error = payload.get("error", {}) if isinstance(payload, dict) else {}
        message = error.get("message") or response.text or response.reason_phrase
        code = f" {error['code']}" if error.get("code") else ""
        print(f"error ({response.status_code}{code}): {message}", file=sys.stderr)
        return 1
    print(json.dumps(payload, indent=2) if args.json else render(args.adapters_action, payload))
    return 0


def _prune(args: argparse.Namespace) -> int:
    """One retention pass on the settings' stores (see the module docstring)."""
    from clora_feedback.config import load_settings
    from clora_feedback.errors import CloraError
    from clora_feedback.service.maintenance import prune_once

    try:
        report = prune_once(load_settings(args.config), args.keep_last)
    except CloraError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    payload = {
        "pruned": report.pruned,
        "trajectories_deleted": report.trajectories_deleted,
        "seconds": round(report.seconds, 3),
    }
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        lines = [f"agent {a}: pruned versions {', '.join(map(str, v))}" for a, v in
                 sorted(report.pruned.items())] or ["nothing to prune"]  # fmt: skip
        lines.append(f"trajectories deleted: {report.trajectories_deleted}")
        print("\n".join(lines))
    return 0


# -- rendering -------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces, headers first."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [headers, *rows]
    ]
    return "\n".join(lines)


def _when(seconds: float | None) -> str:
    return "-" if seconds is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _metrics(metrics: dict[str, Any]) -> str:
    parts = [f"{k}={'null' if v is None else format(v, '.4g')}" for k, v in sorted(metrics.items())]
    return " ".join(parts) or "-"


def _short(text: str | None) -> str:
    if not text:
        return "-"
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def render(action: str, payload: dict[str, Any]) -> str:
    """Human-readable text for one action's JSON response."""
    if action == "list":
        rows = [
            [
                a["agent"],
                _opt(a["active_version"]),
                str(a["num_versions"]),
                _opt(a["latest_version"]),
                "yes" if a["pinned"] else "no",
                f"{_opt(a['activated_by'])} {_when(a['activated_at'])}",
            ]
            for a in payload["data"]
        ]
        if not rows:
            return "no agents have adapter versions yet"
        return format_table(["AGENT", "ACTIVE", "VERSIONS", "LATEST", "PINNED", "ACTIVATED"], rows)
    if action == "versions":
        head = (
            f"agent {payload['agent']}: active version {_opt(payload['active_version'])}, "
            f"{'pinned (training frozen)' if payload['pinned'] else 'not pinned'}"
        )
        rows = [_version_row(v) for v in payload["data"]]
        headers = ["VERSION", "STATUS", "RELEASE", "PARENT", "STEP", "CREATED", "METRICS", "REASON"]
        return head + "\n" + format_table(headers, rows)
    if action == "show":
        return _show(payload)
    if action == "rollback":
        marked = ", ".join(str(v) for v in payload["rolled_back"]) or "none"
        return (
            f"agent {payload['agent']}: version {_opt(payload['previous_version'])} -> "
            f"{payload['active_version']} (marked rolled back: {marked})\n"
            f"reason: {payload['reason']}"
        )
    if action in ("gate", "promote", "abort"):
        return (
            f"agent {payload['agent']}: v{payload['version']} {payload['state']}\n"
            f"reason: {payload['reason']}"
        )
    state = "pinned: training frozen" if payload["pinned"] else "unpinned: training may publish"
    return f"agent {payload['agent']}: {state}"


def _version_row(v: dict[str, Any]) -> list[str]:
    mark = _ACTIVE_MARK if v["status"] == "active" else ""
    return [
        f"{v['version']}{mark}",
        v["status"]
        + (" (pruned)" if v.get("payload_pruned") else "")
        + (" (no-op)" if v.get("noop") else ""),
        _release(v.get("release")),
        _opt(v["parent"]),
        str(v["step"]),
        _when(v["created_at"]),
        _metrics(v["metrics"]),
        _short(v["rolled_back_reason"] or _release_reason(v.get("release"))),
    ]


def _release(record: dict[str, Any] | None) -> str:
    """A version's release state, with the canary's share while it runs."""
    if not record:
        return "-"
    share = record.get("share")
    return (
        f"{record['state']} {share:.0%}"
        if record["state"] == "canary" and share
        else record["state"]
    )


def _release_reason(record: dict[str, Any] | None) -> str | None:
    """The latest verdict's reason (canary over gate)."""
    evidence = (record or {}).get("evidence") or {}
    for stage in ("operator", "canary", "gate"):
        reason = (evidence.get(stage) or {}).get("reason")
        if reason:
            return str(reason)
    return None


def _show(v: dict[str, Any]) -> str:
    fields = [
        ("agent", v["agent"]),
        ("version", str(v["version"])),
        ("status", v["status"]),
        ("parent", _opt(v["parent"])),
        ("step", str(v["step"])),
        ("created", _when(v["created_at"])),
        ("base model", v["base_model"]),
        ("path", v["path"]),
        ("content hash", v["content_hash"]),
        ("metrics", _metrics(v["metrics"])),
        ("feedback window", json.dumps(v["feedback_window"])),
        ("rolled back", f"{_when(v['rolled_back_at'])} {v['rolled_back_reason'] or ''}".strip()),
        ("release", json.dumps(v.get("release"))),
    ]
    width = max(len(k) for k, _ in fields)
    text = "\n".join(f"{k.ljust(width)}  {value}" for k, value in fields)
    return text + "\nmanifest:\n" + json.dumps(v.get("manifest"), indent=2)
