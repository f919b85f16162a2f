"""Start-up checks of a vLLM server: the same model as ours, and processed behaviour logprobs.

`VLLMEngine.start` runs these after picking the served model, and refuses the
server with a `ConfigError` that says what to change:

- `check_root`: when the server's model directory is visible here too, its
  `config.json` must equal ours (two models can share a tokenizer; the tokenizer
  itself is checked through `/tokenize` by the engine);
- `check_logprobs_mode`: vLLM reports its `--logprobs-mode` nowhere in its API,
  so a probe reads it (see the function).

Not here: the HTTP calls (see `client`), choosing the served model (see `engine`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from clora_feedback.engine.vllm.client import VLLMClient
from clora_feedback.errors import ConfigError

LOGPROB_PROBES = ("The capital of France is", "1, 2, 3,", "Once upon a time")
"""Prompts whose next-token distribution the logprobs probe reads (the base model's)."""


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
    """Refuse a server whose logprobs are not those of the distribution sampled from.

    The probe: the base model's top-2 logprobs for one next token, at temperature
    1 and 0.5. Processed logprobs come from logits / T, so the gap between the two
    doubles at T = 0.5; raw logprobs ignore T (the gap stays); the logits modes
    give values above 0. A prompt whose top two (nearly) tie is skipped.

    Raises:
        ConfigError: the server does not run with `--logprobs-mode processed_logprobs`.
    """
    for text in LOGPROB_PROBES:
        prompt = list(tokenizer.encode(text, add_special_tokens=False))
        gaps = []
        for temperature in (1.0, 0.5):
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
            gaps.append(values[0] - values[1])
        if gaps[0] < 1e-3:
            continue  # a near tie says nothing
        ratio = gaps[1] / gaps[0]
        if abs(ratio - 2.0) < 0.25:
            return
        raise _wrong_mode(
            client.base_url,
            "raw logprobs (temperature plays no part)" if abs(ratio - 1.0) < 0.1 else
            f"logprobs that do not follow the temperature (gap ratio {ratio:.2f})",
        )  # fmt: skip
    raise _wrong_mode(client.base_url, "nothing conclusive (every probe prompt tied)")


def _wrong_mode(url: str, what: str) -> ConfigError:
    return ConfigError(
        f"the vLLM server at {url} reports {what}; trajectories need the behaviour "
        "logprobs of the distribution sampled from: start vLLM with "
        "--logprobs-mode processed_logprobs",
        param="engine.vllm.urls",
    )
