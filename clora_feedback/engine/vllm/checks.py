"""Start-up checks of a vLLM server: the same model as ours, and raw behaviour logprobs.

`VLLMEngine.start` runs these after picking the served model, and refuses the
server with a `ConfigError` that says what to change:

- `check_server`: it serves the wanted base model, whose tokenizer (through
  `/tokenize`) and, when its directory is visible here too, `config.json`
  (`check_root`: two models can share a tokenizer) equal ours;
- `check_logprobs_mode`: vLLM reports its `--logprobs-mode` nowhere in its API,
  so a probe reads it (see the function).

Not here: the HTTP calls (see `client`), when the checks run (see `engine`, `replicas`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from clora_feedback.engine.vllm.client import VLLMClient
from clora_feedback.errors import ConfigError

log = logging.getLogger(__name__)

TOKENIZER_PROBE = 'Hello, clora-feedback! 12345 ünïcödé 🙂\n<tool_call>{"name": "x"}'
"""Text whose token ids the server's tokenizer must reproduce exactly."""

LOGPROB_PROBES = ("The capital of France is", "1, 2, 3,", "Once upon a time")
"""Prompts whose next-token distribution the logprobs probe reads (the base model's)."""


@dataclass(frozen=True)
class ServedBase:
    """The base model a server serves: its name there and its context (if it says)."""

    name: str
    max_model_len: int | None


async def check_server(
    client: VLLMClient,
    model_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    wanted: str | None,
) -> ServedBase:
    """Pick the served base model (`wanted`, else the only one) and check it is ours.

    Raises:
        ConfigError: no such model, several without `wanted`, or another model/tokenizer.
    """
    url = client.base_url
    bases = [m for m in await client.models() if not m.get("parent")]
    ids = [str(m.get("id")) for m in bases]
    if wanted is None and len(bases) != 1:
        raise ConfigError(
            f"the vLLM server at {url} serves {ids}; name one in engine.vllm.served_model_name",
            param="engine.vllm.served_model_name",
        )
    entry = bases[0] if wanted is None else next((m for m in bases if m.get("id") == wanted), None)
    if entry is None:
        raise ConfigError(
            f"the vLLM server at {url} does not serve {wanted!r} (it serves {ids})",
            param="engine.vllm.served_model_name",
        )
    served = str(entry["id"])
    check_root(entry.get("root"), model_dir, url)
    theirs = await client.tokenize(served, TOKENIZER_PROBE)
    ours = list(tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False))
    if theirs is None:
        log.warning("vLLM server %s has no /tokenize: the tokenizer is not checked", url)
    elif theirs != ours:
        raise ConfigError(
            f"the vLLM server at {url} serves {served!r} (from {entry.get('root')}), whose "
            f"tokenizer differs from engine.model ({model_dir}); start vLLM on the same model "
            "directory",
            param="engine.model",
        )
    length = entry.get("max_model_len")
    return ServedBase(served, length if isinstance(length, int) else None)


def check_root(root: Any, model_dir: Path, url: str) -> None:
    """Refuse a server whose model directory (`/v1/models`' `root`) holds another model."""
    if not isinstance(root, str):
        return
    theirs, ours = Path(root) / "config.json", Path(model_dir) / "config.json"
    if not theirs.is_file() or theirs.resolve() == ours.resolve():
        return  # remote (not visible here), or the very same directory
    try:
        same = json.loads(theirs.read_text()) == json.loads(ours.read_text())
    except (OSError, ValueError):
        return
    if not same:
        raise ConfigError(
            f"the vLLM server at {url} serves {root}, not engine.model ({model_dir}): "
            "their config.json differ; start vLLM on the same model",
            param="engine.model",
        )


async def check_logprobs_mode(
    client: VLLMClient, tokenizer: PreTrainedTokenizerBase, served_model: str
) -> None:
    """Refuse a server whose logprobs are not raw (the log-softmax of the raw logits).

    Behaviour logprobs have one meaning on every engine: raw, the temperature-1
    policy the trainer scores (`clora_feedback.engine.sampling` says why), so a
    fresh sample's importance ratio is 1 whatever temperature or top-p it was
    sampled at. The probe: the base model's top-5 logprobs for one next token at
    temperature 1 and 0.25, on a few prompts. Raw logprobs ignore T (the spread
    between the first and the last stays); processed ones come from logits / T
    (the spread grows 4x); the logits modes give values above 0. The spreads are
    summed over the prompts before they are compared, and the verdict sits
    halfway (2x) between the two answers, so the few-percent noise of a
    recomputed (or prefix-cached) forward on a flat model cannot flip it.

    Raises:
        ConfigError: the server does not run with `--logprobs-mode raw_logprobs`
            (vLLM's default).
    """
    spreads = {1.0: 0.0, 0.25: 0.0}
    for text in LOGPROB_PROBES:
        prompt = list(tokenizer.encode(text, add_special_tokens=False))
        for temperature in spreads:
            body = {
                "model": served_model,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": temperature,
                "top_p": 1.0,
                "seed": 0,
                "logprobs": 5,
                "return_tokens_as_token_ids": True,
            }
            result = await client.complete(body)
            tops = result["choices"][0]["logprobs"]["top_logprobs"][0]
            values = sorted((float(v) for v in tops.values()), reverse=True)
            if len(values) < 2 or values[0] > 1e-4:
                raise _wrong_mode(client.base_url, "values that are not logprobs")
            spreads[temperature] += values[0] - values[-1]
    if spreads[1.0] < 1e-3:
        raise _wrong_mode(client.base_url, "nothing conclusive (every probe prompt tied)")
    ratio = spreads[0.25] / spreads[1.0]
    if ratio < 2.0:
        return
    raise _wrong_mode(
        client.base_url,
        "processed logprobs (they follow the temperature)" if ratio > 3.0 else
        f"logprobs that are not the raw model's (spread ratio {ratio:.2f} at T=0.25)",
    )  # fmt: skip


def _wrong_mode(url: str, what: str) -> ConfigError:
    return ConfigError(
        f"the vLLM server at {url} reports {what}; trajectories need raw behaviour "
        "logprobs (the temperature-1 model the trainer scores): start vLLM with "
        "--logprobs-mode raw_logprobs (its default)",
        param="engine.vllm.urls",
    )
