"""vLLM's host-side adapter cache comes from config (issue 27): `engine.vllm.max_cpu_loras`
is passed to a local server as `--max-cpu-loras`, and each replica then keeps that many
adapter names loaded (more than its GPU slots), whatever `--max-loras` it reports."""

from __future__ import annotations

from pathlib import Path

from test_vllm_replicas import FakeClient, _served

from clora_feedback.config import EngineConfig
from clora_feedback.engine.vllm.replicas import Replica, ReplicaSet


def _command(tmp_path: Path, **vllm: object) -> list[str]:
    from clora_feedback.engine.vllm.supervisor import VLLMSupervisor

    config = EngineConfig(
        kind="vllm",
        max_loras=4,
        vllm={"local": {"enabled": True, "venv": tmp_path / "venv"}, **vllm},  # type: ignore[arg-type]
    )
    return VLLMSupervisor(tmp_path / "model", config).command()


def test_the_local_server_gets_max_cpu_loras_from_config(tmp_path: Path) -> None:
    command = _command(tmp_path, max_cpu_loras=64)
    assert command[command.index("--max-loras") + 1] == "4"
    assert command[command.index("--max-cpu-loras") + 1] == "64"
    assert "--max-cpu-loras" not in _command(tmp_path)  # unset: vLLM's default


async def test_a_replica_keeps_max_cpu_loras_names_whatever_the_server_reports() -> None:
    client = FakeClient(max_lora=2)  # the server reports --max-loras 2 (its GPU slots)
    replica = Replica("http://only", client, 5, fixed_max_loras=True, up=True)

    async def admit(replica: Replica) -> None:
        return None

    replicas = ReplicaSet(
        [replica],
        on_down=lambda r: None,
        admit=admit,
        wanted=lambda name: None,
        ours=lambda name: "+t." in name,
        queue_timeout_s=1.0,
    )
    await replicas._reconcile(replica)  # a (re)admitted replica reads its metrics
    assert replica.max_loras == 5
    names = [_served(f"a{i}") for i in range(6)]
    for served in names:
        replicas.release(await replicas.place(served, served.agent), served)
    # Five names stay loaded (the host cache), two beyond the GPU slots; the sixth
    # evicted the least recently used idle one.
    assert list(replica.loaded) == [s.name for s in names[1:]]
    assert ("unload", names[0].name) in client.calls
