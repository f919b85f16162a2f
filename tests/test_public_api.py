"""The package's public face: `clora_feedback.__all__`, lazy imports, and the PEP 561 marker."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import clora_feedback

ROOT = Path(__file__).resolve().parents[1]


def test_all_is_unique_and_every_name_resolves() -> None:
    names = clora_feedback.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert getattr(clora_feedback, name) is not None, name
    assert set(names) <= set(dir(clora_feedback))
    assert set(names) == {"__version__", *clora_feedback._EXPORTS}  # one list, kept in step


@pytest.mark.parametrize("name", [n for n in clora_feedback.__all__ if n != "__version__"])
def test_every_exported_member_is_the_documented_object_of_its_module(name: str) -> None:
    value = getattr(clora_feedback, name)
    home = importlib.import_module(clora_feedback._EXPORTS[name])
    assert getattr(home, name) is value
    if callable(value) and not isinstance(value, type(int | str)):
        assert value.__doc__ and value.__doc__.strip(), f"{name} has no docstring"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        clora_feedback.nope  # noqa: B018


def test_importing_the_package_stays_cheap() -> None:
    """`import clora_feedback` loads no torch and no web stack until a public name is used."""
    code = (
        "import sys, clora_feedback; "
        "heavy = [m for m in ('torch', 'fastapi', 'aiokafka', 'httpx') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_package_ships_its_type_hints() -> None:
    assert (ROOT / "clora_feedback" / "py.typed").is_file()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["clora_feedback"]
