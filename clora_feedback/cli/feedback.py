"""`clora feedback send`: send feedback events from the command line.

Events come from a file (`--file events.json`, `--file -` for stdin: one JSON
object, a JSON list, or JSON Lines) or from flags describing one event:

    clora feedback send --url http://127.0.0.1:8000 --api-key KEY \\
        --kind resolution --agent support --completion-id chatcmpl-... --outcome resolved

Delivery is the webhook (`--url`, with `--api-key`, and `--secret` to sign
each request as `t=<unix seconds>,v1=<hex>`; repeat `--secret` during a
rotation) or Kafka (`--kafka host:port`). Events without an `event_id` get a fresh one.
The receipt is printed as JSON on stdout.

Exit status: 0 when every event was taken (joined, parked, duplicate or produced),
1 when the send failed or some event was rejected, 2 for bad arguments.

Not here: the parser of the other commands (`clora_feedback.cli.main` wires this in).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from clora_feedback.client import FeedbackClient, to_events
from clora_feedback.errors import CloraError

DEFAULT_URL = "http://127.0.0.1:8000"


def add_feedback_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `feedback send` to the `clora` parser's subcommands (sets `func`)."""
    feedback = subparsers.add_parser("feedback", help="Send feedback events.")
    actions = feedback.add_subparsers(dest="feedback_command", required=True)
    send = actions.add_parser(
        "send",
        help="Send corrections, resolutions or rewards by webhook or Kafka.",
        description="Send feedback events from --file (JSON, a JSON list or JSON Lines; '-' "
        "for stdin) or one event described by flags, to the gateway's webhook or to Kafka.",
    )
    where = send.add_argument_group("delivery")
    where.add_argument("--url", default=None, help=f"Gateway URL (default {DEFAULT_URL}).")
    where.add_argument("--api-key", default=None, help="Bearer API key for the webhook.")
    where.add_argument(
        "--secret",
        action="append",
        default=None,
        help="Webhook secret: sign each request (timestamped HMAC); repeat while rotating.",
    )
    where.add_argument("--kafka", default=None, metavar="BOOTSTRAP", help="Produce to Kafka.")
    where.add_argument("--timeout", type=float, default=30.0, help="Seconds per attempt.")

    source = send.add_argument_group("events from a file")
    source.add_argument(
        "--file", default=None, help="JSON object, list or JSON Lines; '-' reads stdin."
    )

    one = send.add_argument_group("one event from flags")
    one.add_argument("--kind", choices=["correction", "resolution", "reward"])
    one.add_argument("--agent", help="The agent judged.")
    one.add_argument(
        "--completion-id", action="append", default=[], help="Completion id (repeatable)."
    )
    one.add_argument("--conversation-id", help="Judge every completion of this conversation.")
    one.add_argument("--event-id", help="Idempotency key (default: a fresh uuid4).")
    one.add_argument("--source", default="cli", help="Who produced the event (default cli).")
    one.add_argument("--outcome", help="resolution: resolved, escalated, reopened, ...")
    one.add_argument("--score", type=float, help="resolution: satisfaction in [0, 1].")
    one.add_argument("--text", help="resolution: the resolution note (stored, not trained on).")
    one.add_argument(
        "--correct-answer",
        help="resolution: what the agent should have answered (one --completion-id); a "
        "different output trains toward it.",
    )
    one.add_argument("--corrected", help="correction: the corrected output.")
    one.add_argument(
        "--corrected-file", type=Path, help="correction: read the corrected output from a file."
    )
    one.add_argument(
        "--diff-file", type=Path, help="correction: a unified diff against the output."
    )
    one.add_argument("--comment", help="correction: why it was changed.")
    one.add_argument(
        "--verdict",
        choices=["accepted", "corrected", "edited_and_kept", "rejected", "ignored"],
        help="correction: the developer's verdict (default: corrected with an edit, else "
        "accepted).",
    )
    one.add_argument("--value", type=float, help="reward: the scalar.")
    one.add_argument("--name", help="reward: what it measures.")
    send.set_defaults(func=run_send, feedback_parser=send)


def _read_file(name: str) -> Any:
    text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        # Not one JSON value: JSON Lines, one event per non-empty line.
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _event_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "kind": args.kind,
        "agent": args.agent,
        "event_id": args.event_id,
        "source": args.source,
        "conversation_id": args.conversation_id,
    }
    ids: list[str] = args.completion_id
    if len(ids) == 1:
        fields["completion_id"] = ids[0]
    elif ids:
        fields["completion_ids"] = ids
    if args.kind == "resolution":
        fields.update(
            outcome=args.outcome,
            score=args.score,
            resolution_text=args.text,
            correct_answer=args.correct_answer,
        )
    elif args.kind == "correction":
        corrected = args.corrected_file.read_text() if args.corrected_file else args.corrected
        diff = args.diff_file.read_text() if args.diff_file else None
        fields.update(
            corrected_content=corrected, diff=diff, comment=args.comment, verdict=args.verdict
        )
    else:
        fields.update(value=args.value, name=args.name)
    return {k: v for k, v in fields.items() if v is not None}


def run_send(args: argparse.Namespace) -> int:
    """Run `clora feedback send`; returns the exit status."""
    parser: argparse.ArgumentParser = args.feedback_parser
    if (args.file is None) == (args.kind is None):
        parser.error("give either --file or --kind (with --agent and the event's fields)")
    if args.url is not None and args.kafka is not None:
        parser.error("give --url or --kafka, not both")
    if args.kind is not None and args.agent is None:
        parser.error("--kind needs --agent")
    try:
        data = _read_file(args.file) if args.file is not None else _event_from_flags(args)
        events = to_events(data, source=args.source)
        url = None if args.kafka else (args.url or DEFAULT_URL)
        with FeedbackClient(
            url,
            api_key=args.api_key,
            webhook_secret=args.secret,
            kafka_bootstrap=args.kafka,
            source=args.source,
            timeout_s=args.timeout,
        ) as client:
            receipt = client.send(events)
    except (OSError, ValueError) as exc:
        print(f"clora feedback send: {exc}", file=sys.stderr)
        return 1
    except CloraError as exc:
        where = f" ({exc.param})" if exc.param else ""
        print(f"clora feedback send: {exc.message}{where}", file=sys.stderr)
        return 1
    print(receipt.model_dump_json(indent=2))
    return 1 if receipt.rejected else 0
