"""`build_engine`: the one place that turns `engine.kind` into an `Engine`.

The composition root (`clora_feedback.service.build_service`) and anything else
that needs a serving engine from settings call this instead of naming an engine
class, so adding an engine is one branch here plus its module (and its entry in
`tests/test_engine_contract.py`).

Not here: the engines themselves (see `embedded`, `vllm`), adapter deployment (see `deployer`).
"""

from __future__ import annotations

from pathlib import Path

from clora_feedback.config import EngineConfig
from clora_feedback.engine.base import Engine
from clora_feedback.errors import ConfigError


def build_engine(config: EngineConfig, model_dir: Path, model_name: str) -> Engine:
    """Build the engine `config.kind` names (not started).

    Args:
        config: the engine settings.
        model_dir: the resolved base-model directory (Hugging Face layout).
        model_name: the public name of the base model (`/v1/models`).

    Raises:
        ConfigError: an unknown kind, or settings the kind cannot work with
            (e.g. `vllm` without `engine.vllm.urls` or `engine.vllm.local.enabled`).
    """
    if config.kind == "embedded":
        # Imported here: torch and the model load only when this engine is chosen.
        from clora_feedback.engine.embedded import EmbeddedEngine

        return EmbeddedEngine(model_dir, config, model_name=model_name)
    if config.kind == "vllm":
        from clora_feedback.engine.vllm import VLLMEngine
        from clora_feedback.engine.vllm.supervisor import VLLMSupervisor

        supervisor = None
        if not config.vllm.urls and config.vllm.local.enabled:  # one local server of our own
            supervisor = VLLMSupervisor(
                model_dir, config, served_model_name=config.vllm.served_model_name
            )
        return VLLMEngine(model_dir, config, model_name=model_name, supervisor=supervisor)
    raise ConfigError(f"unknown engine.kind {config.kind!r}", param="engine.kind")
