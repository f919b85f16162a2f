"""`VLLMEngine`: the `Engine` Protocol over vLLM OpenAI servers, driven by prompt token ids.

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
an old name is unloaded after its last request. A name a server has lost
(it restarted) fails its request with a retriable 503 and is loaded again on
next use. Abort closes the HTTP stream (vLLM aborts a request whose client
disconnects).

Replicas (`engine.vllm.urls`, see `replicas`): a request goes to its agent's
home replica (rendezvous hashing), spilling over when that one is down or full,
and the adapter is loaded there on first use; a replica that stops answering
`/health` is taken out and its in-flight requests fail at once with a retriable
503 (`EngineUnavailableError`), never a hang.

`start` refuses a server that cannot give what capture promises: it must serve
the same model as `engine.model` (the same tokenizer, checked through
`/tokenize`, and the same `config.json` when its directory is visible here) and report
raw behaviour logprobs, as the embedded engine does and the trainer scores
(vLLM's default `--logprobs-mode raw_logprobs`, checked by a probe, see `checks`). Every replica passes
these checks before it gets requests, at start and when it comes back.

Not here: HTTP details and error translation (see `client`), the name
bookkeeping (see `names`), placement and health (see `replicas`), starting a
server (see `supervisor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from clora_feedback.config import EngineConfig
from clora_feedback.engine.detok import Detokenizer
from clora_feedback.engine.stream import RequestStreamImpl
from clora_feedback.engine.types import (
    EngineCapabilities,
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestOutput,
)
from clora_feedback.engine.vllm.checks import check_logprobs_mode, check_server
from clora_feedback.engine.vllm.chunks import chunk_tokens
from clora_feedback.engine.vllm.client import ADAPTER_MISSING, VLLMClient
from clora_feedback.engine.vllm.guided import structured_outputs
from clora_feedback.engine.vllm.names import AdapterNames, Lease, ServedName
from clora_feedback.engine.vllm.replicas import (
    Replica,
    ReplicaSet,
    max_loras_from_metrics,
)
from clora_feedback.engine.vllm.supervisor import VLLMSupervisor
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
from clora_feedback.lora.peft_io import check_peft_adapter
from clora_feedback.lora.weights import LoRALimits
from clora_feedback.model.config import ModelConfig
from clora_feedback.store.versions import AdapterRef

log = logging.getLogger(__name__)

CAPABILITIES = EngineCapabilities(
    per_token_versions=False,
    logprobs="raw",
    in_memory_adapters=False,
    constraints=frozenset({"json_schema", "tool_call"}),
)

_FINISH: Mapping[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def _server_finished(chunk: Mapping[str, Any]) -> bool:
    """Whether vLLM reports the request finished in this chunk (its stream ends next)."""
    choices = chunk.get("choices") or []
    return bool(choices) and choices[0].get("finish_reason") is not None


class _LoopStream(RequestStreamImpl):
    """A request's stream fed on the event loop it is read on: the vLLM engine's requests
    run as tasks of that loop, so a chunk goes straight into the queue, without the
    thread-safe hand-off (`call_soon_threadsafe`: a self-pipe write, its read and one more
    loop turn per chunk) that the embedded engine's decode thread needs."""

    def push(self, item: RequestOutput | CloraError) -> None:
        self._queue.put_nowait(item)


@dataclass(eq=False)
class _Flight:
    lease: Lease
    task: asyncio.Task[None] = field(init=False)
    replica: Replica | None = None  # set once placed
    failure: CloraError | None = None  # why it was cancelled, when not an abort


class VLLMEngine:
    """`Engine` backed by vLLM OpenAI servers (`engine.vllm.urls`, one per replica).

    Args:
        model_dir: the base model's directory (the tokenizer and the LoRA limits are
            read from it); the servers must serve the same model.
        config: the engine settings (`config.vllm` names the servers).
        model_name: the public name of the base model (`/v1/models`).
        supervisor: a local server to start first and stop last (its URL is the replica).
    """

    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        *,
        model_name: str | None = None,
        supervisor: VLLMSupervisor | None = None,
    ) -> None:
        urls = list(config.vllm.urls) or ([supervisor.url] if supervisor is not None else [])
        if not urls:
            raise ConfigError(
                "engine.kind 'vllm' needs engine.vllm.urls (the vLLM servers' base URLs), or "
                "engine.vllm.local.enabled to start a local server",
                param="engine.vllm.urls",
            )
        self.config = config
        self.supervisor = supervisor
        self.urls = [u.rstrip("/").removesuffix("/v1") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError("engine.vllm.urls lists a server twice", param="engine.vllm.urls")
        self.url = self.urls[0]
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
        self._replicas: ReplicaSet | None = None
        self._health: asyncio.Task[None] | None = None
        self._served_model = config.vllm.served_model_name or ""
        self._flights: dict[str, _Flight] = {}
        self._unloads: set[asyncio.Task[None]] = set()  # unloads and health checks under way
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
        """The base model's name on the servers (known after `start`)."""
        return self._served_model

    @property
    def replicas(self) -> ReplicaSet:
        """The replica set (after `start`): health, placement, loaded names."""
        return self._started()

    async def start(self) -> None:
        """Connect to every replica; refuse one on another model or with the wrong logprobs mode.

        Replicas that do not answer `/health` within `startup_timeout_s` start out of
        service (the health poll admits them when they answer); at least one must answer.

        Raises:
            EngineUnavailableError: no replica answered `/health` within `startup_timeout_s`.
            ConfigError: another model or tokenizer, or logprobs not `raw_logprobs`.
        """
        cfg = self.config.vllm
        if self.supervisor is not None:
            await self.supervisor.start()
        fallback = cfg.max_cpu_loras or cfg.max_loras or self.config.max_loras
        fixed = cfg.max_cpu_loras is not None  # names kept: the configured host cache
        replicas = [
            Replica(url, self._new_client(url), fallback, fixed_max_loras=fixed)
            for url in self.urls
        ]
        self._replicas = ReplicaSet(
            replicas,
            on_down=self._fail_flights_on,
            admit=self._admit,
            wanted=self._names.find,
            ours=self._names.is_ours,
            health_timeout_s=cfg.health_timeout_s,
            queue_timeout_s=cfg.read_timeout_s,
            health_failures=cfg.health_failures,
        )
        try:
            healthy = await self._wait_healthy(replicas, cfg.startup_timeout_s)
            for replica in healthy:
                await self._replicas.bring_up(replica)
        except BaseException:
            await self._close_clients()
            if self.supervisor is not None:
                await self.supervisor.stop()
            raise
        self._health = asyncio.get_running_loop().create_task(
            self._replicas.run(cfg.health_interval_s)
        )
        log.info(
            "vLLM engine: %d of %d replicas serve %s (context %d): %s",
            len(healthy), len(replicas), self._served_model, self._max_len,
            ", ".join(r.url for r in healthy),
        )  # fmt: skip

    def _new_client(self, url: str) -> VLLMClient:
        cfg = self.config.vllm
        return VLLMClient(
            url,
            api_key=cfg.api_key,
            connect_timeout_s=cfg.connect_timeout_s,
            read_timeout_s=cfg.read_timeout_s,
        )

    async def stop(self) -> None:
        """Abort what is in flight and unload every adapter name this engine loaded."""
        replicas = self._replicas
        if replicas is None:
            return
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
            self._health = None
        flights = list(self._flights.values())
        for flight in flights:
            flight.task.cancel()
        await asyncio.gather(*(f.task for f in flights), return_exceptions=True)
        await asyncio.gather(*self._unloads, return_exceptions=True)
        for served in self._names.everything():
            await replicas.unload_everywhere(served)
        self._names.clear()
        await self._close_clients()
        if self.supervisor is not None:
            await self.supervisor.stop()

    async def _close_clients(self) -> None:
        replicas, self._replicas = self._replicas, None
        for replica in replicas.replicas if replicas is not None else []:
            if isinstance(replica.client, VLLMClient):
                await replica.client.close()

    def _started(self) -> ReplicaSet:
        if self._replicas is None:
            raise EngineError("the vLLM engine is not started")
        return self._replicas

    async def _wait_healthy(self, replicas: list[Replica], timeout_s: float) -> list[Replica]:
        """The replicas answering `/health` once every one does or `timeout_s` passed
        (the rest join later); raises when none does."""
        deadline = time.monotonic() + timeout_s
        while True:
            timeout = self.config.vllm.health_timeout_s
            answers = await asyncio.gather(*(r.client.healthy(timeout) for r in replicas))
            healthy = [r for r, ok in zip(replicas, answers, strict=True) if ok]
            if len(healthy) == len(replicas) or (healthy and time.monotonic() > deadline):
                return healthy
            if time.monotonic() > deadline:
                raise EngineUnavailableError(
                    f"no vLLM server of {', '.join(self.urls)} answered /health within "
                    f"{timeout_s:.0f} s"
                )
            await asyncio.sleep(0.5)

    async def _admit(self, replica: Replica) -> None:
        """The start-up checks of one replica (also when it comes back): same model and
        tokenizer, raw logprobs; learn its context and `--max-loras`."""
        client = replica.client
        if not isinstance(client, VLLMClient):
            return  # a test's fake replica: nothing to check
        wanted = self.config.vllm.served_model_name or self._served_model or None
        base = await check_server(client, self.model_dir, self._tokenizer, wanted)
        await check_logprobs_mode(client, self._tokenizer, base.name)
        self._served_model = base.name
        if base.max_model_len is not None:
            self._max_len = min(self._max_len, base.max_model_len)
        reported = max_loras_from_metrics(await client.metrics_text())
        if reported is not None and not replica.fixed_max_loras:
            replica.max_loras = reported

    def _fail_flights_on(self, replica: Replica) -> None:
        """A replica was taken out: its requests fail now with a retriable 503."""
        for flight in list(self._flights.values()):
            if flight.replica is replica and not flight.task.done():
                flight.failure = EngineUnavailableError(
                    f"the vLLM server at {replica.url} stopped answering; retry shortly"
                )
                flight.task.cancel()

    # -- Engine Protocol: requests ---------------------------------------------------

    def add_requests(self, requests: Sequence[GenerationRequest]) -> list[RequestStreamImpl]:
        """Each request is its own HTTP call, sent at once; a refusal aborts those sent."""
        streams: list[RequestStreamImpl] = []
        try:
            for request in requests:
                streams.append(self.add_request(request))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    def add_request(self, request: GenerationRequest) -> RequestStreamImpl:
        self._started()
        body = self.completion_body(request)
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
        stream = _LoopStream(request.request_id, loop, self.abort)
        flight = _Flight(lease)
        flight.task = loop.create_task(self._run(request, body, flight, stream))
        self._flights[request.request_id] = flight
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

    def completion_body(self, request: GenerationRequest) -> dict[str, Any]:
        """The `/v1/completions` body sent for `request`, without `model` (set at admission);
        validates like the embedded engine. Public so a benchmark can replay the very body
        straight to vLLM.

        Raises:
            InvalidRequestError, ContextLengthError: as `add_request`.
        """
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
        sp.check(self._vocab)
        CAPABILITIES.check(request.guided)
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
            # vLLM takes a signed 64-bit seed and reads -1 as "unseeded": drop the top bit of
            # our unsigned seed, which keeps the n consecutive choice seeds distinct.
            body["seed"] = sp.seed & (2**63 - 1)
        if sp.top_k:
            body["top_k"] = sp.top_k
        if sp.min_tokens:
            body["min_tokens"] = sp.min_tokens
        if sp.presence_penalty:
            body["presence_penalty"] = sp.presence_penalty
        if sp.frequency_penalty:
            body["frequency_penalty"] = sp.frequency_penalty
        if sp.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in sp.logit_bias}  # JSON keys: strings
        if sp.stop:
            body["stop"] = list(sp.stop)  # vLLM stops too; the text is cut here (`Detokenizer`)
        if request.guided is not None:
            body["structured_outputs"] = structured_outputs(request.guided)
        return body

    async def _run(
        self,
        request: GenerationRequest,
        body: dict[str, Any],
        flight: _Flight,
        stream: RequestStreamImpl,
    ) -> None:
        rid, prompt_len, lease = request.request_id, len(request.prompt_token_ids), flight.lease
        replicas = self._started()
        replica: Replica | None = None
        try:
            replica = await replicas.place(lease.served, request.agent or rid)
            flight.replica = replica
            await self._stream(replica, request, body, lease, stream)
        except asyncio.CancelledError:  # aborted (by the consumer or by `stop`), or replica out
            if flight.failure is not None:
                stream.push(flight.failure)
            else:
                stream.push(RequestOutput(rid, [], "", True, "abort", prompt_len))
        except CloraError as exc:
            if replica is not None and isinstance(exc, EngineUnavailableError):
                self._on_unavailable(replica, exc, lease)
            stream.push(exc)
        except Exception as exc:  # a bug here must fail the request, not hang it
            log.exception("vLLM request %s failed", rid)
            stream.push(EngineError(f"the vLLM request failed: {exc!r}"))
        finally:
            self._flights.pop(rid, None)
            if replica is not None:
                replicas.release(replica, lease.served)
            drained = self._names.release(lease)
            if drained is not None:
                self._background(replicas.unload_everywhere(drained))

    async def _stream(
        self,
        replica: Replica,
        request: GenerationRequest,
        body: dict[str, Any],
        lease: Lease,
        stream: RequestStreamImpl,
    ) -> None:
        """Stream the request from `replica` into `stream`, the final output included.

        When vLLM itself ended the request, the rest of its stream (`[DONE]`) is read
        after the final output went out, so the connection goes back to the pool for
        the next request; when this side stopped it first (a stop string), closing the
        stream (aclosing) makes vLLM stop.
        """
        detok = Detokenizer(self._tokenizer, request.sampling.stop, request.sampling.min_tokens)
        client = replica.client
        assert isinstance(client, VLLMClient), "requests go to real clients only"
        stop_ids = self._stop_ids(request)  # once per request, not per chunk
        async with contextlib.aclosing(client.stream(body)) as chunks:
            async for chunk in chunks:
                reason = self._on_chunk(chunk, request, lease, detok, stream, stop_ids)
                if reason is None:
                    continue
                prompt_len = len(request.prompt_token_ids)
                stream.push(
                    RequestOutput(request.request_id, [], detok.flush(), True, reason, prompt_len)
                )
                if _server_finished(chunk):
                    async for _ in chunks:  # only `[DONE]` is left
                        pass
                return
        raise EngineUnavailableError(f"the vLLM server at {replica.url} ended the stream early")

    def _on_unavailable(self, replica: Replica, exc: CloraError, lease: Lease) -> None:
        """A replica failed a request: a lost name is loaded again on next use; anything
        else may be a dead server, so check its health now rather than at the next poll."""
        if exc.code == ADAPTER_MISSING and lease.served is not None:
            self._started().forget(replica, lease.served.name)
        else:
            self._background(self._started().check(replica, suspect=True))

    def _on_chunk(
        self,
        chunk: Mapping[str, Any],
        request: GenerationRequest,
        lease: Lease,
        detok: Detokenizer,
        stream: RequestStreamImpl,
        stop_ids: frozenset[int],
    ) -> FinishReason | None:
        """Push one streamed chunk's tokens; the finish reason if the request ended
        (`stop_ids`: the request's `_stop_ids`)."""
        choices = chunk.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        k = request.sampling.top_logprobs
        events, text, reason = chunk_tokens(choice, lease.version, detok, stop_ids, k)
        self._generated += len(events)
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

    # -- Engine Protocol: adapters ---------------------------------------------------

    async def load_adapter(self, ref: AdapterRef) -> None:
        """Load `ref.path` under a fresh name; new requests get it once a server has it.

        It is loaded on the agent's home replica and on every replica its previous
        version is loaded on (elsewhere on first use). The directory is checked here
        first against `lora_limits` from its config and safetensors header
        (`check_peft_adapter`: vLLM reads the tensors itself; values were checked where
        the version was made, by the trainer or the registry's import), and must be readable by the servers at the same
        path (same machine or shared storage): a server that cannot read it refuses it.
        """
        replicas = self._started()
        if ref.path is None:
            raise AdapterError(f"adapter {ref.agent} v{ref.version} has no directory to load")
        path = Path(ref.path).resolve()
        await asyncio.to_thread(check_peft_adapter, path, limits=self._limits)
        async with self._adapter_lock:
            live = self._names.live(ref.agent)
            if live is not None and live.version == ref.version and live.path == path:
                return
            served = ServedName(
                ref.agent, ref.version, self._names.new_name(ref.agent, ref.version), path
            )
            await replicas.load_where_needed(served, live)
            drained = self._names.publish(served)
            if drained is not None:  # off the publish's path, like a drained name's unload
                self._background(replicas.unload_everywhere(drained))
        log.info("vLLM engine: agent %s serves v%d as %s", ref.agent, ref.version, served.name)

    async def unload_adapter(self, agent: str) -> None:
        replicas = self._started()
        async with self._adapter_lock:
            drained = self._names.withdraw(agent)
            if drained is not None:
                await replicas.unload_everywhere(drained)

    def adapter_version(self, agent: str) -> int | None:
        served = self._names.live(agent)
        return None if served is None else served.version

    def prefetch(self, agent: str) -> None:
        """Engine Protocol: nothing to start; a replica loads an adapter it does not hold on
        the request itself (from its CPU LRU, `--max-cpu-loras`, or from disk)."""

    def replica_of(self, agent: str) -> str | None:
        """Engine Protocol: the URL of `agent`'s home replica (`ReplicaSet.home`), or None
        before `start` or while no replica is up. A request spills over to the next replica
        in the agent's order only while its home is full."""
        home = None if self._replicas is None else self._replicas.home(agent)
        return None if home is None else home.url

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
