"""The admin wire models are read off the registry's value types, field for field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from clora_feedback.schemas.admin import AdapterVersionObject, AgentAdaptersObject
from clora_feedback.store.versions import AgentInfo, VersionInfo


def test_every_version_field_reaches_the_wire() -> None:
    info = VersionInfo(
        agent="support", version=3, parent=2, step=7, status="rolled_back", created_at=1.5,
        metrics={"loss": 0.25, "reward_mean": None}, feedback_window={"samples": 4},
        content_hash="abc", base_model="tiny", path=Path("/adapters/support/3"),
        has_optimizer_state=True, rolled_back_at=2.5, rolled_back_reason="worse",
    )  # fmt: skip
    wire = AdapterVersionObject.of(info, manifest={"version": 3}).model_dump(mode="json")
    for f in dataclasses.fields(VersionInfo):
        expected = getattr(info, f.name)
        expected = str(expected) if isinstance(expected, Path) else expected
        assert wire[f.name] == expected, f.name
    assert wire["object"] == "adapter.version" and wire["manifest"] == {"version": 3}
    assert AdapterVersionObject.of(info).manifest is None


def test_every_agent_field_reaches_the_wire() -> None:
    info = AgentInfo(
        agent="support", active_version=2, pinned=True, num_versions=3, latest_version=3,
        activated_by="rollback", activated_at=9.0,
    )  # fmt: skip
    wire = AgentAdaptersObject.of(info).model_dump()
    assert {f.name: wire[f.name] for f in dataclasses.fields(AgentInfo)} == dataclasses.asdict(info)
