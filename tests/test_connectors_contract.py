"""The files in connectors/ are exactly what the pydantic models generate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clora_feedback.schemas.export import render
from clora_feedback.schemas.feedback import parse_event

ROOT = Path(__file__).resolve().parents[1] / "connectors"


@pytest.mark.parametrize("rel", sorted(render()))
def test_contract_file_matches_models(rel: str) -> None:
    path = ROOT / rel
    assert path.is_file(), f"{path} missing: run python -m clora_feedback.schemas.export"
    assert path.read_text() == render()[rel], (
        f"{rel} drifted: run python -m clora_feedback.schemas.export"
    )


def test_no_stale_files() -> None:
    expected = set(render())
    present = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.json")}
    assert present == expected


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.json")), ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    event = parse_event(json.loads(path.read_text()))
    assert event.event_id
