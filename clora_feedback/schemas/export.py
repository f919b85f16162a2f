"""Generate the `connectors/` contract from the pydantic models.

`python -m clora_feedback.schemas.export [ROOT]` (re)writes:

- `connectors/schemas/<kind>.schema.json` and `feedback-event.schema.json`
  (the union, discriminated by `kind`), JSON Schema 2020-12;
- `connectors/examples/<name>.json`: example payloads, validated against the models;
- `connectors/topics.json`: the Kafka topics, their keys and headers.

`tests/test_connectors_contract.py` regenerates into a temp dir and fails on any drift.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from clora_feedback.config import FeedbackConfig
from clora_feedback.schemas.feedback import EVENT_TYPES, FeedbackEvent, parse_event

EXAMPLES: dict[str, dict[str, Any]] = {
    "correction-edited": {
        "kind": "correction",
        "event_id": "gh-pr-1842-review-3",
        "agent": "coding-agent",
        "completion_id": "chatcmpl-6f1c2a9e4b7d4f0e8a1b2c3d",
        "source": "github",
        "occurred_at": "2026-11-29T10:15:00Z",
        "corrected_content": "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n",
        "comment": "handle the empty list",
    },
    "correction-diff": {
        "kind": "correction",
        "event_id": "ide-7731",
        "agent": "coding-agent",
        "completion_id": "chatcmpl-0a9b8c7d6e5f4a3b2c1d0e9f",
        "source": "vscode",
        "occurred_at": "2026-11-29T10:16:00Z",
        "diff": "@@ -1 +1 @@\n-return a+b\n+return a + b\n",
    },
    "correction-accepted": {
        "kind": "correction",
        "event_id": "ide-7732",
        "agent": "coding-agent",
        "completion_id": "chatcmpl-1b2c3d4e5f6a7b8c9d0e1f2a",
        "source": "vscode",
        "occurred_at": "2026-11-29T10:17:00Z",
    },
    "resolution-resolved": {
        "kind": "resolution",
        "event_id": "zendesk-ticket-99121-solved",
        "agent": "support-agent",
        "conversation_id": "ticket-99121",
        "source": "zendesk",
        "occurred_at": "2026-11-29T11:00:00Z",
        "outcome": "resolved",
        "score": 0.8,
        "resolution_text": "Customer confirmed the refund arrived.",
    },
    "resolution-escalated": {
        "kind": "resolution",
        "event_id": "zendesk-ticket-99122-escalated",
        "agent": "support-agent",
        "completion_ids": [
            "chatcmpl-2c3d4e5f6a7b8c9d0e1f2a3b",
            "chatcmpl-3d4e5f6a7b8c9d0e1f2a3b4c",
        ],
        "source": "zendesk",
        "occurred_at": "2026-11-29T11:05:00Z",
        "outcome": "escalated",
    },
    "correction-kept": {
        "kind": "correction",
        "event_id": "ide-7733-kept-10min",
        "agent": "coding-agent",
        "completion_id": "chatcmpl-5f6a7b8c9d0e1f2a3b4c5d6e",
        "source": "vscode",
        "occurred_at": "2026-11-29T10:27:00Z",
        "verdict": "edited_and_kept",
        "corrected_content": "total = sum(prices)\n",
    },
    "correction-rejected": {
        "kind": "correction",
        "event_id": "ide-7734",
        "agent": "coding-agent",
        "completion_id": "chatcmpl-6a7b8c9d0e1f2a3b4c5d6e7f",
        "source": "vscode",
        "occurred_at": "2026-11-29T10:28:00Z",
        "verdict": "rejected",
    },
    "resolution-rerouted": {
        "kind": "resolution",
        "event_id": "zendesk-ticket-99123-rerouted",
        "agent": "support-agent",
        "completion_id": "chatcmpl-7b8c9d0e1f2a3b4c5d6e7f8a",
        "source": "zendesk",
        "occurred_at": "2026-11-29T11:10:00Z",
        "outcome": "resolved",
        "correct_answer": "billing",
        "resolution_text": "Rerouted from technical to billing; refund issued.",
    },
    "reward": {
        "kind": "reward",
        "event_id": "ci-run-5521",
        "agent": "coding-agent",
        "completion_id": "chatcmpl-4e5f6a7b8c9d0e1f2a3b4c5d",
        "source": "ci",
        "occurred_at": "2026-11-29T12:00:00Z",
        "value": 1.0,
        "name": "tests_passed",
    },
}


def topics() -> dict[str, Any]:
    kafka = FeedbackConfig().kafka
    key = "the agent name (UTF-8), so one agent's feedback stays ordered in one partition"
    return {
        "topics": [
            {
                "name": kafka.corrections_topic,
                "key": key,
                "value": "schemas/correction.schema.json",
            },
            {
                "name": kafka.resolutions_topic,
                "key": key,
                "value": "schemas/resolution.schema.json",
            },
            {"name": kafka.rewards_topic, "key": key, "value": "schemas/reward.schema.json"},
            {
                "name": kafka.dead_letter_topic,
                "key": "the original record's key (cut to 1024 bytes in an envelope)",
                "value": "the original record's bytes, unchanged; a record that would not fit "
                "`dead_letter_max_bytes` whole is sent as a UTF-8 JSON envelope instead: "
                '{"clora_truncated": true, "topic", "partition", "offset", "key", "size", '
                '"reason", "value_prefix"}',
                "headers": {
                    "clora.reason": "why the record was refused (UTF-8 text)",
                    "clora.source.topic": "original topic",
                    "clora.source.partition": "original partition (decimal)",
                    "clora.source.offset": "original offset (decimal)",
                },
            },
        ],
        "delivery": "at-least-once; consumers apply each event_id once, offsets committed after the durable write",
        "limits": {
            "max_record_bytes": kafka.max_record_bytes,
            "dead_letter_max_bytes": kafka.dead_letter_max_bytes,
            "over_max_record_bytes": "dead-lettered unparsed, reason `too_large: ...`",
        },
        "value_encoding": "UTF-8 JSON, one event per record; any topic accepts any kind (routing is by `kind`)",
    }


def render() -> dict[str, str]:
    """Relative path -> file content of the whole contract."""
    files: dict[str, str] = {}
    for kind, model in EVENT_TYPES.items():
        files[f"schemas/{kind}.schema.json"] = _json(model.model_json_schema())
    union = TypeAdapter(FeedbackEvent).json_schema()
    union["title"] = "FeedbackEvent"
    files["schemas/feedback-event.schema.json"] = _json(union)
    for name, payload in EXAMPLES.items():
        parse_event(payload)  # an example that does not validate is a bug here, not in a consumer
        files[f"examples/{name}.json"] = _json(payload)
    files["topics.json"] = _json(topics())
    return files


def write(root: Path) -> list[Path]:
    written = []
    for rel, content in render().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written


def _json(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    root = (
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else Path(__file__).resolve().parents[2] / "connectors"
    )
    for p in write(root):
        print(p)
