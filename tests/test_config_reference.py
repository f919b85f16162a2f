"""Config that documents itself: every setting is described and read, and the committed
reference page (`docs/configuration.md`) is the one the models render.

When one fails after a settings change: describe the field (`Field(..., description=...)`),
use it or delete it, then `clora config docs --out docs/configuration.md`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import clora_feedback
from clora_feedback.config_reference import Entry, fields, render

PACKAGE = Path(clora_feedback.__file__).parent
PAGE = PACKAGE.parent / "docs" / "configuration.md"


def _names_read() -> set[str]:
    """Every attribute the package reads (`x.name`), and, outside config.py, every string
    (`model_copy(update={"name": ...})`, `getattr(x, "name")`): a field named nowhere is dead."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        own = path.name in ("config.py", "config_reference.py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif not own and isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names


def _name(entry: Entry) -> str:
    return entry.key.rsplit(".", 1)[-1]


def test_every_setting_has_a_description() -> None:
    missing = [e.key for e in fields() if not (e.field.description or "").strip()]
    assert missing == []


def test_every_setting_is_read_somewhere() -> None:
    read = _names_read()
    assert [e.key for e in fields() if _name(e) not in read] == []


def test_the_read_check_can_fail() -> None:
    assert "request_timeout_s" not in _names_read()  # the field it caught, deleted since


def test_the_committed_reference_is_current() -> None:
    assert PAGE.read_text() == render(), "run: clora config docs --out docs/configuration.md"


def test_the_reference_names_every_setting_with_its_variable() -> None:
    page = render()
    for entry in fields():
        if entry.model is None:
            assert f"| `{entry.key}` |" in page
    assert "`CLORA_ENGINE__MAX_LORAS`" in page and "`agents[].name`" in page
