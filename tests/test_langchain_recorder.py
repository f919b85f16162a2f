"""`CompletionRecorder`: completion ids of a LangChain run, and the run's outcome sent for all of them.

Chat models here are langchain-core's `GenericFakeChatModel` (ids in
`response_metadata`, as LangChain leaves them after a ChatOpenAI call) and a
minimal `BaseChatModel` that reports the id only in `llm_output` (as
langchain-openai's `_create_chat_result` does); langchain-openai itself is not
installed. Outcomes go to a real webhook server.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from feedback_support import rejoin_all
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableLambda
from test_webhook import AGENTS, feedback_app, serve, trajectory

from clora_feedback.client import AsyncFeedbackClient, FeedbackClient
from clora_feedback.config import FeedbackConfig, Settings
from clora_feedback.errors import InvalidRequestError
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.integrations.langchain import CompletionRecorder
from clora_feedback.store.trajectories import TrajectoryStore


class OpenAIShapedChat(BaseChatModel):
    """Answers like langchain-openai: `llm_output = {"id", "model_name", ...}`, `n` choices."""

    agent: str
    ids: list[str]
    n: int = 1
    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "openai-shaped"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        completion_id = self.ids[self.calls]
        self.calls += 1
        generations = [
            ChatGeneration(
                message=AIMessage(content=f"answer {i}"), generation_info={"finish_reason": "stop"}
            )
            for i in range(self.n)
        ]
        llm_output = {"id": completion_id, "model_name": self.agent, "token_usage": {}}
        return ChatResult(generations=generations, llm_output=llm_output)


def fake_chat(ids: list[str], agent: str | None = "support") -> GenericFakeChatModel:
    metadata = [{"id": cid, **({"model_name": agent} if agent else {})} for cid in ids]
    return GenericFakeChatModel(
        messages=iter(
            AIMessage(content=f"step {i}", response_metadata=m) for i, m in enumerate(metadata)
        )
    )


def agent_run(model: Any, steps: int) -> Any:
    """A toy agent: a chain that calls the model `steps` times, feeding each answer back."""

    def loop(question: str) -> str:
        text = question
        for _ in range(steps):
            text = str(model.invoke(text).content)
        return text

    return RunnableLambda(loop)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FeedbackStore]:
    s = FeedbackStore(
        tmp_path / "feedback.db",
        trajectories=TrajectoryStore(tmp_path / "feedback.db"),
        policy=DefaultRewardPolicy(FeedbackConfig()),
    )
    yield s
    s.close()


@pytest.fixture
def url(store: FeedbackStore) -> Iterator[str]:
    settings = Settings(agents=AGENTS, admin_api_key="k-admin")
    with ExitStack() as stack:
        yield stack.enter_context(serve(feedback_app(store, settings)))


def test_records_every_completion_of_a_run_in_order() -> None:
    recorder = CompletionRecorder()
    ids = ["chatcmpl-a", "chatcmpl-b", "chatcmpl-c"]
    agent_run(fake_chat(ids), steps=3).invoke("q", config={"callbacks": [recorder]})
    assert recorder.completion_ids == ids
    assert recorder.completions_by_agent() == {"support": ids}
    recorder.clear()
    assert recorder.completion_ids == [] and recorder.unidentified_calls == 0


def test_reads_the_id_from_llm_output_and_dedupes_choices() -> None:
    recorder = CompletionRecorder()
    model = OpenAIShapedChat(agent="sales", ids=["chatcmpl-1", "chatcmpl-2"], n=2)
    model.invoke("q", config={"callbacks": [recorder]})
    model.invoke("q", config={"callbacks": [recorder]})
    assert recorder.completions_by_agent() == {"sales": ["chatcmpl-1", "chatcmpl-2"]}


def test_streamed_calls_without_ids_are_counted_not_guessed() -> None:
    recorder = CompletionRecorder()
    model = GenericFakeChatModel(messages=iter([AIMessage(content="a b c")]))
    list(model.stream("q", config={"callbacks": [recorder]}))
    assert recorder.completion_ids == [] and recorder.unidentified_calls == 1
    with pytest.raises(InvalidRequestError, match="no completion ids"):
        recorder.resolution_events("resolved")


def test_explicit_agent_and_several_agents_in_one_run() -> None:
    pinned = CompletionRecorder(agent="support")
    fake_chat(["c1"], agent=None).invoke("q", config={"callbacks": [pinned]})
    assert pinned.completions_by_agent() == {"support": ["c1"]}

    recorder = CompletionRecorder()
    fake_chat(["s1", "s2"]).batch(["a", "b"], config={"callbacks": [recorder]})
    OpenAIShapedChat(agent="sales", ids=["x1"]).invoke("q", config={"callbacks": [recorder]})
    events = recorder.resolution_events("escalated", event_id="ticket-7")
    assert [(e.event_id, e.agent, sorted(e.completion_ids)) for e in events] == [
        ("ticket-7-0", "support", ["s1", "s2"]),
        ("ticket-7-1", "sales", ["x1"]),
    ]
    assert all(e.outcome == "escalated" and e.source == "langchain" for e in events)


def test_resolve_rewards_every_completion_of_the_run(url: str, store: FeedbackStore) -> None:
    ids = ["chatcmpl-r1", "chatcmpl-r2", "chatcmpl-r3"]
    for cid in ids:
        store.trajectories.record(trajectory(cid))
    recorder = CompletionRecorder()
    agent_run(fake_chat(ids), steps=3).invoke("q", config={"callbacks": [recorder]})
    with FeedbackClient(url, api_key="k-support") as client:
        receipt = recorder.resolve(client, "resolved", score=1.0, event_id="ticket-1")
        assert receipt.joined == ["ticket-1"]
        assert recorder.resolve(client, "rejected", event_id="ticket-1").duplicates == ["ticket-1"]
        recorder.reward(client, -0.5, name="tests")
    for cid in ids:
        assert [(r["kind"], r["value"]) for r in store.rewards_for(cid)] == [
            ("resolution", 1.0),
            ("reward", -0.5),
        ]


async def test_async_run_and_async_resolve(url: str, store: FeedbackStore) -> None:
    ids = ["chatcmpl-x", "chatcmpl-y"]
    store.trajectories.record(trajectory(ids[0], agent="sales"))  # the other one arrives later
    recorder = CompletionRecorder()
    model = OpenAIShapedChat(agent="sales", ids=ids)
    await model.ainvoke("one", config={"callbacks": [recorder]})
    await model.ainvoke("two", config={"callbacks": [recorder]})
    assert recorder.completion_ids == ids
    async with AsyncFeedbackClient(url, api_key="k-sales") as client:
        receipt = await recorder.areward(client, 0.75)
    assert receipt.parked == receipt.event_ids  # waits for chatcmpl-y's trajectory
    store.trajectories.record(trajectory(ids[1], agent="sales"))
    assert rejoin_all(store, ttl_s=60)[0] == receipt.event_ids
    assert [r["value"] for r in store.rewards_for(ids[1])] == [0.75]
