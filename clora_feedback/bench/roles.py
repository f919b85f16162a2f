"""Role processes on one machine: `clora serve`, `clora ingest` and `clora train` as real
subprocesses sharing one settings file, for the scale-out benchmark and the multi-process test.

`RoleProcess` starts one command (`python -m clora_feedback.cli ...`) with its output
in a log file, and can be stopped (SIGTERM, then SIGKILL), killed (SIGKILL, as a crash)
and started again with the same command. `write_settings` writes a JSON settings file;
`free_port` finds a loopback port; `wait_healthy` waits for a gateway's `/health`.

Not here: what the roles do (`clora_feedback.cli`), measuring anything (`scaleout`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def write_settings(path: Path, settings: dict[str, Any]) -> Path:
    """Write `settings` as a JSON settings file (`clora ... --config path`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2, default=str), encoding="utf-8")
    return path


class RoleProcess:
    """One `clora` role as a subprocess.

    Args:
        name: for logs (`<log_dir>/<name>.log`, appended across restarts).
        args: the `clora` arguments, e.g. `["train", "--config", "s.json"]`.
        log_dir: where the log goes.
        env: extra environment variables.
        passive: idle OpenMP workers sleep (`OMP_WAIT_POLICY=PASSIVE`): several roles share
            the cores. False: the child waits as this process does (one role alone, as
            `clora serve` runs by default).
    """

    def __init__(
        self,
        name: str,
        args: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        *,
        passive: bool = True,
    ) -> None:
        self.name = name
        self.args = args
        self.log = log_dir / f"{name}.log"
        # The child imports the same code as this process, wherever it was started from.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        waits = {"OMP_WAIT_POLICY": "PASSIVE"} if passive else {}
        self.env = {**os.environ, **waits, "PYTHONPATH": path, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> RoleProcess:
        """Start the command (again, after a stop or kill)."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "clora_feedback.cli", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def tail(self, chars: int = 4000) -> str:
        """The end of the log (for a failure message)."""
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""


def wait_healthy(base_url: str, proc: RoleProcess, timeout_s: float = 120.0) -> None:
    """Wait until `GET base_url/health` answers 200.

    Raises:
        RuntimeError: the process exited, or `timeout_s` passed (with the log's tail).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not healthy after {timeout_s} s:\n{proc.tail()}")
