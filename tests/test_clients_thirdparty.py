"""Clients nobody on this project wrote, against a real gateway: docs/quickstart.md's snippets.

Each snippet marked `# quickstart: <name>` in docs/quickstart.md is run as
written, with the gateway's loopback URL in place of `http://localhost:8000/v1`
and the test server's agent in place of `support-agent`; the test then checks
the protocol outcome (the tiny model's text is random, its structure is not):
LangChain's `with_structured_output` parses into the pydantic model because
decoding follows the schema; the OpenAI Agents SDK run makes a forced tool call,
gets its result back and finishes with a typed answer; LiteLLM returns a
`ModelResponse`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import GatewayServer

# LiteLLM fetches a price list from the internet at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"
_BLOCK = re.compile(r"```python\n# quickstart: ([\w-]+)\n(.*?)```", re.DOTALL)

pytestmark = pytest.mark.slow


def snippets() -> dict[str, str]:
    """The quickstart's marked Python snippets by name."""
    return {name: code for name, code in _BLOCK.findall(QUICKSTART.read_text(encoding="utf-8"))}


def run_snippet(name: str, gateway: GatewayServer) -> dict[str, Any]:
    """Run one snippet against `gateway`; its module namespace."""
    code = snippets()[name]
    code = code.replace("http://localhost:8000/v1", gateway.base_url)
    code = code.replace("support-agent", "support")
    namespace: dict[str, Any] = {"__name__": f"quickstart_{name.replace('-', '_')}"}
    # Our own docs, compiled without this module's `from __future__` (pydantic models in
    # the snippet must resolve their annotations as written).
    exec(compile(code, f"{QUICKSTART}:{name}", "exec", dont_inherit=True), namespace)
    return namespace


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """A gateway on a tiny model with room for an agent loop.

    The random model's tool arguments can run to the 512-token cap, and the tool's
    result echoes them into the next turn: with the shared 2048-token tiny model an
    unlucky draw overflows the context, so this one gets an 8192-token window.
    """
    from conftest import run_gateway

    from clora_feedback.model.tiny import build_tiny_model_dir

    model = build_tiny_model_dir(
        tmp_path_factory.mktemp("models") / "tiny-long", seed=0, max_position_embeddings=8192
    )
    with run_gateway(
        model,
        tmp_path_factory.mktemp("gateway"),
        engine={"max_model_len": 8192},
        agents=[{"name": "support"}],
    ) as server:
        yield server


def test_the_quickstart_has_each_snippet() -> None:
    assert {"langchain-structured-output", "openai-agents", "litellm"} <= set(snippets())


def test_langchain_structured_output(gateway: GatewayServer) -> None:
    ns = run_snippet("langchain-structured-output", gateway)
    ticket = ns["ticket"]
    assert isinstance(ticket, ns["Ticket"])
    assert ticket.team in ("payment", "delivery", "technical", "account")


def test_openai_agents_sdk_tool_round_trip(gateway: GatewayServer) -> None:
    ns = run_snippet("openai-agents", gateway)
    result = ns["result"]
    items = [item.type for item in result.new_items]
    # A forced call, its output sent back, then the answer.
    assert items[:2] == ["tool_call_item", "tool_call_output_item"], items
    assert items[-1] == "message_output_item" and isinstance(result.final_output, ns["Reply"])
    output = next(i for i in result.new_items if i.type == "tool_call_output_item")
    assert output.output.startswith("order ") and output.output.endswith("delivered yesterday")
    ids = [r.response_id for r in result.raw_responses]
    assert len(ids) >= 2 and all(i and i.startswith("chatcmpl-") for i in ids)
    with gateway.http() as http:
        last = http.get(f"/v1/trajectories/{ids[1]}").json()["request"]["messages"]
    assert [m["role"] for m in last][-2:] == ["assistant", "tool"]


def test_litellm_completion(gateway: GatewayServer) -> None:
    import litellm

    ns = run_snippet("litellm", gateway)
    reply = ns["reply"]
    assert isinstance(reply, litellm.ModelResponse)
    assert reply.id.startswith("chatcmpl-") and reply.choices[0].message.role == "assistant"
    assert 0 < reply.usage.completion_tokens <= 16
