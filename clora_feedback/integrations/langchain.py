"""`CompletionRecorder`: a LangChain callback that remembers the completion ids of an agent run.

An agent run makes many model calls; the outcome (the ticket got resolved, the
user gave a reward) is known only at the end. Pass a recorder in the run's
callbacks, then attach the outcome to every completion the run produced:

    recorder = CompletionRecorder()
    agent.invoke(inputs, config={"callbacks": [recorder]})
    recorder.resolve(client, "resolved", score=0.8)     # or recorder.reward(client, 1.0)

Where the id comes from: the OpenAI response `id` (`chatcmpl-...`), which
langchain-openai puts in `LLMResult.llm_output["id"]` and which LangChain copies
into `message.response_metadata["id"]` of a single generation; both are read (and
`generation_info["id"]`). The agent is the response's `model_name` (the gateway
answers with the agent name it served) unless the recorder is given one.
Streamed ChatOpenAI calls carry no response id in their messages, so they cannot
be recorded; they are counted in `unidentified_calls` (stream less, or send the
feedback by `conversation_id` instead).

Not here: sending (`clora_feedback.client`), LangChain itself beyond the
callback interface of `langchain-core`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import ChatGeneration, LLMResult

from clora_feedback.client import (
    AsyncFeedbackClient,
    FeedbackClient,
    FeedbackReceipt,
    new_event_id,
)
from clora_feedback.errors import InvalidRequestError
from clora_feedback.schemas.feedback import Outcome, Resolution, Reward

MAX_IDS_PER_EVENT = 1000
"""`completion_ids` holds at most this many; a longer run is split over several events."""


class CompletionRecorder(BaseCallbackHandler):
    """Records `(agent, completion id)` of every model call it sees, in call order.

    Args:
        agent: the agent judged; default: each response's `model_name`.
        source: `source` of the events it sends.
    """

    # Called in order on the caller's thread or loop, not in an executor: ids keep call order.
    run_inline = True
    raise_error = False

    def __init__(self, agent: str | None = None, *, source: str = "langchain") -> None:
        super().__init__()
        self.agent = agent
        self.source = source
        self._lock = threading.Lock()
        self._completions: dict[str, str] = {}  # completion id -> agent (insertion ordered)
        self._requested: dict[UUID, str] = {}  # run id -> model named in the request
        self.unidentified_calls = 0

    # -- callbacks ---------------------------------------------------------------------

    def on_chat_model_start(
        self, serialized: dict[str, Any], messages: list[list[Any]], *, run_id: UUID, **kwargs: Any
    ) -> None:
        self._remember_model(run_id, kwargs.get("invocation_params"))

    def on_llm_start(
        self, serialized: dict[str, Any], prompts: list[str], *, run_id: UUID, **kwargs: Any
    ) -> None:
        self._remember_model(run_id, kwargs.get("invocation_params"))

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        with self._lock:
            self._requested.pop(run_id, None)

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        llm_output = response.llm_output or {}
        found: list[tuple[str, str | None]] = []
        for generations in response.generations:
            for generation in generations:
                metadata: Mapping[str, Any] = (
                    generation.message.response_metadata
                    if isinstance(generation, ChatGeneration)
                    else {}
                )
                info = generation.generation_info or {}
                completion_id = metadata.get("id") or info.get("id") or llm_output.get("id")
                if isinstance(completion_id, str) and completion_id:
                    model = metadata.get("model_name") or llm_output.get("model_name")
                    found.append((completion_id, model if isinstance(model, str) else None))
        with self._lock:
            requested = self._requested.pop(run_id, None)
            recorded = False
            for completion_id, model in found:
                agent = self.agent or model or requested
                if agent is not None:
                    self._completions.setdefault(completion_id, agent)
                    recorded = True
            if not recorded:
                self.unidentified_calls += 1

    def _remember_model(self, run_id: UUID, params: object) -> None:
        if isinstance(params, Mapping):
            model = params.get("model") or params.get("model_name")
            if isinstance(model, str):
                with self._lock:
                    self._requested[run_id] = model

    # -- what was recorded ---------------------------------------------------------------

    @property
    def completion_ids(self) -> list[str]:
        """Every recorded completion id, in call order."""
        with self._lock:
            return list(self._completions)

    def completions_by_agent(self) -> dict[str, list[str]]:
        """Recorded completion ids grouped by agent (each group in call order)."""
        groups: dict[str, list[str]] = {}
        with self._lock:
            for completion_id, agent in self._completions.items():
                groups.setdefault(agent, []).append(completion_id)
        return groups

    def clear(self) -> None:
        """Forget everything recorded (to reuse the recorder for the next run)."""
        with self._lock:
            self._completions.clear()
            self._requested.clear()
            self.unidentified_calls = 0

    # -- events for the run's outcome ------------------------------------------------------

    def _targets(self, event_id: str | None) -> list[tuple[str, str, list[str]]]:
        """(event id, agent, completion ids) per event: one per agent and 1,000 ids."""
        chunks = [
            (agent, ids[i : i + MAX_IDS_PER_EVENT])
            for agent, ids in self.completions_by_agent().items()
            for i in range(0, len(ids), MAX_IDS_PER_EVENT)
        ]
        if not chunks:
            raise InvalidRequestError(
                "the recorder saw no completion ids: was it in the run's callbacks, "
                f"and were the calls streamed? ({self.unidentified_calls} calls had no id)",
                code="no_completions",
            )
        if event_id is None:
            return [(new_event_id(), agent, ids) for agent, ids in chunks]
        if len(chunks) == 1:
            return [(event_id, *chunks[0])]
        # Deterministic suffixes keep a resend of the same outcome idempotent.
        return [(f"{event_id}-{n}", agent, ids) for n, (agent, ids) in enumerate(chunks)]

    def resolution_events(
        self,
        outcome: Outcome,
        *,
        score: float | None = None,
        resolution_text: str | None = None,
        event_id: str | None = None,
    ) -> list[Resolution]:
        """One `Resolution` per agent covering every recorded completion.

        Raises:
            InvalidRequestError: nothing was recorded.
        """
        return [
            Resolution(
                event_id=eid,
                agent=agent,
                completion_ids=ids,
                source=self.source,
                outcome=outcome,
                score=score,
                resolution_text=resolution_text,
            )
            for eid, agent, ids in self._targets(event_id)
        ]

    def reward_events(
        self, value: float, *, name: str = "reward", event_id: str | None = None
    ) -> list[Reward]:
        """One `Reward` per agent covering every recorded completion."""
        return [
            Reward(
                event_id=eid,
                agent=agent,
                completion_ids=ids,
                source=self.source,
                value=value,
                name=name,
            )
            for eid, agent, ids in self._targets(event_id)
        ]

    def resolve(
        self,
        client: FeedbackClient,
        outcome: Outcome,
        *,
        score: float | None = None,
        resolution_text: str | None = None,
        event_id: str | None = None,
    ) -> FeedbackReceipt:
        """Send the run's resolution for every recorded completion (one request).

        Args:
            client: where to send it.
            outcome: how the case ended.
            score: optional satisfaction in [0, 1].
            resolution_text: the operator's note.
            event_id: idempotency key (e.g. the ticket id); default a fresh uuid4.
        """
        events = self.resolution_events(
            outcome, score=score, resolution_text=resolution_text, event_id=event_id
        )
        return client.send(events)

    def reward(
        self,
        client: FeedbackClient,
        value: float,
        *,
        name: str = "reward",
        event_id: str | None = None,
    ) -> FeedbackReceipt:
        """Send one scalar reward for every recorded completion (one request)."""
        return client.send(self.reward_events(value, name=name, event_id=event_id))

    async def aresolve(
        self,
        client: AsyncFeedbackClient,
        outcome: Outcome,
        *,
        score: float | None = None,
        resolution_text: str | None = None,
        event_id: str | None = None,
    ) -> FeedbackReceipt:
        """`resolve` with an `AsyncFeedbackClient`."""
        events = self.resolution_events(
            outcome, score=score, resolution_text=resolution_text, event_id=event_id
        )
        return await client.send(events)

    async def areward(
        self,
        client: AsyncFeedbackClient,
        value: float,
        *,
        name: str = "reward",
        event_id: str | None = None,
    ) -> FeedbackReceipt:
        """`reward` with an `AsyncFeedbackClient`."""
        return await client.send(self.reward_events(value, name=name, event_id=event_id))
