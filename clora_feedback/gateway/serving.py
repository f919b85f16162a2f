"""What the chat and text-completion handlers share: the parts they serve with, and a route.

`Serving` holds the engine, the agents, the trajectory capture and the token
pieces (for logprobs); `ChatHandler` and `CompletionHandler` each own one, so
the skeleton of a request (route the model for this key, plan its sampling,
start its engine run, answer whole or as a stream, commit the trajectory) is
written once, and the handlers differ only in their prompts and wire shapes.

Not here: the prompts (see `chat`, `completions`), the engine run (see
`generation`), the record (see `capture`), the stream framing (see `sse`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Protocol

from clora_feedback.engine.base import Engine
from clora_feedback.engine.types import GuidedDecoding, SamplingParams
from clora_feedback.errors import NotFoundError
from clora_feedback.gateway.agents import AgentRegistry, Route, sticky_key
from clora_feedback.gateway.auth import Principal
from clora_feedback.gateway.capture import Capture
from clora_feedback.gateway.generation import GenerationRun
from clora_feedback.gateway.logprobs import TokenPieces
from clora_feedback.gateway.metrics import Metrics
from clora_feedback.store.trajectories import AsyncTrajectoryStore


class Requested(Protocol):
    """What routing reads of a request body (both OpenAI request models have it)."""

    @property
    def model(self) -> str: ...


class Serving:
    """The parts a completion handler serves with.

    Attributes:
        engine: the engine every request runs on.
        agents: routes `model` to an agent and the version that serves it.
        capture: extension fields and trajectory commits.
        pieces: token texts for logprobs.
    """

    def __init__(
        self, engine: Engine, agents: AgentRegistry, store: AsyncTrajectoryStore, metrics: Metrics
    ) -> None:
        self.engine = engine
        self.agents = agents
        self.capture = Capture(engine, store, metrics)
        self.pieces = TokenPieces(engine.tokenizer)

    def route(self, body: Requested, principal: Principal) -> Route:
        """How `body.model` is served for this caller.

        Raises:
            NotFoundError: an unknown model, or one this key may not use (the same answer).
        """
        route = self.agents.resolve(body.model)  # no canary choice before the key's check:
        principal.check_model(body.model, route.agent)  # a refused request is no exposure
        if route.agent is None:
            return route
        route = self.agents.resolve(body.model, sticky=sticky_key(body, uuid.uuid4().hex))
        if route.engine_agent is not None:  # a cold adapter is read while the prompt is built
            self.engine.prefetch(route.engine_agent)
        return route

    def start(
        self,
        route: Route,
        *,
        id_prefix: str,
        prompts: Sequence[list[int]],
        sampling: SamplingParams,
        n: int,
        guided: GuidedDecoding | None = None,
    ) -> tuple[Route, str, GenerationRun]:
        """The route served, a fresh completion id (`{id_prefix}-{hex}`) and its engine
        run, under way. A request routed to a release arm (a canary) that ended while its
        prompt was built goes to the agent's serving version instead: the returned route
        says which, for the response and the trajectory.

        Raises:
            CloraError: what the engine refuses at submission (see `Engine.add_requests`).
        """
        completion_id = f"{id_prefix}-{uuid.uuid4().hex}"

        def run_on(route: Route) -> GenerationRun:
            return GenerationRun(
                self.engine,
                completion_id=completion_id,
                agent=route.engine_agent,
                prompts=prompts,
                sampling=sampling,
                n=n,
                guided=guided,
            )

        try:
            return route, completion_id, run_on(route)
        except NotFoundError:
            if route.agent is None or route.engine_agent in (None, route.agent):
                raise  # not an arm: the agent's own adapter is gone
        route = self.agents.resolve(route.model)  # no sticky key: the serving version
        return route, completion_id, run_on(route)
