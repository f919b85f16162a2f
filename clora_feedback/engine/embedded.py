"""The embedded torch engine: continuous batching over one warm base model, per-row multi-LoRA.

One background thread owns the model and runs the step loop; callers on any
asyncio loop submit requests and receive chunks through `RequestStreamImpl`.
Each step, in order:

1. apply pending adapter operations (install, update, removal), so an update
   lands between decode steps and never inside a forward pass. An update of a
   resident adapter is staged: `set_adapter` writes the new weights into the
   engine's one spare slot on the caller's thread, while decoding goes on, and
   the step only flips the agent (and its running rows) to that slot; the old
   slot becomes the spare. Only a non-resident agent's weights are written by
   the step itself, when a request first needs them (the bookkeeping is
   `slots.AdapterSlots`);
2. drop aborted sequences, freeing their KV-cache rows at once;
3. admit waiting sequences into free rows (loading their adapter into a slot,
   evicting an idle one if needed). An agent registered by its directory, or
   whose host copy the host cache dropped (`engine.host_adapter_cache_mb`), is
   read on a reader thread as soon as its request is routed (`prefetch`) or
   arrives (`add_request`), and its request waits for that read, then for one
   slot write, never for the batch to drain; the rest of the batch keeps
   decoding meanwhile. The service's own evaluation traffic (`background`
   requests) holds at most `engine.background_rows` rows while clients are
   served, and advances on a token credit (`engine.background_tokens_per_step`),
   so a release gate costs the clients' rows a bounded share of each step;
4. prefill admitted prompts in chunks under a token budget, so a long prompt
   cannot stall the other rows for long; a prompt first takes its longest
   cached prefix from the prefix cache (`prefix_cache`: blocks keyed by the
   tokens and the slot's adapter identity) and prefills only the rest. Prompt
   blocks are stored as they are prefilled, a conversation's generated blocks
   when it finishes, so its next turn (and `n > 1` siblings) reuse them;
5. decode one token for every running sequence, all agents in one batch; in a
   step that prefills, the decoding rows ride along in the prefill's forward
   as one-token chunks (`fuse_prefill`), so the weights are read once.

Not here: HTTP, chat templates, persistence, which adapter sits in which slot (see `slots`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from clora_feedback.chat_format.constraint import vocab_texts
from clora_feedback.config import EngineConfig
from clora_feedback.cores import CoreShare, process_share, set_thread_teams
from clora_feedback.engine.decoder import KVCache, PrefillChunk, SlottedDecoder
from clora_feedback.engine.detok import Detokenizer
from clora_feedback.engine.guided import compile_guided
from clora_feedback.engine.prefix_cache import PrefixCache, PrefixChain
from clora_feedback.engine.sampling import RowSampler, sample_batch
from clora_feedback.engine.slots import AdapterSlots, HostAdapters
from clora_feedback.engine.stream import RequestStreamImpl, engine_failure
from clora_feedback.engine.types import (
    EngineCapabilities,
    EngineStats,
    FinishReason,
    GenerationRequest,
    HostCacheStats,
    RequestOutput,
    TokenEvent,
)
from clora_feedback.errors import (
    AdapterError,
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
)
from clora_feedback.hardware import cpu_features, dtype_name, resolve_dtype
from clora_feedback.lora.ops import LoRABatch
from clora_feedback.lora.peft_io import check_peft_adapter, load_peft_adapter
from clora_feedback.lora.weights import LoRALimits, LoRAWeights
from clora_feedback.model.base import BaseWeights
from clora_feedback.store.versions import AdapterRef

log = logging.getLogger(__name__)

_CAPABILITIES = EngineCapabilities(
    per_token_versions=True,
    logprobs="raw",
    in_memory_adapters=True,
    constraints=frozenset({"json_schema", "tool_call", "tool_call_trigger"}),
)


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    stream: RequestStreamImpl
    sampler: RowSampler
    detok: Detokenizer
    stop_ids: frozenset[int]
    row: int = -1
    slot: int = 0
    prefilled: int = 0  # prompt tokens already in the cache
    generated: int = 0
    last_token: int = -1
    pending: list[TokenEvent] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    chain: PrefixChain | None = None  # its prefix-cache blocks, once prefill began

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.prompt_len


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


class EmbeddedEngine:
    """Reference `Engine`: torch on CPU or CUDA, one model, many adapters, one batch."""

    prefill_chunk_tokens = 512
    # One forward for every prompt chunk of a step (`SlottedDecoder.prefill_many`); False runs
    # them one sequence at a time (the baseline of scripts/prefill_batch_profile.py).
    batch_prefill = True
    # Decode rows ride along in a step's prefill forward (`_prefill`); False runs them in a
    # forward of their own (the baseline of benchmarks/fused_prefill.py).
    fuse_prefill = True
    # Most tokens one background prompt chunk takes while clients are served, and the
    # most credit that accumulates: a case's prompt beyond its cached prefix in one chunk
    # (a forward per few tokens would pay the other adapter's fixed cost each step).
    background_chunk_tokens = 32

    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig | None = None,
        *,
        model_name: str | None = None,
        cores: CoreShare | None = None,
    ):
        config = config or EngineConfig()
        self.config = config
        self.cores = cores or process_share()
        self.model_dir = Path(model_dir)
        self._model_name = model_name or Path(model_dir).name
        self.device = resolve_device(config.device)
        self.model = SlottedDecoder.from_dir(
            Path(model_dir),
            max_loras=config.max_loras + 1,  # + the spare slot updates are staged into
            max_lora_rank=config.max_lora_rank,
            target_modules=tuple(config.lora_target_modules),
            dtype=resolve_dtype(config.dtype, self.device),
            device=self.device,
        )
        log.info(
            "embedded engine: %s on %s (engine.dtype %s), dense kernel %s; CPU: %s",
            dtype_name(self.model.dtype),
            self.device,
            config.dtype,
            self.model.kernel_name,
            cpu_features().describe(),
        )
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._max_len = min(config.max_model_len, self.model.config.max_position_embeddings)
        self.cache = KVCache(
            self.model.config, config.max_num_seqs, self._max_len, self.model.dtype, self.device
        )
        self.prefix_cache = (
            PrefixCache(self.cache, config.prefix_cache_mb << 20)
            if config.prefix_cache_mb
            else None
        )
        eos = set(self.model.config.eos_token_ids)
        if self._tokenizer.eos_token_id is not None:
            eos.add(int(self._tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)

        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._aborts: set[str] = set()
        self._retiring: set[str] = set()
        """Agents removed while requests queued for them still wait: those still run on
        its weights (they were accepted); new ones are refused; dropped by `_retire`."""
        self._free_rows = list(range(config.max_num_seqs))
        self._slots = AdapterSlots(
            self.model,
            self._lock,
            host_cache_bytes=None
            if config.host_adapter_cache_mb is None
            else config.host_adapter_cache_mb << 20,
            reader=self._read_adapter,
        )
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._steps = 0
        self._generated = 0
        self._ids = itertools.count()
        # Background tokens per step while clients are served (an attribute, so the
        # benchmarks can set it), and the credit they accumulate (`_background_allowance`).
        self.background_tokens_per_step = config.background_tokens_per_step
        self._background_credit = 0.0

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
        return self.model.limits

    @property
    def capabilities(self) -> EngineCapabilities:
        """Per-token versions (a staged flip moves running rows between decode steps) and
        raw behaviour logprobs (see `sampling`: the trainer's policy is the temperature-1
        model, so fresh samples get an importance ratio of exactly 1)."""
        return _CAPABILITIES

    @property
    def last_publish_s(self) -> float | None:
        """Seconds the last staged update spent writing the spare slot (benchmarks)."""
        return self._slots.last_publish_s

    @property
    def base_weights(self) -> BaseWeights:
        """The base tensors this engine serves from (read-only; a co-located trainer may share them)."""
        return self.model.base

    async def start(self) -> None:
        self.start_thread()
        # Decoding the whole vocabulary takes a moment on large tokenizers: once, off the
        # loop, so the first constrained request does not stall it.
        await asyncio.to_thread(self._token_texts)

    def _token_texts(self) -> list[str]:
        tokenizer: Any = self._tokenizer
        return vocab_texts(tokenizer)

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_thread)

    def start_thread(self) -> None:
        if self._thread is None:
            self._stopping = False
            self.cores.serving = True  # a trainer beside it takes half the cores
            self._thread = threading.Thread(target=self._loop, name="clora-engine", daemon=True)
            self._thread.start()

    def stop_thread(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- Engine Protocol: requests ---------------------------------------------------

    def add_request(self, request: GenerationRequest) -> RequestStreamImpl:
        return self.add_requests([request])[0]

    def add_requests(self, requests: Sequence[GenerationRequest]) -> list[RequestStreamImpl]:
        """Queue `requests` under one lock: the step loop admits them together."""
        seqs = [self._sequence(request) for request in requests]
        with self._lock:
            for seq in seqs:
                self._check_admission(seq.request, len(seqs))
            for seq in seqs:
                self._waiting.append(seq)
                self._by_id[seq.request.request_id] = seq
            self._lock.notify_all()
        return [seq.stream for seq in seqs]

    def _check_admission(self, request: GenerationRequest, arriving: int) -> None:
        """Under the lock: the agent is served, the id is new, the queue has room."""
        if request.agent is not None and not self._serves(request.agent):
            raise NotFoundError(f"no adapter is loaded for agent {request.agent!r}", param="model")
        if request.request_id in self._by_id:
            raise InvalidRequestError(f"duplicate request id {request.request_id}")
        capacity = self.config.max_num_seqs + self.config.max_waiting
        if arriving > capacity:  # never fits, however long the client waits
            raise InvalidRequestError(
                f"this request needs {arriving} sequences (prompts x n); the engine holds at "
                f"most {capacity}",
                param="n",
            )
        if len(self._waiting) + len(self._running) + arriving > capacity:
            raise OverloadedError(
                f"the engine is at capacity ({capacity} requests); retry shortly",
                retry_after_s=1.0,
            )

    def _sequence(self, request: GenerationRequest) -> _Sequence:
        """A checked request as the step loop's sequence (not queued yet)."""
        sp = request.sampling
        if not request.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if sp.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        total = len(request.prompt_token_ids) + sp.max_tokens
        if total > self._max_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self._max_len} tokens; the request needs "
                f"{len(request.prompt_token_ids)} prompt + {sp.max_tokens} completion tokens",
                param="max_tokens" if len(request.prompt_token_ids) < self._max_len else "messages",
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        sp.check(vocab)
        _CAPABILITIES.check(request.guided)
        constraint = None
        if request.guided is not None:
            constraint = compile_guided(request.guided, self._token_texts())
        loop = asyncio.get_running_loop()
        stream = RequestStreamImpl(request.request_id, loop, self._abort)
        stop_ids = frozenset(() if sp.ignore_eos else self.eos_token_ids) | frozenset(
            sp.stop_token_ids
        )
        seq = _Sequence(
            request=request,
            stream=stream,
            sampler=RowSampler.create(sp, constraint, stop_ids),  # min_tokens masks stop_ids
            detok=Detokenizer(self._tokenizer, sp.stop, sp.min_tokens),
            stop_ids=stop_ids,
        )
        if request.agent is not None:  # a cold agent's weights are read while it waits
            failed = self._slots.warm(request.agent)
            if failed is not None:
                raise AdapterError(
                    f"the adapter of agent {request.agent!r} cannot be read: {failed}"
                ) from failed
        return seq

    def _abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._by_id:
                self._aborts.add(request_id)
                self._lock.notify_all()

    def abort(self, request_id: str) -> None:
        """Abort by id (same as `RequestStream.abort`)."""
        self._abort(request_id)

    # -- Engine Protocol: adapters ---------------------------------------------------

    def set_adapter(
        self,
        agent: str,
        version: int,
        weights: LoRAWeights,
        *,
        checked: bool = False,
        owned: bool = False,
    ) -> None:
        """Serve `weights` as `agent`'s adapter `version` from the next decode step on.

        Args:
            checked: the caller already validated `weights` against `lora_limits`
                (the trainer builds them in the engine's own layout and checks the
                flat buffer once); skips the per-tensor check.
            owned: the engine may keep `weights` itself instead of a copy; the caller
                promises never to mutate them.
        """
        if not checked:
            weights.validate(self.model.limits)  # raises AdapterError before anything changes
        with self._lock:
            self._retiring.discard(agent)  # served again: its queued requests move on with it
        self._slots.stage(agent, version, weights if owned else weights.clone())

    def remove_adapter(self, agent: str) -> None:
        """Stop serving `agent` to new requests. Requests already queued for it were
        accepted and still run on its weights, as running rows finish on them; its adapter
        is dropped once none waits (a release arm ending under a burst of its requests
        fails none of them).

        Raises:
            NotFoundError: no adapter is loaded for `agent`.
        """
        with self._lock:
            if agent in self._retiring:
                raise NotFoundError(f"no adapter is loaded for agent {agent!r}", param="lora_name")
            if any(seq.request.agent == agent for seq in self._waiting):
                self._retiring.add(agent)
                return
            self._slots.remove(agent)

    def _serves(self, agent: str) -> bool:
        """`agent` has an adapter that new requests may use (holds the lock)."""
        return agent in self._slots and agent not in self._retiring

    def _retire(self) -> None:
        """Drop the adapters of removed agents that no queued request waits for any more
        (holds the lock; the step clears their slots once their running rows finish)."""
        for agent in [
            a for a in self._retiring if all(s.request.agent != a for s in self._waiting)
        ]:
            self._retiring.discard(agent)
            self._slots.remove(agent)

    async def load_adapter(self, ref: AdapterRef) -> None:
        """Engine Protocol: `ref.weights` when given, else `ref.path` read off the event loop;
        validated against `lora_limits` before anything is evicted, then staged (`set_adapter`)."""
        if ref.weights is not None:
            await asyncio.to_thread(self.set_adapter, ref.agent, ref.version, ref.weights)
            return
        if ref.path is None:
            raise AdapterError(f"adapter {ref.agent} v{ref.version} has neither weights nor a path")
        weights = await asyncio.to_thread(load_peft_adapter, ref.path, limits=self.model.limits)
        # Read and checked just now, and held by nobody else: the engine keeps this copy.
        await asyncio.to_thread(
            self.set_adapter, ref.agent, ref.version, weights, checked=True, owned=True
        )

    def register_adapter(self, agent: str, version: int, path: Path) -> None:
        """Serve the version directory `path` as `agent`'s `version`, read on first use.

        Checks the PEFT config and the safetensors header against `lora_limits` (no
        tensor data is read: a registry version's values were checked when it was
        written); blocking, a few small reads.

        Raises:
            AdapterError: the directory does not fit the engine; nothing changed.
        """
        check_peft_adapter(path, limits=self.model.limits)
        with self._lock:
            self._retiring.discard(agent)
        self._slots.register(agent, version, Path(path))

    def set_adapter_source(self, agent: str, version: int, path: Path) -> None:
        """`agent`'s live `version` is also stored at `path`: its host copy may now be
        dropped from the host cache and read back from there when needed."""
        self._slots.set_source(agent, version, Path(path))

    def _read_adapter(self, path: Path) -> LoRAWeights:
        """A cold agent's weights, on a reader thread."""
        return load_peft_adapter(path, limits=self.model.limits)

    async def unload_adapter(self, agent: str) -> None:
        """Engine Protocol: `remove_adapter` (its queued requests still run); a no-op when
        no adapter is served for `agent`."""
        with self._lock:
            if self._serves(agent):
                self.remove_adapter(agent)

    def adapter_version(self, agent: str) -> int | None:
        with self._lock:
            return self._slots.version(agent) if self._serves(agent) else None

    def prefetch(self, agent: str) -> None:
        """Engine Protocol: a cold agent's version directory starts being read on a reader
        thread (its host copy was dropped from the budget, or never read since start-up)."""
        self._slots.warm(agent, hint=True)

    def replica_of(self, agent: str) -> str:
        """Engine Protocol: every agent lives in this process."""
        return "embedded"

    def adapter_weights(self, agent: str) -> tuple[int, LoRAWeights] | None:
        """The live (version, host copy of the weights) of an agent's adapter; do not mutate.
        Blocking: a cold agent's weights are read from its directory first."""
        with self._lock:
            if agent in self._retiring:
                return None
        return self._slots.get(agent)

    def host_cache_stats(self) -> dict[str, int]:
        """The host cache: bytes held, its budget (0: none), reads of cold agents, drops."""
        slots = self._slots
        return {
            "bytes": slots.host_bytes(),
            "capacity_bytes": slots.host_cache_bytes or 0,
            "reads": slots.reads,
            "drops": slots.drops,
        }

    def adapters(self) -> dict[str, int]:
        with self._lock:
            return self._served_versions()

    def _served_versions(self) -> dict[str, int]:
        """agent -> the version new requests get (holds the lock)."""
        return {a: v for a, v in self._slots.versions().items() if a not in self._retiring}

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                running=len(self._running),
                waiting=len(self._waiting),
                max_num_seqs=self.config.max_num_seqs,
                max_waiting=self.config.max_waiting,
                steps=self._steps,
                generated_tokens=self._generated,
                adapters=self._served_versions(),
                prefix_cache=self.prefix_cache.stats() if self.prefix_cache else None,
                host_cache=HostCacheStats(**self.host_cache_stats()),
            )

    # -- the step loop -----------------------------------------------------------------

    def _loop(self) -> None:
        # This thread's OpenMP teams: the user's engine.num_threads, else every core; fewer
        # while a trainer step or another process wants them (`cores`).
        width, teams = self.config.num_threads or self.cores.cores, 0
        while True:
            if (want := self.cores.engine_threads(width)) != teams:
                set_thread_teams(want)
                teams = want
            with self._lock:
                while not (
                    self._stopping
                    or self._waiting
                    or self._running
                    or self._aborts
                    or self._slots.pending
                ):
                    self._lock.wait()
                if self._stopping:
                    break
            try:
                worked = self.step()
            except Exception as exc:  # a failed step must not kill serving: fail its rows
                log.exception("engine step failed")
                self._fail_all(engine_failure(exc))
                continue
            if not worked:  # requests wait for an adapter read: sleep until it lands
                with self._lock:
                    if not (self._stopping or self._aborts or self._slots.pending):
                        self._lock.wait(0.05)
        self._fail_all(EngineError("the engine stopped"))

    def step(self) -> bool:
        """One scheduling + forward step (called by the engine thread); False when no
        sequence ran (every waiting one waits for its adapter's read or a slot)."""
        with self._lock:
            dirty, adapters = self._slots.begin_step(self._running)
            aborts, self._aborts = self._aborts, set()
        self._slots.apply_changes(dirty, adapters, self._running)
        for seq in self._running:  # a flip or rewrite moved the row's weights: stop storing
            if seq.chain is not None and seq.chain.identity != self._slots.identity_in(seq.slot):
                seq.chain.valid = False
        for request_id in aborts:
            self._finish_by_id(request_id, "abort")
        blocked = self._admit(adapters)
        if not self._running:
            return False
        # Credit protects running clients' steps; a client waiting for a row that a
        # background request holds (admitted while the server was idle) is better served
        # by letting that request finish at full speed.
        serving = any(not s.request.background for s in self._running)
        clients = serving and not (blocked and not self._free_rows)
        allowance = self._background_allowance(clients)
        decoding = []
        for seq in self._running:
            if seq.in_prefill:
                continue
            if seq.request.background:
                if allowance < 1:
                    continue  # out of credit: the row sits this step out, its KV row kept
                allowance -= 1
            decoding.append(seq)
        work, allowance = self._prefill_work(allowance)
        if clients:
            self._background_credit = allowance
        if not (work or decoding):
            return False  # only background rows, out of credit: the next step earns some
        if work and decoding and self.batch_prefill and self.fuse_prefill:
            self._prefill(work, decoding)  # one forward: no second read of the weights
        else:
            if work:
                self._prefill(work)
            if decoding:
                self._decode(decoding)
        self._steps += 1
        return True

    def _background_allowance(self, clients: bool) -> float:
        """Tokens background sequences may advance this step. With no client request
        running (or one waiting for a row while none is free): no limit. Otherwise
        the credit earned at `background_tokens_per_step` a step, kept up to one
        background chunk: a decoding background row spends 1, a prompt chunk its tokens.
        On a CPU a step's cost grows with its tokens beyond the weights' one read, so the
        rate bounds what evaluation costs the clients' rows (`benchmarks/fused_prefill.py`)."""
        if not clients:
            return float("inf")
        self._background_credit = min(
            self._background_credit + self.background_tokens_per_step,
            max(float(self.background_chunk_tokens), self.background_tokens_per_step),
        )
        return self._background_credit

    def _admit(self, adapters: HostAdapters) -> int:
        """Move waiting sequences into free rows, in arrival order; returns how many client
        (not background) requests still wait. Background requests
        (the gate's, the probe's) yield to clients: while any client request runs or
        waits, at most `engine.background_rows` of them run (at least one row always
        advances, so evaluation never starves); with no client they take every free row,
        so an idle server evaluates at full speed. On a CPU every row added to a step
        slows every row of it, so beside clients evaluation trickles."""
        with self._lock:
            candidates = list(self._waiting)
        background = sum(1 for s in self._running if s.request.background)
        clients = sum(1 for s in self._running if not s.request.background) + sum(
            1 for s in candidates if not s.request.background
        )
        for seq in candidates:
            if not self._free_rows:
                break
            if seq.request.background and clients and background >= self.config.background_rows:
                continue
            agent = seq.request.agent
            if agent is not None and agent not in adapters:
                if agent in self._slots:
                    continue  # loaded after this step's snapshot was taken: admit it next step
                self._remove_waiting(seq)
                self._emit_error(
                    seq,
                    NotFoundError(f"the adapter of agent {agent!r} was unloaded", param="model"),
                )
                continue
            if agent is not None and adapters[agent][1] is None and not self._slots.resident(agent):
                failed = self._slots.warm(agent)  # cold: being read (or its read failed)
                if failed is not None:
                    self._remove_waiting(seq)
                    self._emit_error(seq, AdapterError(
                        f"the adapter of agent {agent!r} cannot be read: {failed}"))  # fmt: skip
                continue
            slot = 0 if agent is None else self._slots.acquire(agent, adapters, self._running)
            if slot is None:
                continue  # every slot is busy with other agents' running rows; try later
            self._remove_waiting(seq)
            seq.slot = slot
            seq.row = heapq.heappop(self._free_rows)
            self._running.append(seq)
            if seq.request.background:
                background += 1
        self._running.sort(key=lambda s: s.row)
        with self._lock:
            self._retire()
            return sum(1 for s in self._waiting if not s.request.background)

    def _remove_waiting(self, seq: _Sequence) -> None:
        with self._lock:
            self._waiting.remove(seq)

    def _prefill_work(self, allowance: float) -> tuple[list[tuple[_Sequence, int, int]], float]:
        """(sequence, start, end) of the prompt chunks this step runs, under the step's
        token budget (a sequence's cached prefix is copied into its row first), and what is
        left of the background `allowance`: a background prompt's chunk (at most
        `background_chunk_tokens` while the allowance is finite) runs only when the
        allowance covers it."""
        budget = self.prefill_chunk_tokens
        work: list[tuple[_Sequence, int, int]] = []
        for seq in [s for s in self._running if s.in_prefill]:
            if budget <= 0:
                break
            if seq.request.background and allowance < 1:
                continue
            if seq.chain is None:
                self._reuse_prefix(seq)
            start = seq.prefilled
            end = min(seq.prompt_len, start + budget)
            if seq.request.background and allowance != float("inf"):
                end = min(end, start + self.background_chunk_tokens)
                if allowance < end - start:
                    continue  # the credit grows until this chunk fits
                allowance -= end - start
            work.append((seq, start, end))
            budget -= end - start
        return work, allowance

    def _prefill(
        self, work: list[tuple[_Sequence, int, int]], decoding: Sequence[_Sequence] = ()
    ) -> None:
        """Advance prompts by `work`; a sequence whose prompt is done gets its first token.

        The chunks of every sequence in this step run as one forward
        (`SlottedDecoder.prefill_many`), so agents that arrive together share the
        weight reads and the bigger GEMMs. `decoding` rows ride along in the same
        forward as one-token chunks at their next position: a step that starts a
        prompt beside running rows reads the weights once, not twice (on a CPU that
        read is most of a decode step, so a separate prefill forward, e.g. each of a
        release gate's cases beside an agent's rows, cost those rows a whole step).
        """
        chunks = [
            PrefillChunk(
                torch.tensor(seq.request.prompt_token_ids[start:end], device=self.device),
                seq.row,
                seq.slot,
                start,
            )
            for seq, start, end in work
        ]
        chunks += [
            PrefillChunk(
                torch.tensor([seq.last_token], device=self.device),
                seq.row,
                seq.slot,
                seq.prompt_len + seq.generated - 1,
            )
            for seq in decoding
        ]
        if len(chunks) > 1 and self.batch_prefill:
            logits = self.model.prefill_many(chunks, self.cache)
        else:
            logits = torch.stack(
                [
                    self.model.prefill(c.token_ids, self.cache, c.row, c.slot, c.start)
                    for c in chunks
                ]
            )
        ready, first = [], []
        for i, (seq, _, end) in enumerate(work):
            seq.prefilled = end
            self._store_prefix(seq, end)
            if not seq.in_prefill:
                ready.append(seq)
                first.append(i)
        ready += decoding
        first += range(len(work), len(work) + len(decoding))
        if ready:
            self._accept(ready, logits[first])

    def _reuse_prefix(self, seq: _Sequence) -> None:
        """Start `seq`'s prefix chain and copy its cached leading blocks into its row."""
        if self.prefix_cache is None:
            return
        prompt = seq.request.prompt_token_ids
        seq.chain, found = self.prefix_cache.start(prompt, self._slots.identity_in(seq.slot))
        seq.prefilled = self.prefix_cache.load(seq.chain, found, self.cache, seq.row)

    def _store_prefix(self, seq: _Sequence, upto: int) -> None:
        """Keep `seq`'s full blocks below position `upto` (its row holds their keys/values)."""
        if self.prefix_cache is not None and seq.chain is not None:
            tokens = (
                seq.request.prompt_token_ids + seq.output_ids
                if seq.output_ids
                else seq.request.prompt_token_ids
            )
            self.prefix_cache.store(seq.chain, tokens, upto, self.cache, seq.row)

    def _decode(self, seqs: list[_Sequence]) -> None:
        tokens = torch.tensor([s.last_token for s in seqs], device=self.device)
        positions = torch.tensor([s.prompt_len + s.generated - 1 for s in seqs], device=self.device)
        lora = LoRABatch.from_slots([s.slot for s in seqs], self.device)
        logits = self.model.decode(tokens, [s.row for s in seqs], positions, lora, self.cache)
        self._accept(seqs, logits)

    def _accept(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample one token per sequence, stream it, and retire finished sequences."""
        choices = sample_batch(logits, [s.sampler for s in seqs])
        for seq, choice in zip(seqs, choices, strict=True):
            reason: FinishReason | None = None
            text = ""
            if choice.token_id is None:
                reason = "stop"
            else:
                seq.generated += 1
                self._generated += 1
                seq.last_token = choice.token_id
                seq.output_ids.append(choice.token_id)
                event = TokenEvent(
                    choice.token_id,
                    choice.logprob,
                    self._slots.version_in(seq.slot),
                    choice.top_logprobs,
                )
                constraint = seq.sampler.constraint
                if constraint is not None:
                    constraint.advance(choice.token_id)
                if choice.token_id in seq.stop_ids:
                    reason = "stop"  # EOS is kept as a token (the policy chose it) but has no text
                else:
                    text, hit_stop = seq.detok.add(choice.token_id)
                    if hit_stop or (constraint is not None and constraint.is_done()):
                        reason = "stop"
                    elif seq.generated >= seq.request.sampling.max_tokens:
                        reason = "length"
                seq.stream.push(
                    RequestOutput(
                        seq.request.request_id, [event], text, prompt_tokens=seq.prompt_len
                    )
                )
            if reason is not None:
                self._finish(seq, reason)

    def _finish_by_id(self, request_id: str, reason: FinishReason) -> None:
        with self._lock:
            seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq, reason)

    def _finish(self, seq: _Sequence, reason: FinishReason) -> None:
        with self._lock:
            if self._by_id.pop(seq.request.request_id, None) is None:
                return
            if seq in self._waiting:
                self._waiting.remove(seq)
        if seq in self._running:
            # The row holds keys/values of every token but the last one sampled (never fed).
            computed = seq.prefilled if seq.in_prefill else seq.prompt_len + seq.generated - 1
            self._store_prefix(seq, max(computed, seq.prefilled))
            self._running.remove(seq)
            heapq.heappush(self._free_rows, seq.row)
        tail = seq.detok.flush() if reason != "abort" else ""
        seq.stream.push(
            RequestOutput(
                seq.request.request_id,
                [],
                tail,
                finished=True,
                finish_reason=reason,
                prompt_tokens=seq.prompt_len,
            )
        )

    def _emit_error(self, seq: _Sequence, error: Exception) -> None:
        with self._lock:
            self._by_id.pop(seq.request.request_id, None)
        seq.stream.push(engine_failure(error))

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            victims = list(self._running) + list(self._waiting)
            self._waiting.clear()
            self._retire()  # none waits for a removed adapter any more
        for seq in victims:
            if seq in self._running:
                self._running.remove(seq)
                heapq.heappush(self._free_rows, seq.row)
            self._emit_error(seq, error)
