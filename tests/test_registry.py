"""The adapter registry: publish/list/load, PEFT compatibility, rollback, pin, crash safety, hashes.

Weights are random LoRA adapters shaped for the tiny test model (hidden 64,
intermediate 128, 4 heads x 16, 2 KV heads -> k/v out 32, 2 layers), so a
published directory loads in `peft.PeftModel.from_pretrained` on that model.
Crash safety is tested with a real SIGKILL of a child process at three points
of a publish (while writing, after writing but before the rename, after the
rename but before the commit).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from clora_feedback.config import DEFAULT_TARGET_MODULES
from clora_feedback.errors import (
    AdapterError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    StoreError,
)
from clora_feedback.lora.peft_io import WEIGHTS_NAME, save_peft_adapter
from clora_feedback.lora.weights import LoRALimits, LoRAWeights, random_lora_weights
from clora_feedback.store.artifact import MANIFEST_NAME, OPTIMIZER_NAME, content_hash, file_sha256
from clora_feedback.store.registry import AdapterRegistry, VersionInfo

TINY_SHAPES = {
    "q_proj": (64, 64),
    "k_proj": (64, 32),
    "v_proj": (64, 32),
    "o_proj": (64, 64),
    "gate_proj": (64, 128),
    "up_proj": (64, 128),
    "down_proj": (128, 64),
}
LIMITS = LoRALimits(
    max_rank=16, target_modules=DEFAULT_TARGET_MODULES, num_layers=2, shapes=TINY_SHAPES
)


def _weights(seed: int, rank: int = 4) -> LoRAWeights:
    return random_lora_weights(LIMITS, rank=rank, alpha=8.0, seed=seed)


def _optimizer(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "exp_avg": torch.randn(100, generator=gen),
        "exp_avg_sq": torch.rand(100, generator=gen),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def _publish(
    registry: AdapterRegistry, agent: str, seed: int, parent: int | None, **kwargs: object
) -> VersionInfo:
    args: dict[str, object] = {
        "optimizer_state": _optimizer(seed),
        "base_model": "tiny-base",
        "parent": parent,
        "step": seed,
        "metrics": {"loss": 1.0 / seed, "reward_mean": seed / 10},
        "feedback_window": {"after_seq": seed * 10, "samples": 8},
        **kwargs,
    }
    return registry.publish(agent, _weights(seed), **args)  # type: ignore[arg-type]


@pytest.fixture
def registry(tmp_path: Path, store_url: str) -> Iterator[AdapterRegistry]:
    """The same suite on both backends: a SQLite file, then a fresh PostgreSQL database."""
    with AdapterRegistry(tmp_path / "adapters", db=store_url) as reg:
        yield reg


def _assert_same_weights(a: LoRAWeights, b: LoRAWeights) -> None:
    assert (a.rank, a.alpha, sorted(a.tensors)) == (b.rank, b.alpha, sorted(b.tensors))
    for key, (a_a, a_b) in a.tensors.items():
        assert torch.equal(a_a, b.tensors[key][0]) and torch.equal(a_b, b.tensors[key][1])


def test_publish_list_load_round_trip(
    registry: AdapterRegistry, tmp_path: Path, store_url: str
) -> None:
    v1 = _publish(registry, "support", 1, None)
    v2 = _publish(registry, "support", 2, 1)
    assert (v1.version, v2.version) == (1, 2)
    assert v2.path == tmp_path / "adapters" / "support" / "2"
    assert sorted(p.name for p in v2.path.iterdir()) == sorted(
        ["adapter_config.json", WEIGHTS_NAME, OPTIMIZER_NAME, MANIFEST_NAME]
    )
    listed = registry.versions("support")
    assert [(v.version, v.status, v.parent) for v in listed] == [
        (1, "superseded", None),
        (2, "active", 1),
    ]
    assert listed[1].metrics == {"loss": 0.5, "reward_mean": 0.2}
    assert listed[1].feedback_window == {"after_seq": 20, "samples": 8}
    active = registry.active("support")
    assert active is not None and active.version == 2

    weights, optimizer = registry.load("support", 1)
    _assert_same_weights(weights, _weights(1))
    assert optimizer is not None
    for name, tensor in _optimizer(1).items():
        assert torch.equal(optimizer[name], tensor)

    manifest = registry.manifest("support", 2)
    assert (manifest["parent"], manifest["step"], manifest["version"]) == (1, 2, 2)
    assert manifest["content_hash"] == v2.content_hash
    files = {n: file_sha256(v2.path / n) for n in manifest["files"]}
    assert content_hash(files) == v2.content_hash

    (info,) = registry.agents()
    assert (info.agent, info.active_version, info.num_versions, info.latest_version) == (
        "support",
        2,
        2,
        2,
    )
    assert info.activated_by == "publish" and not info.pinned
    # No temp directory survives a successful publish.
    assert not [p for p in (tmp_path / "adapters" / "support").iterdir() if p.name.startswith(".")]

    # Everything is durable: a new registry on the same files sees the same state.
    registry.close()
    with AdapterRegistry(tmp_path / "adapters", db=store_url) as again:
        assert again.versions("support") == listed
        _assert_same_weights(again.load("support", 2)[0], _weights(2))


def test_published_version_loads_in_peft(registry: AdapterRegistry, tiny_model_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    info = _publish(registry, "support", 3, None, base_model=str(tiny_model_dir))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        base_logits = base(ids).logits
    model = PeftModel.from_pretrained(base, str(info.path))
    params = dict(model.named_parameters())
    expected = _weights(3)
    a, b = expected.tensors["layers.1.mlp.down_proj"]
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(params[f"{prefix}.lora_A.default.weight"], a)
    assert torch.equal(params[f"{prefix}.lora_B.default.weight"], b)
    with torch.no_grad():
        lora_logits = model(ids).logits
    assert (lora_logits - base_logits).abs().max() > 1e-3  # the adapter is really applied


def test_rollback_marks_later_versions_and_training_continues_from_k(
    registry: AdapterRegistry,
) -> None:
    for seed in range(1, 5):
        _publish(registry, "support", seed, seed - 1 or None)
    target = registry.rollback("support", 2, reason="reward dropped after v3")
    assert target.version == 2 and target.status == "active"
    by_version = {v.version: v for v in registry.versions("support")}
    assert [by_version[v].status for v in (1, 2, 3, 4)] == [
        "superseded",
        "active",
        "rolled_back",
        "rolled_back",
    ]
    assert by_version[3].rolled_back_reason == "reward dropped after v3"
    assert registry.agent("support").activated_by == "rollback"
    # Training resumes from k's weights and optimizer state.
    weights, optimizer = registry.load("support", 2)
    _assert_same_weights(weights, _weights(2))
    assert optimizer is not None and int(optimizer["step"]) == 2

    with pytest.raises(ConflictError) as already:
        registry.rollback("support", 2, reason="again")
    assert already.value.code == "already_active"
    with pytest.raises(NotFoundError):
        registry.rollback("support", 9, reason="no such version")
    with pytest.raises(NotFoundError):
        registry.rollback("nobody", 1, reason="no such agent")
    with pytest.raises(InvalidRequestError):
        registry.rollback("support", 1, reason="  ")
    with pytest.raises(ConflictError) as moved:
        registry.rollback("support", 1, reason="guard", expected_active=4)
    assert moved.value.code == "active_changed"

    # A step computed on top of the rolled-back version cannot undo the rollback.
    with pytest.raises(ConflictError) as stale:
        _publish(registry, "support", 5, 4)
    assert stale.value.code == "parent_not_active"
    v5 = _publish(registry, "support", 5, 2)
    assert v5.version == 5  # refused before a number was reserved
    statuses = {v.version: v.status for v in registry.versions("support")}
    assert statuses == {
        1: "superseded",
        2: "superseded",
        3: "rolled_back",
        4: "rolled_back",
        5: "active",
    }

    # Undoing a mistaken rollback: v4 active again, v5 marked, v3 keeps its mark.
    registry.rollback("support", 4, reason="operator undo")
    statuses = {v.version: (v.status, v.rolled_back_reason) for v in registry.versions("support")}
    assert statuses[4] == ("active", None)
    assert statuses[5] == ("rolled_back", "operator undo")
    assert statuses[3] == ("rolled_back", "reward dropped after v3")


def test_pin_freezes_publishing(registry: AdapterRegistry) -> None:
    _publish(registry, "support", 1, None)
    assert not registry.is_pinned("support") and not registry.is_pinned("unknown")
    assert registry.pin("support").pinned
    assert registry.pin("support").pinned  # idempotent
    assert registry.is_pinned("support")
    with pytest.raises(ConflictError) as pinned:
        _publish(registry, "support", 2, 1)
    assert pinned.value.code == "agent_pinned"
    # A pinned agent can still be rolled back (pin freezes training, not operators).
    assert not registry.unpin("support").pinned
    assert _publish(registry, "support", 3, 1).status == "active"
    with pytest.raises(NotFoundError):
        registry.pin("unknown")


def test_staged_publish_and_version_reservation(registry: AdapterRegistry) -> None:
    assert registry.next_version("support") == 1  # e.g. a runtime-loaded adapter took 1
    v = _publish(registry, "support", 1, None)
    assert v.version == 2
    staged = _publish(registry, "support", 2, 2, activate=False)
    assert staged.status == "staged"
    active = registry.active("support")
    assert active is not None and active.version == 2


def test_versions_of_an_unloaded_agent_are_inactive(registry: AdapterRegistry) -> None:
    _publish(registry, "support", 1, None)
    _publish(registry, "support", 2, 1)
    registry.deactivate("support", expected_active=2)
    assert registry.active("support") is None and registry.agent("support").deactivated
    assert [v.status for v in registry.versions("support")] == ["inactive", "inactive"]
    # Published after the unload without being activated: staged, not inactive.
    assert _publish(registry, "support", 3, None, activate=False).status == "staged"
    assert registry.get("support", 1).status == "inactive"
    # A rollback activates an inactive version again; the statuses follow the pointer.
    registry.rollback("support", 1, reason="back to the first")
    assert [v.status for v in registry.versions("support")] == [
        "active",
        "rolled_back",
        "rolled_back",
    ]


def test_bad_inputs_are_refused(registry: AdapterRegistry, tmp_path: Path) -> None:
    for bad in ("../escape", ".hidden", "a/b", ""):
        with pytest.raises(InvalidRequestError):
            _publish(registry, bad, 1, None)
    with pytest.raises(NotFoundError):
        _publish(registry, "support", 1, 7)
    with pytest.raises(InvalidRequestError):
        _publish(registry, "support", 1, None, feedback_window={"x": object()})
    info = _publish(registry, "support", 1, None, metrics={"loss": float("nan"), "kl": 0.1})
    assert info.metrics == {"loss": None, "kl": 0.1}
    assert not (tmp_path / "adapters" / "..").joinpath("escape").exists()


def test_register_initial_is_idempotent_and_validates(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    source = tmp_path / "initial"
    save_peft_adapter(_weights(7), source, base_model="tiny-base")
    first = registry.register_initial("support", source, limits=LIMITS)
    assert (first.version, first.parent, first.status, first.base_model) == (
        1,
        None,
        "active",
        "tiny-base",
    )
    assert registry.manifest("support", 1)["source"] == str(source.resolve())
    _assert_same_weights(registry.load("support", 1)[0], _weights(7))
    assert registry.load("support", 1)[1] is None
    _publish(registry, "support", 2, 1)
    # A restart does not revert what training produced.
    assert registry.register_initial("support", source).version == 2

    too_big = tmp_path / "too_big"
    save_peft_adapter(_weights(1, rank=32), too_big, base_model="tiny-base")
    with pytest.raises(AdapterError):
        registry.register_initial("sales", too_big, limits=LIMITS)
    assert registry.active("sales") is None


def test_hash_verification_catches_corruption(registry: AdapterRegistry) -> None:
    _publish(registry, "support", 1, None)
    info = _publish(registry, "support", 2, 1)
    weights_file = info.path / WEIGHTS_NAME
    data = bytearray(weights_file.read_bytes())
    data[-3] ^= 0xFF  # one flipped bit pattern inside a tensor: still valid safetensors
    weights_file.write_bytes(bytes(data))
    with pytest.raises(StoreError) as corrupt:
        registry.load("support", 2)
    assert corrupt.value.code == "content_hash_mismatch"
    assert WEIGHTS_NAME in corrupt.value.message
    assert registry.load("support", 1)[0].rank == 4  # other versions are unaffected

    (registry.get("support", 1).path / OPTIMIZER_NAME).unlink()
    with pytest.raises(StoreError) as missing:
        registry.load("support", 1)
    assert missing.value.code == "version_files_missing"


def test_tree_of_another_registry_is_refused(tmp_path: Path) -> None:
    with AdapterRegistry(tmp_path / "adapters", tmp_path / "a.db") as first:
        _publish(first, "support", 1, None)
    with pytest.raises(StoreError):
        AdapterRegistry(tmp_path / "adapters", tmp_path / "b.db")
    # Refusing did not collect the other registry's versions.
    assert (tmp_path / "adapters" / "support" / "1" / MANIFEST_NAME).is_file()

    # Version-like directories nobody indexed (no store id at all) are not collected either.
    unmarked = tmp_path / "unmarked"
    save_peft_adapter(_weights(1), unmarked / "support" / "1", base_model="tiny-base")
    with pytest.raises(StoreError):
        AdapterRegistry(unmarked, tmp_path / "c.db")
    assert (unmarked / "support" / "1" / WEIGHTS_NAME).is_file()


_CRASH_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import torch
    from clora_feedback.config import DEFAULT_TARGET_MODULES
    from clora_feedback.lora import tensor_files
    from clora_feedback.lora.weights import LoRALimits, random_lora_weights
    from clora_feedback.store import artifact
    from clora_feedback.store.registry import core as registry_module

    root, db, point = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    shapes = {json_shapes}
    limits = LoRALimits(16, DEFAULT_TARGET_MODULES, 2, {{k: tuple(v) for k, v in shapes.items()}})

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "writing":
        tensor_files.os.fsync = die  # every payload file written, none yet durable
    elif point == "before_rename":
        artifact.os.rename = die  # every file and the manifest are written, not yet renamed
    elif point == "before_commit":
        registry_module.AdapterRegistry._commit_publish = die  # renamed, not yet in the index
    registry = registry_module.AdapterRegistry(root, db)
    registry.publish(
        "support",
        random_lora_weights(limits, rank=4, seed=2),
        optimizer_state={{"step": torch.tensor([2])}},
        base_model="tiny-base",
        parent=1,
        step=2,
        metrics={{}},
        feedback_window=None,
    )
    sys.exit(3)  # not reached: the publish must have been killed
    """
)


@pytest.mark.parametrize("point", ["writing", "before_rename", "before_commit"])
def test_kill_mid_publish_leaves_previous_version_active(
    tmp_path: Path, point: str, store_url: str
) -> None:
    root, db = tmp_path / "adapters", store_url
    with AdapterRegistry(root, db) as registry:
        _publish(registry, "support", 1, None)
    script = _CRASH_SCRIPT.format(json_shapes=json.dumps(TINY_SHAPES))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(root), str(db), point],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = sorted(p.name for p in (root / "support").iterdir())
    if point == "before_commit":
        assert "2" in leftovers  # the crash point really was after the rename
    else:
        assert any(name.startswith(".tmp-") for name in leftovers)

    with AdapterRegistry(root, db) as registry:
        active = registry.active("support")
        assert active is not None and active.version == 1
        assert [v.version for v in registry.versions("support")] == [1]
        with pytest.raises(NotFoundError):
            registry.load("support", 2)
        assert sorted(p.name for p in (root / "support").iterdir()) == ["1"]
        _assert_same_weights(registry.load("support", 1)[0], _weights(1))
        # Publishing resumes; the number lost to the crash is not reused.
        after = _publish(registry, "support", 3, 1)
        assert after.version == 3 and after.status == "active"
