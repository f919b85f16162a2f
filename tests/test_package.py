"""Package hygiene: every module imports, layers point one way, every module says what it is."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import clora_feedback

ROOT = Path(clora_feedback.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(ROOT)], prefix="clora_feedback."))

# Lower layers must not reach up into higher ones (or into HTTP/Kafka/vLLM).
FORBIDDEN = {
    "clora_feedback.errors": ("clora_feedback.", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.config": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "fastapi"),
    "clora_feedback.schemas": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "fastapi", "aiokafka"),
    "clora_feedback.lora": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "clora_feedback.feedback", "fastapi", "aiokafka", "vllm"),
    "clora_feedback.engine": ("clora_feedback.gateway", "clora_feedback.train", "clora_feedback.feedback", "fastapi", "aiokafka"),
    "clora_feedback.store": ("clora_feedback.engine", "clora_feedback.gateway", "clora_feedback.train", "fastapi", "aiokafka"),
    "clora_feedback.train": ("clora_feedback.gateway", "fastapi", "aiokafka"),
    "clora_feedback.feedback": ("clora_feedback.gateway", "clora_feedback.train", "clora_feedback.engine"),
}  # fmt: skip


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
