"""`VLLMEngine`: the `Engine` Protocol over a vLLM OpenAI server, driven by prompt token ids.

The gateway keeps the chat template, tool rendering and trajectory capture; this
engine only turns one `GenerationRequest` into one streamed `/v1/completions`
call (the prompt as token ids, `return_token_ids`, `logprobs`, the request's
`seed`, `stop` and stop token ids, and a structured-outputs constraint for a
forced call or a JSON schema, see `guided`), and the stream back into
`RequestOutput` chunks. Text is detokenised here, from the token ids, with the
same rules as the embedded engine (`detok`), so the gateway parses both alike.

Adapters: each version is loaded under a fresh name (`names`) from its PEFT
directory; a request keeps the name it was admitted under to its end, so every
token of it carries that version (`capabilities.per_token_versions` is false);
an old name is unloaded after its last request. A name the server has lost
(it restarted) fails its request with a retriable 503 and is loaded again.
Abort closes the HTTP stream (vLLM aborts a request whose client disconnects).

`start` refuses a server that cannot give what capture promises: it must serve
the same model as `engine.model` (the same tokenizer, checked through
`/tokenize`, and the same `config.json` when its directory is visible here) and report
behaviour logprobs of the distribution sampled from (`--logprobs-mode
processed_logprobs`, checked by a probe, see `checks`).

Not here: HTTP details and error translation (see `client`), the name
bookkeeping (see `names`), several replicas (one URL serves today).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from clora_feedback.config import EngineConfig
from clora_feedback.engine.detok import Detokenizer
from clora_feedback.engine.guided import check_supported
from clora_feedback.engine.stream import RequestStreamImpl
from clora_feedback.engine.types import (
    AdapterRef,
    EngineCapabilities,
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    TokenEvent,
)
from clora_feedback.engine.vllm.checks import check_logprobs_mode, check_root
from clora_feedback.engine.vllm.client import ADAPTER_MISSING, VLLMClient
from clora_feedback.engine.vllm.guided import structured_outputs
from clora_feedback.engine.vllm.names import AdapterNames, Lease, ServedName
from clora_feedback.errors import (
    AdapterError,
    CloraError,
    ConfigError,
    ContextLengthError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
)
from clora_feedback.lora.peft_io import load_peft_adapter
from clora_feedback.lora.weights import LoRALimits
from clora_feedback.model.config import ModelConfig

log = logging.getLogger(__name__)

CAPABILITIES = EngineCapabilities(
    per_token_versions=False,
    logprobs="processed",
    in_memory_adapters=False,
    constraints=frozenset({"json_schema", "tool_call"}),
)

_TOKENIZER_PROBE = 'Hello, clora-feedback! 12345 ünïcödé 🙂\n<tool_call>{"name": "x"}'
_FINISH: Mapping[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(eq=False)
class _Flight:
    task: asyncio.Task[None]
    lease: Lease


def _top(entry: Any, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` most likely (token id, logprob) of one position's `top_logprobs` dict."""
    if k <= 0 or not isinstance(entry, dict):
        return ()
    pairs = [(_token_id(key), float(value)) for key, value in entry.items()]
    pairs.sort(key=lambda p: -p[1])
    return tuple(pairs[:k])


def _token_id(text: str) -> int:
    """`token_id:123` (vLLM's `return_tokens_as_token_ids` form) -> 123."""
    try:
        return int(str(text).removeprefix("token_id:"))
    except ValueError as exc:
        raise EngineError("the vLLM server sent a logprob for an unnamed token") from exc


class VLLMEngine:
    """`Engine` backed by one vLLM OpenAI server (the first of `engine.vllm.urls`).

    Args:
        model_dir: the base model's directory (the tokenizer and the LoRA limits are
            read from it); the server must serve the same model.
        config: the engine settings (`config.vllm` names the server).
        model_name: the public name of the base model (`/v1/models`).
        transport: an httpx transport instead of the network (tests).
    """

    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        *,
        model_name: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not config.vllm.urls:
            raise ConfigError(
                "engine.kind 'vllm' needs engine.vllm.urls (the vLLM servers' base URLs)",
                param="engine.vllm.urls",
            )
        self.config = config
        self.url = config.vllm.urls[0]
        self.model_dir = Path(model_dir)
        self._model_name = model_name or self.model_dir.name
        model = ModelConfig.from_dir(self.model_dir)
        self._vocab = model.vocab_size
        self._limits = LoRALimits(
            config.max_lora_rank,
            tuple(config.lora_target_modules),
            model.num_layers,
            model.projection_shapes(),
        )
        self._tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        eos = set(model.eos_token_ids)
        if self._tokenizer.eos_token_id is not None:
            eos.add(int(self._tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self._max_len = min(config.max_model_len, model.max_position_embeddings)
        self._names = AdapterNames()
        self._client: VLLMClient | None = None
        self._transport = transport
        self._served_model = ""
        self._flights: dict[str, _Flight] = {}
        self._unloads: set[asyncio.Task[None]] = set()  # unloads and reloads under way
        self._reloading: set[str] = set()
        self._adapter_lock = asyncio.Lock()
        self._chunks = 0
        self._generated = 0

    # -- Engine Protocol: properties and lifecycle -----------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_len

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def lora_limits(self) -> LoRALimits:
        """From the model directory and `engine.max_lora_rank` / `lora_target_modules`
        (keep the server's `--max-lora-rank` at least as large)."""
        return self._limits

    @property
    def capabilities(self) -> EngineCapabilities:
        return CAPABILITIES

    @property
    def served_model(self) -> str:
        """The base model's name on the server (known after `start`)."""
        return self._served_model

    async def start(self) -> None:
        """Connect, and refuse a server on another model or with the wrong logprobs mode.

        Raises:
            EngineUnavailableError: `/health` did not answer within `startup_timeout_s`.
            ConfigError: another model or tokenizer, or logprobs not `processed_logprobs`.
        """
        cfg = self.config.vllm
        self._client = VLLMClient(
            self.url,
            api_key=cfg.api_key,
            connect_timeout_s=cfg.connect_timeout_s,
            read_timeout_s=cfg.read_timeout_s,
            transport=self._transport,
        )
        try:
            await self._wait_healthy(cfg.startup_timeout_s)
            await self._check_model()
            await check_logprobs_mode(self._started(), self._tokenizer, self._served_model)
        except BaseException:
            await self._client.close()
            self._client = None
            raise
        log.info(
            "vLLM engine: %s serves %s (context %d)", self.url, self._served_model, self._max_len
        )

    async def stop(self) -> None:
        """Abort what is in flight and unload every adapter name this engine loaded."""
        client = self._client
        if client is None:
            return
        flights = list(self._flights.values())
        for flight in flights:
            flight.task.cancel()
        await asyncio.gather(*(f.task for f in flights), return_exceptions=True)
        await asyncio.gather(*self._unloads, return_exceptions=True)
        for served in self._names.everything():
            with contextlib.suppress(CloraError):
                await client.unload_lora(served.name)
        self._names.clear()
        self._client = None
        await client.close()

    def _started(self) -> VLLMClient:
        if self._client is None:
            raise EngineError("the vLLM engine is not started")
        return self._client

    async def _wait_healthy(self, timeout_s: float) -> None:
        client = self._started()
        deadline = time.monotonic() + timeout_s
        while not await client.healthy():
            if time.monotonic() > deadline:
                raise EngineUnavailableError(
                    f"the vLLM server at {self.url} did not answer /health within {timeout_s:.0f} s"
                )
            await asyncio.sleep(0.5)

    async def _check_model(self) -> None:
        """Pick the served base model and check it tokenizes exactly as `engine.model`."""
        client = self._started()
        bases = [m for m in await client.models() if not m.get("parent")]
        wanted = self.config.vllm.served_model_name
        ids = [str(m.get("id")) for m in bases]
        if wanted is None and len(bases) != 1:
            raise ConfigError(
                f"the vLLM server at {self.url} serves {ids}; name one in "
                "engine.vllm.served_model_name",
                param="engine.vllm.served_model_name",
            )
        entry = (
            bases[0] if wanted is None else next((m for m in bases if m.get("id") == wanted), None)
        )
        if entry is None:
            raise ConfigError(
                f"the vLLM server at {self.url} does not serve {wanted!r} (it serves {ids})",
                param="engine.vllm.served_model_name",
            )
        self._served_model = str(entry["id"])
        server_len = entry.get("max_model_len")
        if isinstance(server_len, int):
            self._max_len = min(self._max_len, server_len)
        check_root(entry.get("root"), self.model_dir, self.url)
        theirs = await client.tokenize(self._served_model, _TOKENIZER_PROBE)
        ours = list(self._tokenizer.encode(_TOKENIZER_PROBE, add_special_tokens=False))
        if theirs is None:
            log.warning("vLLM server %s has no /tokenize: the tokenizer is not checked", self.url)
        elif theirs != ours:
            raise ConfigError(
                f"the vLLM server at {self.url} serves {self._served_model!r} (from "
                f"{entry.get('root')}), whose tokenizer differs from engine.model "
                f"({self.model_dir}); start vLLM on the same model directory",
                param="engine.model",
            )

    # -- Engine Protocol: requests ---------------------------------------------------

    def add_request(self, request: GenerationRequest) -> RequestStreamImpl:
        self._started()
        body = self._body(request)
        capacity = self.config.max_num_seqs + self.config.max_waiting
        if len(self._flights) >= capacity:
            raise OverloadedError(
                f"the engine is at capacity ({capacity} requests); retry shortly",
                retry_after_s=1.0,
            )
        if request.request_id in self._flights:
            raise InvalidRequestError(f"duplicate request id {request.request_id}")
        lease = self._names.acquire(request.agent)
        if lease is None:
            raise NotFoundError(f"no adapter is loaded for agent {request.agent!r}", param="model")
        body["model"] = self._served_model if lease.served is None else lease.served.name
        loop = asyncio.get_running_loop()
        stream = RequestStreamImpl(request.request_id, loop, self.abort)
        task = loop.create_task(self._run(request, body, lease, stream))
        self._flights[request.request_id] = _Flight(task, lease)
        return stream

    def abort(self, request_id: str) -> None:
        """Abort by id (same as `RequestStream.abort`): the HTTP stream is closed."""
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.task.cancel()

    def _stop_ids(self, request: GenerationRequest) -> frozenset[int]:
        sp = request.sampling
        eos = frozenset() if sp.ignore_eos else self.eos_token_ids
        return eos | frozenset(sp.stop_token_ids)

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        """The completion request (without `model`); validates like the embedded engine."""
        sp = request.sampling
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if sp.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if len(prompt) + sp.max_tokens > self._max_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self._max_len} tokens; the request needs "
                f"{len(prompt)} prompt + {sp.max_tokens} completion tokens",
                param="max_tokens" if len(prompt) < self._max_len else "messages",
            )
        if any(not 0 <= t < self._vocab for t in prompt):
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self._vocab})", param="prompt"
            )
        check_supported(request.guided, CAPABILITIES)
        body: dict[str, Any] = {
            "prompt": list(prompt),
            "max_tokens": sp.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "stream": True,
            "logprobs": sp.top_logprobs,  # 0: the sampled token's own logprob only
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "ignore_eos": sp.ignore_eos,
            "stop_token_ids": sorted(self._stop_ids(request)),
            "skip_special_tokens": True,
        }
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.stop:
            body["stop"] = list(sp.stop)  # vLLM stops too; the text is cut here (`Detokenizer`)
        if request.guided is not None:
            body["structured_outputs"] = structured_outputs(request.guided)
        return body

    async def _run(
        self,
        request: GenerationRequest,
        body: dict[str, Any],
        lease: Lease,
        stream: RequestStreamImpl,
    ) -> None:
        rid, prompt_len = request.request_id, len(request.prompt_token_ids)
        detok = Detokenizer(self._tokenizer, request.sampling.stop)
        reason: FinishReason | None = None
        try:
            async with contextlib.aclosing(self._started().stream(body)) as chunks:
                async for chunk in chunks:
                    reason = self._on_chunk(chunk, request, lease, detok, stream)
                    if reason is not None:
                        break  # closing the stream (aclosing) makes vLLM stop generating
            if reason is None:
                raise EngineUnavailableError(
                    f"the vLLM server at {self.url} ended the stream early"
                )
            tail = detok.flush()
            stream.push(RequestOutput(rid, [], tail, True, reason, prompt_len))
        except asyncio.CancelledError:  # aborted (by the consumer or by `stop`)
            stream.push(RequestOutput(rid, [], "", True, "abort", prompt_len))
        except CloraError as exc:
            if exc.code == ADAPTER_MISSING and lease.served is not None:
                self._reload_later(lease.served)
            stream.push(exc)
        except Exception as exc:  # a bug here must fail the request, not hang it
            log.exception("vLLM request %s failed", rid)
            stream.push(EngineError(f"the vLLM request failed: {exc!r}"))
        finally:
            self._flights.pop(rid, None)
            drained = self._names.release(lease)
            if drained is not None:
                self._unload_later(drained)

    def _on_chunk(
        self,
        chunk: Mapping[str, Any],
        request: GenerationRequest,
        lease: Lease,
        detok: Detokenizer,
        stream: RequestStreamImpl,
    ) -> FinishReason | None:
        """Push one streamed chunk's tokens; the finish reason if the request ended."""
        choices = chunk.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        stop_ids = self._stop_ids(request)
        events, text, reason = self._tokens(choice, lease.version, detok, stop_ids, request)
        self._chunks += 1
        if events or text:
            stream.push(
                RequestOutput(
                    request.request_id,
                    events,
                    text,
                    prompt_tokens=len(request.prompt_token_ids),
                )
            )
        if reason is None and choice.get("finish_reason") is not None:
            reason = _FINISH.get(str(choice["finish_reason"]))
            if reason is None:
                raise EngineError("the vLLM server ended the request with an error")
        return reason

    def _tokens(
        self,
        choice: Mapping[str, Any],
        version: int,
        detok: Detokenizer,
        stop_ids: frozenset[int],
        request: GenerationRequest,
    ) -> tuple[list[TokenEvent], str, FinishReason | None]:
        """One chunk's tokens as events, their final text, and "stop" if one ended the request."""
        ids = choice.get("token_ids") or []
        logprobs = choice.get("logprobs") or {}
        values = logprobs.get("token_logprobs") or []
        tops = logprobs.get("top_logprobs") or []
        if len(values) != len(ids):
            raise EngineError("the vLLM server sent tokens without their logprobs")
        k = request.sampling.top_logprobs
        events: list[TokenEvent] = []
        text = ""
        for i, token_id in enumerate(ids):
            value = values[i]
            if value is None:
                raise EngineError("the vLLM server sent a token without its logprob")
            top = _top(tops[i], k) if i < len(tops) else ()
            events.append(TokenEvent(int(token_id), float(value), version, top))
            self._generated += 1
            if token_id in stop_ids:
                return events, text, "stop"  # kept as a token (the policy chose it), no text
            delta, hit_stop = detok.add(int(token_id))
            text += delta
            if hit_stop:
                return events, text, "stop"
        return events, text, None

    # -- Engine Protocol: adapters ---------------------------------------------------

    async def load_adapter(self, ref: AdapterRef) -> None:
        """Load `ref.path` under a fresh name; new requests get it once the server has it.

        The directory is validated here first (against `lora_limits`), and must be
        readable by the server at the same path (same machine or shared storage).
        """
        client = self._started()
        if ref.path is None:
            raise AdapterError(f"adapter {ref.agent} v{ref.version} has no directory to load")
        path = Path(ref.path).resolve()
        await asyncio.to_thread(load_peft_adapter, path, limits=self._limits)
        async with self._adapter_lock:
            live = self._names.live(ref.agent)
            if live is not None and live.version == ref.version and live.path == path:
                return
            name = self._names.new_name(ref.agent, ref.version)
            await client.load_lora(name, str(path))
            drained = self._names.publish(ServedName(ref.agent, ref.version, name, path))
            if drained is not None:
                await self._unload(drained)
        log.info("vLLM engine: agent %s serves v%d as %s", ref.agent, ref.version, name)

    async def unload_adapter(self, agent: str) -> None:
        self._started()
        async with self._adapter_lock:
            drained = self._names.withdraw(agent)
            if drained is not None:
                await self._unload(drained)

    def adapter_version(self, agent: str) -> int | None:
        served = self._names.live(agent)
        return None if served is None else served.version

    async def _unload(self, served: ServedName) -> None:
        client = self._client
        if client is None:
            return
        try:
            await client.unload_lora(served.name)
        except CloraError as exc:  # the server forgets it on restart anyway
            log.warning("vLLM engine: could not unload %s: %s", served.name, exc.message)

    async def _reload(self, served: ServedName) -> None:
        """Load `served` again under its own name (same version, same directory): the server
        lost it, e.g. it restarted; nothing of it is cached there any more."""
        client = self._client
        if client is None or served.retired:
            return
        try:
            await client.load_lora(served.name, str(served.path))
            log.warning("vLLM engine: reloaded %s, which the server had lost", served.name)
        except CloraError as exc:  # e.g. already reloaded by another request, or still down
            log.warning("vLLM engine: could not reload %s: %s", served.name, exc.message)
        finally:
            self._reloading.discard(served.name)

    def _reload_later(self, served: ServedName) -> None:
        if served.name in self._reloading:
            return
        self._reloading.add(served.name)
        self._background(self._reload(served))

    def _unload_later(self, served: ServedName) -> None:
        self._background(self._unload(served))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._flights),
            waiting=0,
            max_num_seqs=self.config.max_num_seqs,
            max_waiting=self.config.max_waiting,
            steps=self._chunks,
            generated_tokens=self._generated,
            adapters=self._names.versions(),
        )
