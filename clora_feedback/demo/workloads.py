"""Workloads: an agent's side of one task through the OpenAI API, and the feedback it earns.

A workload pairs a task generator with a simulator holding the ground truth:

- `SupportWorkload`: one chat completion routes a ticket; the simulated
  operator resolves it (reward 1.0) or escalates it (0.0) and reroutes it to
  the right team (its `correct_answer`): a `Resolution`.
- `ToolUseWorkload`: a multi-turn tool loop (`calculator`, `final_answer`,
  `tool_choice="required"`); the checker rewards 1.0 only for the right
  final number: one `Reward` event judging every completion of the episode,
  optionally with a developer `Correction` carrying the right final call.
- `CodingWorkload`: one completion writes a Python expression; the simulated
  developer accepts it as-is or replaces it with the reference: a
  `Correction` (the reward comes from how much had to change).

`run_episode` talks to the gateway only through an `openai.AsyncOpenAI`
client, exactly like an outside agent; `feedback` builds the events and
leaves delivery (webhook or Kafka) to the caller.

Not here: the optimisation loop (see `experiment`), the live display (see `demo`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from clora_feedback.demo import arithmetic, coding, support
from clora_feedback.schemas.feedback import Correction, Event, Resolution, Reward

if TYPE_CHECKING:
    from openai import AsyncOpenAI

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Sampling:
    """How the agent samples (exploration during training, greedy for evaluation).

    Attributes:
        temperature: 0 is greedy.
        top_p: nucleus mass.
        seed: per-request seed (None: the engine's own randomness).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def for_turn(self, turn: int) -> Sampling:
        """The parameters of a later turn of the same episode (its own seed)."""
        seed = None if self.seed is None else self.seed + 1000 * turn
        return Sampling(self.temperature, self.top_p, seed)


@dataclass
class Episode:
    """One task attempted by an agent.

    Attributes:
        task_id: the task's id.
        completion_ids: every completion the episode made, in order.
        reward: the simulator's reward in [0, 1].
        answer: what the agent answered, as text (routing, final number, code).
        versions: adapter version of each completion's first token.
        prompt_tokens: prompt tokens over all completions.
        completion_tokens: generated tokens over all completions.
        trace: per completion, what the agent did (workload-specific, for reviews).
    """

    task_id: str
    completion_ids: list[str] = field(default_factory=list)
    reward: float = 0.0
    answer: str | None = None
    versions: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    trace: list[Any] = field(default_factory=list)


class Workload(Protocol):
    """A task family with its simulator."""

    name: str
    feedback_kind: str
    """Event kind the simulator sends (`resolution`, `reward`, `correction`)."""

    def tasks(self, seed: int, split: Split, count: int) -> list[Any]:
        """Deterministic tasks of a split."""
        ...

    async def run_episode(
        self, client: AsyncOpenAI, agent: str, task: Any, sampling: Sampling
    ) -> Episode:
        """Attempt `task` as `agent` through the gateway and score it."""
        ...

    def feedback(self, agent: str, task: Any, episode: Episode, *, event_id: str) -> list[Event]:
        """The events the simulator sends about `episode` (ids derived from `event_id`)."""
        ...


async def _single_turn(
    client: AsyncOpenAI,
    agent: str,
    task_id: str,
    messages: list[dict[str, Any]],
    sampling: Sampling,
    max_tokens: int,
    stop: list[str] | None = None,
) -> tuple[Episode, str | None]:
    """One chat completion as a whole episode; returns it (accounted) and the reply text."""
    episode = Episode(task_id)
    reply = await client.chat.completions.create(
        model=agent,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        stop=stop,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
    )
    _account(episode, reply)
    return episode, reply.choices[0].message.content


def _account(episode: Episode, reply: Any) -> None:
    episode.completion_ids.append(reply.id)
    extra = reply.model_extra or {}
    episode.versions.append(int(extra.get("clora", {}).get("adapter_version", 0)))
    if reply.usage is not None:
        episode.prompt_tokens += reply.usage.prompt_tokens
        episode.completion_tokens += reply.usage.completion_tokens


class SupportWorkload:
    """Ticket routing judged by a simulated operator (resolutions)."""

    name = "support"
    feedback_kind = "resolution"

    def __init__(self, max_tokens: int = 4):
        self.max_tokens = max_tokens
        self.operator = support.SimulatedOperator()

    def tasks(self, seed: int, split: Split, count: int) -> list[support.Ticket]:
        return support.tickets(seed, split, count)

    async def run_episode(
        self, client: AsyncOpenAI, agent: str, task: support.Ticket, sampling: Sampling
    ) -> Episode:
        episode, text = await _single_turn(
            client, agent, task.id, task.messages(), sampling, self.max_tokens, stop=["\n"]
        )
        verdict = self.operator.judge(task, text)
        episode.reward, episode.answer = verdict.reward, verdict.routed_to or (text or "")
        return episode

    def feedback(
        self, agent: str, task: support.Ticket, episode: Episode, *, event_id: str
    ) -> list[Event]:
        right = episode.reward > 0
        return [
            Resolution(
                event_id=event_id,
                agent=agent,
                completion_id=episode.completion_ids[-1],
                source="simulated-operator",
                outcome="resolved" if right else "escalated",
                resolution_text=f"ticket {task.id} belongs to {task.team}",
                # The queue the operator rerouted a misrouted ticket to: the right answer.
                correct_answer=None if right else task.team,
            )
        ]


class ToolUseWorkload:
    """Arithmetic word problems with `calculator` and `final_answer` (rewards, optional corrections)."""

    name = "tool-use"
    feedback_kind = "reward"

    def __init__(self, max_turns: int = 2, max_tokens: int = 32, corrections: bool = False):
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.corrections = corrections

    def tasks(self, seed: int, split: Split, count: int) -> list[arithmetic.Problem]:
        return arithmetic.problems(seed, split, count)

    async def run_episode(
        self, client: AsyncOpenAI, agent: str, task: arithmetic.Problem, sampling: Sampling
    ) -> Episode:
        episode = Episode(task.id)
        messages: list[dict[str, Any]] = task.messages()
        answer: float | None = None
        for turn in range(self.max_turns):
            params = sampling.for_turn(turn)
            reply = await client.chat.completions.create(  # type: ignore[call-overload]
                model=agent,
                messages=messages,
                tools=arithmetic.TOOLS,
                tool_choice="required",
                max_tokens=self.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=params.seed,
            )
            _account(episode, reply)
            calls = reply.choices[0].message.tool_calls or []
            if not calls:
                episode.trace.append(arithmetic.Call(None))
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [c.model_dump(exclude_none=True) for c in calls],
                }
            )
            first = calls[0].function
            final = next((c for c in calls if c.function.name == "final_answer"), None)
            if final is not None:
                episode.trace.append(arithmetic.Call("final_answer", final.function.arguments))
                answer = arithmetic.final_value(final.function.arguments)
                episode.answer = final.function.arguments
                break
            results = [arithmetic.tool_result(c.function.name, c.function.arguments) for c in calls]
            episode.trace.append(arithmetic.Call(first.name, first.arguments, results[0]))
            for call, result in zip(calls, results, strict=True):
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        episode.reward = arithmetic.grade(task, answer)
        return episode

    def feedback(
        self, agent: str, task: arithmetic.Problem, episode: Episode, *, event_id: str
    ) -> list[Event]:
        events: list[Event] = [
            Reward(
                event_id=event_id,
                agent=agent,
                completion_ids=episode.completion_ids,
                source="answer-checker",
                value=episode.reward,
                name="correct_final_answer",
            )
        ]
        fix = arithmetic.review(task, episode.trace) if self.corrections else None
        if fix is not None and fix.turn < len(episode.completion_ids):
            events.append(
                Correction(
                    event_id=f"{event_id}-fix",
                    agent=agent,
                    completion_id=episode.completion_ids[fix.turn],
                    source="simulated-developer",
                    corrected_content=forced_call_completion(fix.name, fix.arguments),
                    comment=f"turn {fix.turn + 1} should call {fix.name}",
                )
            )
        return events


def forced_call_completion(name: str, arguments: dict[str, Any]) -> str:
    """The text a `tool_choice="required"` completion continues with for this call.

    The gateway puts `<tool_call>{"name": "` into the prompt, so a supervised
    target for that prompt starts right after it; generation stops at the
    call's closing brace (the forced-call constraint is then done).
    """
    return f'{name}", "arguments": {json.dumps(arguments)}}}'


class CodingWorkload:
    """Python one-liners corrected by a simulated developer (corrections)."""

    name = "coding"
    feedback_kind = "correction"

    def __init__(self, max_tokens: int = 24):
        self.max_tokens = max_tokens
        self.developer = coding.SimulatedDeveloper()

    def tasks(self, seed: int, split: Split, count: int) -> list[coding.CodingTask]:
        return coding.tasks(seed, split, count)

    async def run_episode(
        self, client: AsyncOpenAI, agent: str, task: coding.CodingTask, sampling: Sampling
    ) -> Episode:
        episode, reply_text = await _single_turn(
            client, agent, task.id, task.messages(), sampling, self.max_tokens
        )
        text = reply_text or ""
        review = self.developer.review(task, text)
        episode.reward, episode.answer = review.reward, text
        return episode

    def feedback(
        self, agent: str, task: coding.CodingTask, episode: Episode, *, event_id: str
    ) -> list[Event]:
        review = self.developer.review(task, episode.answer or "")
        return [
            Correction(
                event_id=event_id,
                agent=agent,
                completion_id=episode.completion_ids[-1],
                source="simulated-developer",
                corrected_content=None if review.accepted else review.corrected,
                comment=None if review.accepted else "replaced with the reference solution",
            )
        ]


WORKLOADS: dict[str, type[SupportWorkload] | type[ToolUseWorkload] | type[CodingWorkload]] = {
    "support": SupportWorkload,
    "tool-use": ToolUseWorkload,
    "coding": CodingWorkload,
}


def episode_seed(seed: int, step: int, index: int) -> int:
    """A per-request sampling seed, distinct across (experiment seed, step, index)."""
    return random.Random(f"{seed}/{step}/{index}").randrange(2**31)
