"""What the console's pages show, read from the registry, the feedback and trajectory stores.

`ConsoleViews` builds plain JSON-ready dicts (the routes return them as is):

- `agents_page`: one row per agent, searched, sorted and paged server-side, so
  a thousand agents cost one registry listing, two grouped reads of the recent
  window (requests per agent from the trajectory store, feedback events and
  mean reward per agent from the feedback store) and the work for one page's
  rows (request and feedback totals, a reward sparkline, the serving version's
  step metrics, the engine replica);
- `agent_detail`: an agent's versions (state, parent, step, loss, samples,
  staleness, reward from the step metrics the trainer recorded), its rewards
  over time with the version that served each, and the timeline of publishes
  and rollbacks;
- `trajectories`: recent completions with the feedback joined to them; prompt
  and output text only when `console.show_text` allows (the page renders it
  as text, never as HTML).

Rates are over the last `RATE_WINDOW_S` seconds (5 minutes): requests per
minute counts the completions stored in it, feedback per minute the feedback
events received in it (any state), and the recent reward is the mean reward,
under the current policy, of the samples the joined events among them judge
(None when none did). Sorting is by what the registry listing holds (name,
serving version, versions, pinned, last pointer move) or by those window
figures (`reward`, `traffic`: requests per minute), for every matching agent
before paging; totals and sparklines are read for the rows of the page only.
One read of the window serves every page for `WINDOW_TTL_S` seconds: judging
the window's feedback is the costly part (about 0.8 s for 10,000 events on one
CPU core), and the live feed rereads every open page whenever feedback moves.
Release-gate verdicts and canary arms are not shown: the registry records
neither yet.

Not here: authentication and actions (`routes`), the live change feed (`live`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from clora_feedback.errors import InvalidRequestError, NotFoundError
from clora_feedback.feedback.store import AgentActivity, RewardPoint
from clora_feedback.store.trajectories import AsyncTrajectoryStore, TrajectoryRecord
from clora_feedback.store.versions import AdapterStore, AgentInfo, VersionInfo

SortKey = Literal["name", "version", "versions", "pinned", "changed", "reward", "traffic"]
SORT_KEYS: tuple[str, ...] = (
    "name", "version", "versions", "pinned", "changed", "reward", "traffic"
)  # fmt: skip
RATE_WINDOW_S = 300.0
"""The recent window of the per-minute rates and the recent reward, in seconds."""
WINDOW_TTL_S = 5.0
"""How long one read of the window serves every page (the live feed reloads open pages
whenever feedback moves; each would otherwise judge the window's feedback again)."""
MAX_PAGE = 100
SPARK_POINTS = 30
CHART_POINTS = 500
MAX_TRAJECTORIES = 100
TEXT_LIMIT = 4000
"""Characters of prompt or output text sent per trajectory (the rest is cut, marked)."""


class FeedbackReader(Protocol):
    """What the console reads from the feedback store (`feedback.store.FeedbackStore`)."""

    def recent_rewards(self, agent: str, *, limit: int = 500) -> list[RewardPoint]: ...

    def state_counts(self, agent: str | None = None) -> dict[str, int]: ...

    def rewards_for(self, completion_id: str) -> list[dict[str, Any]]: ...

    def activity_since(self, since: float) -> dict[str, AgentActivity]: ...


@dataclass(frozen=True)
class _Window:
    """Every agent's figures over the last `RATE_WINDOW_S` seconds (agents with none absent)."""

    requests: dict[str, int]
    feedback: dict[str, AgentActivity]

    def fields(self, agent: str) -> dict[str, Any]:
        """The row fields of `agent`: rates per minute and the recent mean reward."""
        activity = self.feedback.get(agent)
        mean = None if activity is None else activity.reward_mean
        return {
            "requests_per_min": _per_min(self.requests.get(agent, 0)),
            "feedback_per_min": _per_min(0 if activity is None else activity.events),
            "reward_recent": None if mean is None else round(mean, 4),
            "reward_judged": 0 if activity is None else activity.judged,
            "window_s": RATE_WINDOW_S,
        }


def _per_min(count: int) -> float:
    return round(count * 60.0 / RATE_WINDOW_S, 2)


def _unknown_agent(agent: str) -> NotFoundError:
    return NotFoundError(f"no agent {agent!r}", param="agent", code="agent_not_found")


class ConsoleViews:
    """Read-only views for the console pages.

    Args:
        registry: adapter versions and pointers (blocking; run in worker threads).
        feedback: rewards and event counts (blocking; run in worker threads).
        trajectories: the gateway's trajectory store (started by the gateway).
        serving: names of the agents the gateway serves (listed even without versions).
        show_text: include prompt and output text of trajectories.
        replica_of: the engine's `Engine.replica_of` (where an agent is served); None
            shows no replica.
        releases: agent -> its versions' release records (`ReleaseBook.of_agent`); None
            with the release path off.
        clock: seconds since the epoch (tests pass their own).
    """

    def __init__(
        self,
        registry: AdapterStore,
        feedback: FeedbackReader,
        trajectories: AsyncTrajectoryStore,
        serving: Callable[[], Sequence[str]],
        *,
        show_text: bool,
        replica_of: Callable[[str], str | None] | None = None,
        releases: Callable[[str], Mapping[int, Any]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._feedback = feedback
        self._trajectories = trajectories
        self._serving = serving
        self.show_text = show_text
        self._replica_of = replica_of
        self._releases = releases
        self._clock = clock
        self._window_lock = asyncio.Lock()
        self._window_read: tuple[float, _Window] | None = None

    # -- agents page ------------------------------------------------------------------

    def _all_agents(self) -> dict[str, AgentInfo | None]:
        known: dict[str, AgentInfo | None] = {a.agent: a for a in self._registry.agents()}
        for name in self._serving():
            known.setdefault(name, None)
        return known

    async def _window(self) -> _Window:
        """The window's figures, read again once the last read is `WINDOW_TTL_S` old;
        concurrent pages wait for one read."""
        async with self._window_lock:
            now = self._clock()
            if self._window_read is None or now - self._window_read[0] >= WINDOW_TTL_S:
                since = now - RATE_WINDOW_S
                requests = await self._trajectories.counts_since(since)
                feedback = await asyncio.to_thread(self._feedback.activity_since, since)
                self._window_read = (now, _Window(requests, feedback))
            return self._window_read[1]

    def _replica(self, agent: str) -> str | None:
        return None if self._replica_of is None else self._replica_of(agent)

    async def agents_page(
        self, *, query: str, sort: str, descending: bool, offset: int, limit: int
    ) -> dict[str, Any]:
        """One page of agent rows and the total that match `query` (a name substring)."""
        if sort not in SORT_KEYS:
            raise InvalidRequestError(f"sort must be one of {', '.join(SORT_KEYS)}", param="sort")
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidRequestError(f"limit must be in 1..{MAX_PAGE}", param="limit")
        if offset < 0:
            raise InvalidRequestError("offset must be >= 0", param="offset")
        known = await asyncio.to_thread(self._all_agents)
        window = await self._window()
        needle = query.strip().lower()
        names = [n for n in known if needle in n.lower()]
        names.sort(key=lambda n: (_sort_value(n, known[n], window, sort), n), reverse=descending)
        page = names[offset : offset + limit]
        rows = await asyncio.gather(*(self._row(n, known[n], window) for n in page))
        return {"object": "list", "total": len(names), "offset": offset, "data": list(rows)}

    async def _row(self, name: str, info: AgentInfo | None, window: _Window) -> dict[str, Any]:
        def read() -> tuple[VersionInfo | None, dict[str, int], list[RewardPoint]]:
            active = self._registry.active(name) if info is not None else None
            counts = self._feedback.state_counts(name)
            return active, counts, self._feedback.recent_rewards(name, limit=SPARK_POINTS)

        active, counts, rewards = await asyncio.to_thread(read)
        requests = await self._trajectories.count(name)
        return {
            **_agent_fields(name, info),
            "requests": requests,
            "feedback": _counts(counts),
            **window.fields(name),
            "rewards": [round(p.reward, 4) for p in rewards],
            "staleness": _metric(active, "staleness_mean"),
            "last_step_at": None if active is None else active.created_at,
            "replica": self._replica(name),
        }

    # -- one agent -----------------------------------------------------------------------

    async def agent_detail(self, agent: str) -> dict[str, Any]:
        """Versions, rewards over time and the publish/rollback timeline of `agent`.

        Raises:
            NotFoundError: neither the registry nor the gateway knows `agent`.
        """

        def read() -> tuple[AgentInfo | None, list[VersionInfo], list[RewardPoint], dict[str, int]]:
            known = self._all_agents()
            if agent not in known:
                raise _unknown_agent(agent)
            info = known[agent]
            versions = self._registry.versions(agent) if info is not None else []
            rewards = self._feedback.recent_rewards(agent, limit=CHART_POINTS)
            return info, versions, rewards, self._feedback.state_counts(agent)

        info, versions, rewards, counts = await asyncio.to_thread(read)
        records: Mapping[int, Any] = {}
        if self._releases is not None and versions:
            records = await asyncio.to_thread(self._releases, agent)
        window = await self._window()
        return {
            **_agent_fields(agent, info),
            "requests": await self._trajectories.count(agent),
            "feedback": _counts(counts),
            **window.fields(agent),
            "replica": self._replica(agent),
            "versions": [_version_row(v, records.get(v.version)) for v in versions],
            "rewards": [
                {"t": p.created_at, "reward": p.reward, "version": p.adapter_version}
                for p in rewards
            ],
            "timeline": _timeline(info, versions),
            "show_text": self.show_text,
        }

    async def trajectories(self, agent: str, *, limit: int) -> dict[str, Any]:
        """`agent`'s newest completions, each with the feedback joined to it."""
        if not 1 <= limit <= MAX_TRAJECTORIES:
            raise InvalidRequestError(f"limit must be in 1..{MAX_TRAJECTORIES}", param="limit")
        if agent not in await asyncio.to_thread(self._all_agents):
            raise _unknown_agent(agent)
        records = await self._trajectories.list(agent, limit=limit)
        feedback = await asyncio.to_thread(
            lambda: {r.id: self._feedback.rewards_for(r.id) for r in records}
        )
        return {
            "object": "list",
            "show_text": self.show_text,
            "data": [self._trajectory(r, feedback[r.id]) for r in records],
        }

    def _trajectory(
        self, record: TrajectoryRecord, feedback: list[dict[str, Any]]
    ) -> dict[str, Any]:
        row: dict[str, Any] = {
            "id": record.id,
            "created_at": record.created_at,
            "adapter_version": record.adapter_version,
            "kind": record.kind,
            "finish_reason": record.samples[0].finish_reason if record.samples else None,
            "feedback": [
                {"event_id": f["event_id"], "kind": f["kind"], "value": f["value"]}
                for f in feedback
            ],
        }
        if self.show_text:
            row["prompt"] = _cut(_prompt_text(record.request))
            row["output"] = _cut("\n---\n".join(s.text for s in record.samples))
        return row


def _sort_value(name: str, info: AgentInfo | None, window: _Window, sort: str) -> tuple[int, float]:
    """A comparable key; agents without the figure (no registry data, no recent reward)
    sort as the lowest value."""
    if sort == "traffic":
        return (1, float(window.requests.get(name, 0)))
    if sort == "reward":
        activity = window.feedback.get(name)
        mean = None if activity is None else activity.reward_mean
        return (0, 0.0) if mean is None else (1, mean)
    if sort == "name" or info is None:
        return (0, 0.0)
    value = {
        "version": info.active_version,
        "versions": info.num_versions,
        "pinned": int(info.pinned),
        "changed": info.activated_at,
    }[sort]
    return (0, 0.0) if value is None else (1, float(value))


def _agent_fields(name: str, info: AgentInfo | None) -> dict[str, Any]:
    return {
        "agent": name,
        "active_version": None if info is None else info.active_version,
        "pinned": False if info is None else info.pinned,
        "num_versions": 0 if info is None else info.num_versions,
        "latest_version": None if info is None else info.latest_version,
        "activated_by": None if info is None else info.activated_by,
        "activated_at": None if info is None else info.activated_at,
    }


def _counts(counts: dict[str, int]) -> dict[str, int]:
    return {state: counts.get(state, 0) for state in ("joined", "parked", "dead")}


def _metric(version: VersionInfo | None, key: str) -> float | None:
    if version is None:
        return None
    value = version.metrics.get(key)
    return None if value is None else float(value)


def _release_fields(record: Any) -> dict[str, Any]:
    """A version's release state for the console: state, the canary's share, the latest
    verdict's reason (operator over canary over gate)."""
    if record is None:
        return {"release": None, "release_share": None, "release_reason": None}
    reason = None
    for stage in ("operator", "canary", "gate"):
        reason = (record.evidence.get(stage) or {}).get("reason")
        if reason:
            break
    return {"release": record.state, "release_share": record.share, "release_reason": reason}


def _version_row(v: VersionInfo, record: Any = None) -> dict[str, Any]:
    samples = (v.feedback_window or {}).get("samples")
    if samples is None and "num_pg" in v.metrics:
        samples = (v.metrics.get("num_pg") or 0) + (v.metrics.get("num_sft") or 0)
    return {
        "version": v.version,
        "parent": v.parent,
        "step": v.step,
        "status": v.status,
        "created_at": v.created_at,
        "loss": _metric(v, "loss"),
        "reward_mean": _metric(v, "reward_mean"),
        "staleness_mean": _metric(v, "staleness_mean"),
        "samples": samples,
        "rolled_back_at": v.rolled_back_at,
        "rolled_back_reason": v.rolled_back_reason,
        **_release_fields(record),
    }


def _timeline(info: AgentInfo | None, versions: list[VersionInfo]) -> list[dict[str, Any]]:
    """Publishes, and rollbacks (grouped by the time they marked versions), oldest first."""
    events: list[dict[str, Any]] = [
        {"t": v.created_at, "kind": "publish", "version": v.version} for v in versions
    ]
    marked: dict[float, list[VersionInfo]] = {}
    for v in versions:
        if v.rolled_back_at is not None:
            marked.setdefault(v.rolled_back_at, []).append(v)
    for when, group in marked.items():
        target = None
        if info is not None and info.activated_by == "rollback" and info.activated_at == when:
            target = info.active_version
        events.append(
            {
                "t": when,
                "kind": "rollback",
                "version": target,
                "marked": [v.version for v in group],
                "reason": group[0].rolled_back_reason,
            }
        )
    if info is not None and info.activated_by == "rollback" and info.activated_at not in marked:
        # A rollback that marked nothing new (e.g. undoing a mistaken one).
        events.append(
            {"t": info.activated_at, "kind": "rollback", "version": info.active_version,
             "marked": [], "reason": None}
        )  # fmt: skip
    return sorted(events, key=lambda e: e["t"] or 0.0)


def _prompt_text(request: dict[str, Any]) -> str:
    """The request's messages as `role: text` lines (chat), or its prompt (completions)."""
    messages = request.get("messages")
    if isinstance(messages, list):
        lines = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = " ".join(
                    str(part.get("text", "")) for part in content if isinstance(part, dict)
                )
            lines.append(f"{m.get('role', '?')}: {content if content is not None else ''}")
        return "\n".join(lines)
    prompt = request.get("prompt")
    return prompt if isinstance(prompt, str) else "" if prompt is None else str(prompt)


def _cut(text: str) -> str:
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + " [...]"
