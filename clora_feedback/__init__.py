"""clora-feedback: agents that keep learning from the people who use them.

An OpenAI-compatible gateway serves many agents, each through its own LoRA
adapter on one shared warm base model, and captures every completion as a
trajectory for training.

The public face is `__all__`: the feedback SDK (`FeedbackClient`,
`AsyncFeedbackClient`), the feedback event types, settings (`Settings`,
`load_settings`), the composition root (`build_service`) and the error base
(`CloraError`). These names are stable; every other module path is internal and
may move. They are imported on first use, so `import clora_feedback` stays
cheap (no torch, no web stack) until one is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "FeedbackClient": "clora_feedback.client",
    "AsyncFeedbackClient": "clora_feedback.client",
    "Correction": "clora_feedback.schemas.feedback",
    "Resolution": "clora_feedback.schemas.feedback",
    "Reward": "clora_feedback.schemas.feedback",
    "Event": "clora_feedback.schemas.feedback",
    "FeedbackReceipt": "clora_feedback.schemas.feedback",
    "Settings": "clora_feedback.config",
    "load_settings": "clora_feedback.config",
    "build_service": "clora_feedback.service",
    "CloraError": "clora_feedback.errors",
}

__all__ = [
    "AsyncFeedbackClient",
    "CloraError",
    "Correction",
    "Event",
    "FeedbackClient",
    "FeedbackReceipt",
    "Resolution",
    "Reward",
    "Settings",
    "__version__",
    "build_service",
    "load_settings",
]

if TYPE_CHECKING:
    from clora_feedback.client import AsyncFeedbackClient, FeedbackClient
    from clora_feedback.config import Settings, load_settings
    from clora_feedback.errors import CloraError
    from clora_feedback.schemas.feedback import (
        Correction,
        Event,
        FeedbackReceipt,
        Resolution,
        Reward,
    )
    from clora_feedback.service import build_service


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'clora_feedback' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
