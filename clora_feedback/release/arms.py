"""The engine names of a release's extra arms.

Both engines key adapters by a name (`GenerationRequest.agent`): the serving
version is loaded under the agent's own name, and a release adds two more,
never valid agent names (`@` is outside `store.versions.AGENT_NAME`), so they
cannot collide with an agent: `<agent>@canary` (a live canary, beside serving:
a second slot on the embedded engine, a second vLLM adapter name) and
`<agent>@gate` (a candidate while the offline gate evaluates it, unloaded after).
Tokens report the version loaded under the name, so attribution stays exact.

Not here: loading them (the deployer), choosing them (`canary`, `controller`).
"""

from __future__ import annotations

__all__ = ["canary_name", "gate_name"]


def canary_name(agent: str) -> str:
    """The engine name of `agent`'s canary arm."""
    return f"{agent}@canary"


def gate_name(agent: str) -> str:
    """The engine name a candidate of `agent` is evaluated under."""
    return f"{agent}@gate"
