"""Settings and live traffic for the release-path service tests, on the tiny model and on vLLM.

Not here: the release path itself (`clora_feedback.release`), the engines' fixtures
(`conftest`, `vllm_fixtures`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clora_feedback.config import (
    AgentConfig,
    EngineConfig,
    FeedbackConfig,
    KafkaConfig,
    Settings,
    TrainerConfig,
)


def release_settings(tmp_path: Path, engine: EngineConfig, agent: AgentConfig) -> Settings:
    """`agent` on `engine` with the release path on, everything under `tmp_path`.

    No embedded broker; the trainer publishes a candidate per 2 to 4 corrections; the
    gate holds out half the feedback and judges on 2 cases of 4 tokens; a passing
    candidate canaries on half the requests until an operator promotes it (its
    `min_feedback` of 1000 is never reached in a test).
    """
    return Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine=engine,
        agents=[agent],
        feedback=FeedbackConfig(kafka=KafkaConfig(embedded_broker=False)),
        trainer=TrainerConfig(admission={"min_batch": 2, "max_batch": 4}, poll_interval_s=0.1),  # type: ignore[arg-type]
        release={  # type: ignore[arg-type]
            "interval_s": 0.2,
            "gate": {"holdout_fraction": 0.5, "min_cases": 2, "max_tokens": 4},
            "canary": {"share": 0.5, "min_feedback": 1000},
        },
    )


def sticky_replies(
    client: Any, conversations: int = 16, turns: int = 2
) -> Iterator[tuple[int, Any]]:
    """Live traffic for agent `support`: `turns` replies in each of `conversations`
    conversations (`metadata.conversation_id`, which a canary's arm sticks to), each
    `(conversation, reply)` as it comes from the OpenAI `client`."""
    for c in range(conversations):
        for _ in range(turns):
            reply = client.chat.completions.create(
                model="support", messages=[{"role": "user", "content": "hi"}],
                max_tokens=2, metadata={"conversation_id": f"conv-{c}"},
            )  # fmt: skip
            yield c, reply
