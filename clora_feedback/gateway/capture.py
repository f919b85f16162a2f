"""Trajectory capture: one `TrajectoryRecord` per served completion, written before replying.

The handlers build the record with `build_record` and commit it (`Capture.commit`)
after the last token and before the non-streamed response is returned or the
stream's `[DONE]` is sent, so every completion id a client has seen can be
looked up (and rewarded) later. A request that fails, or whose client
disconnects, records nothing. A text completion of several prompts records
one trajectory per prompt (`prompt_completion_id`).

The record follows the serving engine's `capabilities`: it says how the
behaviour logprobs were computed ("raw" or "processed") and whether the token
versions are exact per token or the admitted version repeated ("request"), so
the trainer can tell; `version_attribution` says the same in the `clora`
response extension.

Not here: the database (see `clora_feedback.store.trajectories`), rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from clora_feedback.engine.base import Engine
from clora_feedback.engine.types import EngineCapabilities
from clora_feedback.gateway.agents import Route
from clora_feedback.gateway.auth import Principal
from clora_feedback.gateway.generation import ChoiceState, GenerationRun
from clora_feedback.gateway.metrics import Metrics
from clora_feedback.schemas.openai import CloraResponseExtension
from clora_feedback.store.trajectories import AsyncTrajectoryStore, SampleRecord, TrajectoryRecord


def version_attribution(engine: Engine) -> Literal["request"] | None:
    """The `clora` extension's `version_attribution`: "request" when the engine attributes
    one version per request, None (omitted) when every token's version is exact."""
    return None if engine.capabilities.per_token_versions else "request"


def prompt_completion_id(completion_id: str, prompt_index: int, prompts: int) -> str:
    """The trajectory id of one prompt's choices: the response id itself for a request with
    one prompt, `{id}-p{index}` for each of several."""
    return completion_id if prompts == 1 else f"{completion_id}-p{prompt_index}"


class Capture:
    """Extension fields and trajectory commits shared by the completion handlers.

    Args:
        engine: the serving engine (its capabilities go into every record).
        store: where trajectories are committed.
        metrics: counts each committed completion.
    """

    def __init__(self, engine: Engine, store: AsyncTrajectoryStore, metrics: Metrics) -> None:
        self._engine = engine
        self._store = store
        self._metrics = metrics

    def extension(self, route: Route, prompt_token_ids: list[int] | None) -> dict[str, Any]:
        """The top-level `clora` object of a response (or of a stream's first chunk)."""
        return CloraResponseExtension(
            agent=route.agent,
            adapter_version=route.adapter_version,
            prompt_token_ids=prompt_token_ids,
            version_attribution=version_attribution(self._engine),
        ).wire()

    async def commit(self, record: TrajectoryRecord, endpoint: str) -> None:
        """Store `record`, then count it under `endpoint` ("chat", "completions")."""
        await self._store.record(record)
        generated = sum(len(s.completion_token_ids) for s in record.samples)
        self._metrics.observe_completion(
            record.agent, endpoint, len(record.prompt_token_ids), generated
        )


def build_record(
    *,
    completion_id: str,
    kind: Literal["chat", "completion"],
    route: Route,
    principal: Principal,
    request: dict[str, Any],
    prompt_token_ids: list[int],
    run: GenerationRun,
    outputs: Sequence[tuple[ChoiceState, str, str | None, list[dict[str, Any]] | None]],
    capabilities: EngineCapabilities,
) -> TrajectoryRecord:
    """Assemble the record.

    Args:
        completion_id: the response id (= trajectory id).
        kind: endpoint family.
        route: how the model was served.
        principal: the caller (its agent goes to `api_key_agent`).
        request: the request body as JSON.
        prompt_token_ids: the prompt exactly as the engine saw it.
        run: the finished generation (for timings).
        outputs: per choice of this prompt, in order (the sample index is the place in
            this list): (state, text returned, finish reason returned, tool calls).
        capabilities: the serving engine's; the record says how its logprobs were
            computed and whether its token versions are per token or per request.
    """
    samples = [
        SampleRecord(
            index=index,
            text=text,
            completion_token_ids=list(state.token_ids),
            logprobs=list(state.logprobs),
            token_versions=list(state.versions),
            finish_reason=finish_reason,
            tool_calls=tool_calls,
        )
        for index, (state, text, finish_reason, tool_calls) in enumerate(outputs)
    ]
    key_agent = None
    if not principal.admin and route.agent in principal.agents:
        key_agent = route.agent
    return TrajectoryRecord(
        id=completion_id,
        agent=route.agent if route.agent is not None else route.model,
        adapter_version=route.adapter_version,
        kind=kind,
        request=request,
        prompt_token_ids=list(prompt_token_ids),
        samples=samples,
        created_at=run.created_at,
        timings=run.timings(),
        api_key_agent=key_agent,
        logprobs_mode=capabilities.logprobs,
        version_attribution="token" if capabilities.per_token_versions else "request",
    )
