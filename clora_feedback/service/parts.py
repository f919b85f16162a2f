"""The parts every role of the composition root shares: the model, the stores, the registry.

`resolve_model` (the model directory and its public name), `open_stores` (the
feedback store over its trajectory reader, with the one reward policy),
`open_registry` (the adapter versions, recording and checking the base's
identity), `trainable` (which agents a trainer trains), `policy_model` (the
trainer's model), `register_initial` (the one path of a configured agent's
initial adapter into the registry).

Not here: assembling a role (`gateway`, `workers`), flags (`clora_feedback.cli`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from clora_feedback.config import DEFAULT_MODEL, Settings
from clora_feedback.engine.base import Engine
from clora_feedback.engine.embedded import EmbeddedEngine, resolve_device
from clora_feedback.errors import ConflictError
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.hardware import DTYPES, dtype_name, resolve_dtype
from clora_feedback.lora.weights import LoRALimits
from clora_feedback.model.resolve import resolve_model_dir
from clora_feedback.store.db import is_postgres_url
from clora_feedback.store.provenance import base_identity
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import TrajectoryStore
from clora_feedback.train.policy import DecoderPolicy, PolicyModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Model:
    """The base model: its directory and the public name requests and versions use."""

    directory: Path
    name: str


def resolve_model(settings: Settings) -> Model:
    """Resolve `engine.model` (converting the default once); the default keeps its name,
    a model directory is named by its last component."""
    directory = resolve_model_dir(settings.engine.model, settings.model_cache_dir)
    name = DEFAULT_MODEL if settings.engine.model == DEFAULT_MODEL else directory.name
    return Model(directory, name)


@dataclass(frozen=True)
class Stores:
    """The feedback store over its own trajectory reader, and the reward policy it applies."""

    policy: DefaultRewardPolicy
    trajectories: TrajectoryStore
    feedback: FeedbackStore

    def close(self) -> None:
        self.feedback.close()
        self.trajectories.close()


def open_stores(settings: Settings, url: str | Path | None = None) -> Stores:
    """The trajectory store and the feedback store joined through it, at `url` (default
    `settings.trajectory_db_url`: with `store_url`, one PostgreSQL database for every store;
    else SQLite under `data_dir`), scoring with the configured reward policy."""
    url = settings.trajectory_db_url if url is None else url
    policy = DefaultRewardPolicy(settings.feedback)  # rewards made when samples are read
    trajectories = TrajectoryStore(url)
    try:
        feedback = FeedbackStore(url, trajectories=trajectories, policy=policy)
    except BaseException:
        trajectories.close()
        raise
    return Stores(policy, trajectories, feedback)


def open_registry(settings: Settings, model: Model) -> AdapterRegistry:
    """The adapter registry; its versions record (and its loads check) the base's identity."""
    return AdapterRegistry(
        settings.adapters_dir,
        settings.registry_db_url,
        base_identity=base_identity(model.directory, model.name),
    )


def trainable(
    feedback: FeedbackStore, known: Callable[[], Collection[str]] | None
) -> Callable[[], list[str]]:
    """The agents a trainer trains: those with rewards that `known` names (None: all of them,
    as a trainer worker with no agents configured does)."""

    def trainable() -> list[str]:
        names = None if known is None else set(known())
        return [a for a in feedback.agents_with_rewards() if names is None or a in names]

    return trainable


def policy_model(settings: Settings, model: Model, engine: Engine | None) -> PolicyModel:
    """The trainer's model: the embedded engine's own base tensors, else its own copy.

    Sharing is the one-box memory win (the trainer only reads the base); any
    other engine (or a trainer in another process) gets a copy from the model directory.
    """
    compute = resolve_dtype(settings.trainer.compute_dtype, resolve_device(settings.engine.device))
    log.info(
        "trainer: compute dtype %s (trainer.compute_dtype %s)",
        dtype_name(compute),
        settings.trainer.compute_dtype,
    )
    mismatch = dtype_mismatch(settings, compute)
    if mismatch is not None:
        log.warning(mismatch)
    if isinstance(engine, EmbeddedEngine):
        return DecoderPolicy.shared_with(engine, compute_dtype=compute)
    return DecoderPolicy.from_dir(
        model.directory,
        max_lora_rank=settings.engine.max_lora_rank,
        target_modules=tuple(settings.engine.lora_target_modules),
        model_name=model.name,
        max_model_len=settings.engine.max_model_len,
        dtype=compute,
        device=resolve_device(settings.engine.device),
    )


def serving_dtype(settings: Settings) -> tuple[torch.dtype, str] | None:
    """The dtype the serving engine computes in and the setting that says so, where the
    settings say: the embedded engine's (`engine.dtype`), or a local vLLM server's explicit
    `--dtype` (`engine.vllm.local.dtype`); None when they do not (servers at
    `engine.vllm.urls`, a local server on `auto`)."""
    engine = settings.engine
    if engine.kind == "embedded":
        return resolve_dtype(engine.dtype, resolve_device(engine.device)), "engine.dtype"
    local = engine.vllm.local
    if not engine.vllm.urls and local.enabled and local.dtype != "auto":
        return DTYPES[local.dtype], "engine.vllm.local.dtype"
    return None


def dtype_mismatch(settings: Settings, compute: torch.dtype) -> str | None:
    """The warning for a trainer computing in another dtype than the engine serves in, else None.

    Behaviour logprobs come from the serving engine; the trainer scores the same tokens in
    its compute dtype. In bf16 a LoRA update smaller than half a unit in the last place of
    the base projection's output is rounded away, so a bf16 pass sees less of a trained
    adapter than an fp32 one: against fp32 behaviour logprobs the importance ratios of a
    bf16 trainer drift as the adapter trains, and the clipped objective drops the samples
    it should learn from (`python -m benchmarks.precision --serving float32`: its clipped
    fractions and curve).
    """
    serving = serving_dtype(settings)
    if serving is None or serving[0] == compute:
        return None
    dtype, setting = serving
    return (
        f"trainer.compute_dtype resolves to {dtype_name(compute)} but the engine serves in "
        f"{dtype_name(dtype)} ({setting}): the trainer's log-probabilities drift from the "
        "behaviour log-probabilities as the adapter trains, and clipped samples teach "
        f"nothing; keep trainer.compute_dtype and {setting} alike"
    )


def pointer_listen_url(settings: Settings) -> str | None:
    """The registry's URL when the deployer LISTENs on it (PostgreSQL and `engine.adapter_notify`),
    else None (polling only; always so on SQLite)."""
    url = settings.registry_db_url
    return str(url) if settings.engine.adapter_notify and is_postgres_url(url) else None


def register_initial(
    registry: AdapterRegistry, agent: str, path: Path, base_model: str, limits: LoRALimits
) -> None:
    """Import a configured agent's adapter as its version 1, once; an agent an operator
    unloaded (versions, no active pointer) stays on the base model across restarts."""
    try:
        registry.register_initial(agent, path, base_model=base_model, limits=limits)
    except ConflictError as exc:
        if exc.code != "no_active_version":
            raise
        log.info("agent %s: unloaded earlier; the base model serves it", agent)


def register_configured(
    settings: Settings, registry: AdapterRegistry, base_model: str, limits: LoRALimits
) -> None:
    for agent in settings.agents:  # initial adapters become version 1, once
        if agent.adapter_path is not None:
            register_initial(registry, agent.name, agent.adapter_path, base_model, limits)


def engine_settings(settings: Settings) -> Settings:
    """`engine.kind: vllm` with no server URL: start and supervise one locally (its log
    under `data_dir` unless set)."""
    vllm = settings.engine.vllm
    if settings.engine.kind != "vllm" or vllm.urls:
        return settings
    local = vllm.local.model_copy(
        update={"enabled": True, "log_dir": vllm.local.log_dir or settings.data_dir / "vllm"}
    )
    engine = settings.engine.model_copy(update={"vllm": vllm.model_copy(update={"local": local})})
    return settings.model_copy(update={"engine": engine})
