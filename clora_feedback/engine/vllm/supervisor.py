"""`VLLMSupervisor`: one local vLLM OpenAI server started, watched and stopped by us.

For the single-machine case (`clora serve --engine vllm` without a URL): the
server runs the venv's `vllm serve` (`scripts/install_vllm.sh`) on the
configured model directory, on a loopback port, with what the engine needs:
`--enable-lora`, `--max-loras`, `--max-lora-rank` (the engine's rank rounded up
to one vLLM accepts), `--logprobs-mode raw_logprobs`, runtime adapter
loading (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), on CPU builds an explicit KV
cache size and OpenMP binding (vLLM's defaults size the cache from 90 % of
memory and spin on every core), and no chunked prefill unless
`local.chunked_prefill` (vLLM-CPU's engine dies on a seeded request whose
prompt is split across steps: see `command`). Its log goes to a file; when it
dies while starting the error carries the log's tail. An unexpected exit is
restarted on the same port, a bounded number of times (the engine's health poll
takes the replica out meanwhile and admits it back). `stop` sends SIGTERM to its
process group (vLLM's engine core and workers are children) and SIGKILL after a
grace.

Not here: talking to the server (see `engine`, `client`), installing vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path

import httpx

from clora_feedback.config import EngineConfig
from clora_feedback.errors import ConfigError, EngineUnavailableError

log = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts."""

STOP_GRACE_S = 20.0

NO_CHUNKED_PREFILL = "--no-enable-chunked-prefill"
"""Keeps vLLM-CPU alive under concurrent seeded requests (`VLLMLocalConfig.chunked_prefill`)."""


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lora_rank_bucket(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds `rank`."""
    for bucket in LORA_RANKS:
        if bucket >= rank:
            return bucket
    raise ConfigError(
        f"engine.max_lora_rank {rank} is above vLLM's largest ({LORA_RANKS[-1]})",
        param="engine.max_lora_rank",
    )


class VLLMSupervisor:
    """A local `vllm serve` on `model_dir`, for `VLLMEngine` to use as its one replica.

    Args:
        model_dir: the base model directory the server loads (the engine's own).
        config: the engine settings (`config.vllm.local` for the server's own).
        served_model_name: `--served-model-name`, if any.
    """

    def __init__(
        self, model_dir: Path, config: EngineConfig, *, served_model_name: str | None = None
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        local = config.vllm.local
        self.executable = local.venv_dir().resolve() / "bin" / "vllm"
        self.port = local.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = (local.log_dir or Path("var/vllm")) / f"vllm-{self.port}.log"
        self.served_model_name = served_model_name
        self.restarts = 0
        self._process: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    def command(self) -> list[str]:
        """The `vllm serve` command line."""
        cfg, local = self.config, self.config.vllm.local
        command = [
            str(self.executable), "serve", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-lora",
            "--max-loras", str(cfg.vllm.max_loras or cfg.max_loras),
            "--max-lora-rank", str(lora_rank_bucket(cfg.max_lora_rank)),
            "--max-model-len", str(cfg.max_model_len),
            "--max-num-seqs", str(cfg.max_num_seqs),
            "--dtype", local.dtype,
            "--logprobs-mode", "raw_logprobs",
            "--uvicorn-log-level", "warning",
        ]  # fmt: skip
        if not local.chunked_prefill:
            # vLLM-CPU 0.32 rewinds a seeded request's generator after a step that ran
            # only part of its prompt (`gen.set_offset` in `_bookkeeping_sync`); a CPU
            # generator has no offset, so the engine dies ("CPU Generator does not use
            # offset") once waiting prompts overflow `--max-num-batched-tokens` (2048).
            # Without chunked prefill a prompt is scheduled whole or waits.
            command.append(NO_CHUNKED_PREFILL)
        if cfg.vllm.max_cpu_loras is not None:
            command += ["--max-cpu-loras", str(cfg.vllm.max_cpu_loras)]
        if self.served_model_name:
            command += ["--served-model-name", self.served_model_name]
        return [*command, *local.extra_args]

    def environment(self) -> dict[str, str]:
        """The server's environment: ours, plus what vLLM needs to serve our adapters."""
        local = self.config.vllm.local
        cores = os.cpu_count() or 1
        bind = local.omp_threads_bind or (f"1-{cores - 1}" if cores > 2 else
                                          "1" if cores == 2 else "nobind")  # fmt: skip
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": str(local.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            "VLLM_NO_USAGE_STATS": "1",
            "PATH": f"{self.executable.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        env.pop("VIRTUAL_ENV", None)  # ours, not vLLM's
        return env

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def start(self) -> None:
        """Start the server and wait for `/health` (`engine.vllm.startup_timeout_s`).

        Raises:
            ConfigError: no vLLM environment.
            EngineUnavailableError: it exited while starting, or never got healthy
                (the message ends with its log's tail).
        """
        if not self.executable.exists():
            raise ConfigError(
                f"no vLLM at {self.executable}: run `bash scripts/install_vllm.sh` (or set "
                "engine.vllm.local.venv / CLORA_VLLM_VENV), or give engine.vllm.urls",
                param="engine.vllm.local.venv",
            )
        self._stopping = False
        await self._spawn()
        self._watch = asyncio.get_running_loop().create_task(self._supervise())

    async def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as sink:
            self._process = await asyncio.create_subprocess_exec(
                *self.command(), env=self.environment(), stdout=sink,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        log.info("vLLM server starting at %s (pid %d, log %s)", self.url, self._process.pid,
                 self.log_path)  # fmt: skip
        try:
            await self._wait_healthy(self._process, self.config.vllm.startup_timeout_s)
        except BaseException:
            await self._terminate()
            raise

    async def _wait_healthy(self, process: asyncio.subprocess.Process, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if process.returncode is not None:
                    raise EngineUnavailableError(
                        f"the local vLLM server exited with {process.returncode} while "
                        f"starting; its log ({self.log_path}) ends:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        log.info("vLLM server at %s is healthy", self.url)
                        return
                await asyncio.sleep(0.5)
        raise EngineUnavailableError(
            f"the local vLLM server did not answer /health within {timeout_s:.0f} s; its log "
            f"({self.log_path}) ends:\n{self.log_tail()}"
        )

    async def _supervise(self) -> None:
        """Restart the server when it exits unexpectedly, up to `max_restarts` times."""
        limit = self.config.vllm.local.max_restarts
        while self._process is not None:
            process = self._process
            code = await process.wait()
            if self._stopping:
                return
            with contextlib.suppress(ProcessLookupError):  # its engine core and workers
                os.killpg(process.pid, signal.SIGKILL)
            if self.restarts >= limit:
                log.error("vLLM server at %s exited with %d; not restarted again (%d restarts):"
                          "\n%s", self.url, code, self.restarts, self.log_tail())  # fmt: skip
                return
            self.restarts += 1
            log.warning("vLLM server at %s exited with %d; restarting (%d of %d)",
                        self.url, code, self.restarts, limit)  # fmt: skip
            try:
                await self._spawn()
            except EngineUnavailableError as exc:
                log.error("%s", exc.message)

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        process = self._process
        return None if process is None or process.returncode is not None else process.pid

    async def stop(self) -> None:
        """SIGTERM the server's process group; SIGKILL after a grace period."""
        self._stopping = True
        await self._terminate()
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None

    async def _terminate(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
