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


def test_readme_signature_example_is_what_the_code_computes() -> None:
    """The worked example in connectors/README.md is exact: the code signs and accepts it."""
    from clora_feedback.schemas.feedback import sign_body, verify_signature

    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    body = next(line for line in lines if line.startswith('{"kind":"resolution"')).encode()
    header = next(line for line in lines if line.startswith("X-Clora-Signature: t=1767225600,"))
    value = header.removeprefix("X-Clora-Signature: ")
    assert sign_body(body, "whsec_example", timestamp=1767225600) == value
    verify_signature(body, "whsec_example", value, now=1767225600 + 299)
