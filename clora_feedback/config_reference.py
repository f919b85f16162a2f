"""The configuration reference (`docs/configuration.md`), rendered from the settings models.

`fields()` walks `Settings` depth first: every field with its dotted key, its
`CLORA_*` variable, type, default and description; `render()` is the Markdown
page, one table per section, in the models' own order. `clora config docs`
writes it, and a test fails when the committed page differs, when a field has
no description, or when nothing in the package reads a field.

Not here: the models themselves and their validation (`clora_feedback.config`).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from clora_feedback.config import Settings

HEADER = """# Configuration

Generated from the settings models (`clora_feedback/config.py`) by `clora config docs`;
do not edit by hand: `tests/test_config_reference.py` fails when this page is stale,
when a setting has no description, or when nothing reads it.

Settings come from (highest first) `clora` flags, environment variables prefixed
`CLORA_` (sections nested with `__`: `CLORA_ENGINE__MAX_LORAS=16`), and a YAML or
JSON file (`--config`, or `CLORA_CONFIG_FILE`). A list or a mapping is given as JSON
in its variable.
"""


@dataclass(frozen=True)
class Entry:
    """One setting.

    Attributes:
        key: dotted path from the top (`engine.vllm.urls`; `agents[].name` for list items).
        env: its environment variable (None inside a list: set the whole list).
        section: the dotted path of the model that holds it ("" for the top level).
        field: pydantic's field (type, default, description).
        model: the model class the field's type is, when it is a section.
    """

    key: str
    env: str | None
    section: str
    field: FieldInfo
    model: type[BaseModel] | None


def fields(model: type[BaseModel] = Settings, prefix: str = "", env: str | None = "CLORA_") -> Iterator[Entry]:  # fmt: skip
    """Every field of `model` and of the sections below it, depth first, in declaration order."""
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        var = None if env is None else f"{env}{name.upper()}"
        section, listed = _section(info.annotation)
        yield Entry(key, var, prefix.rstrip("."), info, section)
        if section is not None:
            below = None if listed or var is None else f"{var}__"
            yield from fields(section, f"{key}[]." if listed else f"{key}.", below)


def _section(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the model class, whether it is a list of them) when `annotation` is a section."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, True
    return None, False


def type_name(annotation: Any) -> str:
    """A short readable type: `int | None`, `list[str]`, `"embedded" | "vllm"`, `Path`."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def default_text(info: FieldInfo) -> str:
    """The default as a reader writes it (a section: `(section)`; required: `(required)`)."""
    if info.default_factory is not None:
        value: Any = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    return _literal(value)


def _literal(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, Path | str):
        return str(value)
    if isinstance(value, tuple | list | dict | bool | int | float):
        return json.dumps(value, default=str)
    return str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole reference page (Markdown): a table per section, sections depth first."""
    sections: dict[str, list[Entry]] = {"": []}
    for entry in fields():
        if entry.model is not None:
            sections.setdefault(
                entry.key + ("[]" if _section(entry.field.annotation)[1] else ""), []
            )
        else:
            sections.setdefault(entry.section, []).append(entry)
    lines = [HEADER]
    for section, entries in sections.items():
        if not entries:
            continue
        lines += ["", _heading(section), ""]
        lines += ["| setting | environment | type | default | description |", "|---|---|---|---|---|"]  # fmt: skip
        for entry in entries:
            env = f"`{entry.env}`" if entry.env else "(in the list)"
            row = (f"`{entry.key}`", env, f"`{_cell(type_name(entry.field.annotation))}`",
                   f"`{_cell(default_text(entry.field))}`", _cell(entry.field.description or ""))  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _heading(section: str) -> str:
    if not section:
        return "## Top level"
    owner = next(e for e in fields() if e.key == section.removesuffix("[]"))
    doc = (owner.model.__doc__ or "").strip().splitlines()[0] if owner.model else ""
    about = owner.field.description or doc
    return f"## `{section}`\n\n{about}" if about else f"## `{section}`"
