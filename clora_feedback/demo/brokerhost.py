"""Host a local Kafka-protocol broker (Tansu) in its own session, for the demo.

Ctrl-C in a terminal signals every process of the foreground process group,
and Tansu shuts down on SIGINT; a broker started directly by the demo would
therefore vanish before the demo could stop its consumers and producers.
The demo instead starts this module with `start_new_session=True`: it runs
`LocalBroker`, prints the bootstrap address on one line, and stops the
broker when its standard input closes (the demo closes it, or the demo's
death closes it), so the broker always outlives the clean shutdown and
never outlives the demo.

Not here: anything about feedback or the service.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from clora_feedback.config import KafkaConfig


def main(argv: list[str]) -> int:
    """`python -m clora_feedback.demo.brokerhost DATA_DIR`: serve until stdin closes."""
    from clora_feedback.feedback.broker import LocalBroker

    kafka = KafkaConfig()
    topics = [*kafka.topics, kafka.dead_letter_topic]
    with LocalBroker(Path(argv[0]), topics=topics, partitions=3) as broker:
        print(broker.bootstrap, flush=True)
        sys.stdin.read()  # returns at EOF: the parent closed the pipe or exited
    return 0


class HostedBroker:
    """The parent's handle: `start()` returns the bootstrap address, `stop()` ends the broker."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self._proc: subprocess.Popen[str] | None = None
        self.bootstrap = ""

    def start(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "clora_feedback.demo.brokerhost", str(self.data_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # terminal signals (Ctrl-C) go to the demo only
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line:
            self.stop()
            raise RuntimeError(f"the local broker did not start; see {self.data_dir}/tansu.log")
        self.bootstrap = line
        return line

    def stop(self, timeout_s: float = 15.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
