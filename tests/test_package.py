"""Package hygiene: every module imports, layers point one way, every module says what it is."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import clora_feedback

ROOT = Path(clora_feedback.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(ROOT)], prefix="clora_feedback."))

# Lower layers must not reach up into higher ones (or into HTTP/Kafka/vLLM).
FORBIDDEN = {
    "clora_feedback.errors": ("clora_feedback.", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.lifecycle": ("clora_feedback.", "torch", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.priority": ("clora_feedback.", "torch", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.heap": ("clora_feedback.", "torch", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.hardware": ("clora_feedback.", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.cores": ("clora_feedback.", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.config_reference": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "fastapi"),
    "clora_feedback.config": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "fastapi"),
    "clora_feedback.schemas": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "clora_feedback.store", "clora_feedback.feedback", "fastapi", "aiokafka"),
    "clora_feedback.chat_format": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "clora_feedback.store", "clora_feedback.feedback", "clora_feedback.lora", "torch", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.lora": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "clora_feedback.feedback", "clora_feedback.model", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.model": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "clora_feedback.feedback", "clora_feedback.store", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.engine": ("clora_feedback.gateway", "clora_feedback.train", "clora_feedback.feedback", "fastapi", "aiokafka"),
    "clora_feedback.store": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "fastapi", "aiokafka"),
    "clora_feedback.train": ("clora_feedback.engine", "clora_feedback.gateway", "fastapi", "aiokafka"),
    "clora_feedback.feedback": ("clora_feedback.gateway", "clora_feedback.train", "clora_feedback.engine", "clora_feedback.service", "clora_feedback.cli", "clora_feedback.client", "clora_feedback.demo", "clora_feedback.bench"),
    "clora_feedback.release": ("clora_feedback.gateway", "clora_feedback.train", "clora_feedback.service", "clora_feedback.cli", "fastapi", "aiokafka"),
    "clora_feedback.gateway": ("clora_feedback.service", "clora_feedback.cli", "clora_feedback.client", "clora_feedback.demo", "clora_feedback.bench"),
    "clora_feedback.client": ("clora_feedback.feedback.kafka", "clora_feedback.gateway", "clora_feedback.service", "fastapi"),
    "clora_feedback.integrations": ("clora_feedback.feedback", "clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "clora_feedback.service", "fastapi", "aiokafka"),
    "clora_feedback.service": ("clora_feedback.cli", "clora_feedback.demo", "clora_feedback.bench"),
    "clora_feedback.demo": ("clora_feedback.cli", "clora_feedback.bench"),
    # `clora bench` drives a running gateway from outside; benchmarks of engine and trainer
    # internals live in the repository's top-level benchmarks/, outside the package.
    "clora_feedback.bench": ("clora_feedback.engine.embedded", "clora_feedback.engine.decoder", "clora_feedback.engine.slots", "clora_feedback.engine.prefix_cache", "clora_feedback.model.decoder", "clora_feedback.train.step", "clora_feedback.train.state", "clora_feedback.train.forward", "clora_feedback.train.loss", "clora_feedback.lora.ops", "benchmarks"),
}  # fmt: skip
# Only these may import the demo and the benchmarks (they sit above everything else).
ABOVE_ALL = (
    "clora_feedback.demo",
    "clora_feedback.bench",
    "clora_feedback.cli",
    "clora_feedback.service",
)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _path(module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    return ROOT / rel / "__init__.py" if (ROOT / rel).is_dir() else (ROOT / rel).with_suffix(".py")


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_and_has_a_scope_docstring(module: str) -> None:
    mod = importlib.import_module(module)
    assert mod.__doc__ and mod.__doc__.strip(), f"{module} has no scope docstring"


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_point_one_way(layer: str) -> None:
    modules = [
        m
        for m in [*MODULES, "clora_feedback.errors", "clora_feedback.config"]
        if m == layer or m.startswith(layer + ".")
    ]
    assert modules
    for module in modules:
        for name in _imports(_path(module)):
            bad = [
                f
                for f in FORBIDDEN[layer]
                if name == f.rstrip(".")
                or name.startswith(f if f.endswith(".") else f + ".")
                or name == f
            ]
            if layer == "clora_feedback.errors":
                bad = [f for f in bad if name != "clora_feedback.errors"]
            assert not bad, f"{module} imports {name}"


def _package(module: str) -> str:
    """The top-level part of `module` inside clora_feedback ("" for clora_feedback itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private_imports(module: str) -> list[str]:
    """`_`-prefixed names `module` takes from another package of clora_feedback.

    Both `from clora_feedback.x.y import _z` and `m._z` on a name imported from
    clora_feedback count; dunders (`__version__`) are public.
    """
    tree = ast.parse(_path(module).read_text())
    origin: dict[str, str] = {}  # local name -> the clora_feedback module it comes from
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            origin |= {a.asname: a.name for a in node.names if a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("clora_feedback"):
                continue
            for alias in node.names:
                origin[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                if _is_private(alias.name) and _package(node.module) != _package(module):
                    found.append(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            source = origin.get(node.value.id, "")
            private = source.startswith("clora_feedback.") and _is_private(node.attr)
            if private and _package(source) != _package(module):
                found.append(f"{source}.{node.attr}")
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@pytest.mark.parametrize("module", MODULES)
def test_no_module_imports_another_packages_private_names(module: str) -> None:
    assert not _private_imports(module), f"{module} uses {_private_imports(module)}"


def test_the_private_import_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "train" / "x.py"
    fake.parent.mkdir()
    fake.write_text(
        "import clora_feedback.engine.decoder as m\n"
        "from clora_feedback.engine.decoder import _rms_norm\n"
        "from clora_feedback.train.y import _own\n"
        "from clora_feedback import __version__\n"
        "m._split_qkv\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _private_imports("clora_feedback.train.x") == [
        "clora_feedback.engine.decoder._rms_norm",
        "clora_feedback.engine.decoder._split_qkv",
    ]


@pytest.mark.parametrize("module", MODULES)
def test_only_the_top_imports_demo_and_bench(module: str) -> None:
    if any(module == top or module.startswith(top + ".") for top in ABOVE_ALL):
        return
    for name in _imports(_path(module)):
        below = ABOVE_ALL[:2]  # demo, bench
        assert not any(name == top or name.startswith(top + ".") for top in below), (
            f"{module} imports {name}"
        )


@pytest.mark.parametrize("module", MODULES)
def test_the_package_never_imports_the_repository_benchmarks(module: str) -> None:
    """`benchmarks/` is not installed: nothing in the package may need it."""
    for name in _imports(_path(module)):
        assert name != "benchmarks" and not name.startswith("benchmarks."), (
            f"{module} imports {name}"
        )


INDIRECT = {
    "gguf": "transformers converts the default model's GGUF file with it (model/default.py)"
}
"""Runtime dependencies the package needs without importing them, and why."""


def _project() -> dict[str, Any]:
    with open(ROOT.parent / "pyproject.toml", "rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


def test_every_runtime_dependency_is_imported_by_the_package() -> None:
    """A dependency only the tests use (peft, the equivalence oracle) is a dev extra."""
    imported = {name.split(".")[0] for m in MODULES for name in _imports(_path(m))}
    for requirement in _project()["dependencies"]:
        dist = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        assert dist in INDIRECT or dist.replace("-", "_") in imported, f"{dist} is never imported"


def test_no_extra_installs_vllm_into_this_environment() -> None:
    """vLLM lives in its own virtualenv (scripts/install_vllm.sh), never beside this package."""
    extras = _project()["optional-dependencies"]
    for name, requirements in extras.items():
        assert name != "vllm" and not any(r.startswith("vllm") for r in requirements), name


ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"
WORDS = {"clora_feedback.": "the package", "fastapi": "HTTP", "aiokafka": "Kafka", "vllm": "vLLM",
         "torch": "torch", "benchmarks": "benchmarks/"}  # fmt: skip
"""How docs/architecture.md's room table names what a FORBIDDEN row lists."""


def _room_table() -> dict[str, set[str]]:
    """docs/architecture.md's rooms: `clora_feedback.<room>` -> its "must not import" words."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Rooms, lowest layer first", 1)[1].split("\n## ", 1)[0]
    rooms: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 3 or cells[0] in ("room", "---"):
            continue
        for room in re.findall(r"`([a-z_]+)(?:\.py|/)`", cells[0]):
            words = {w.strip() for w in cells[2].split(",")} - {"-", ""}
            rooms[f"clora_feedback.{room}"] = words
    return rooms


def _words(forbidden: tuple[str, ...]) -> set[str]:
    return {WORDS.get(f, f.removeprefix("clora_feedback.")) for f in forbidden}


def test_the_architecture_room_table_lists_every_room() -> None:
    tops = {".".join(m.split(".")[:2]) for m in MODULES} | {"clora_feedback.errors", "clora_feedback.config"}  # fmt: skip
    assert set(_room_table()) == tops


def test_the_architecture_room_table_states_each_rooms_rule() -> None:
    table = _room_table()
    for room, words in table.items():
        assert words == _words(FORBIDDEN.get(room, ())), room
