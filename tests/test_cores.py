"""How compute threads share the cores: waits, team sizes, the other-load probe (`cores`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from clora_feedback.cores import (
    BUSY_CORES,
    SPIN_COUNT,
    CoreShare,
    OtherLoad,
    configure_waits,
    main_thread_alone,
    set_thread_teams,
)


def test_waits_spin_briefly_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert "spin" in configure_waits(env) and env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    for chosen in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(chosen)
        assert "as set" in configure_waits(env) and env == chosen


class _Proc:
    """/proc/stat and /proc/self/stat as files a test writes."""

    def __init__(self, tmp_path: Path):
        self.stat, self.own = tmp_path / "stat", tmp_path / "self_stat"
        self.now = 0.0

    def write(self, busy: int, own: int) -> None:
        # cpu user nice system idle iowait irq softirq steal guest guest_nice
        self.stat.write_text(f"cpu  {busy} 0 0 5000 7 0 0 0 0 0\ncpu0 1 2 3 4\n")
        fields = ["S"] + ["0"] * 10 + [str(own), "0"] + ["0"] * 30
        self.own.write_text("123 (python -m x) " + " ".join(fields) + "\n")

    def load(self) -> OtherLoad:
        load = OtherLoad(1.0, stat=self.stat, own=self.own, clock=lambda: self.now)
        load._ticks = 100
        return load


_WATCH_TORCH = """
import os, runpy, sys
seen = {}
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "torch" not in seen:
            seen["torch"] = os.environ.get("GOMP_SPINCOUNT")
sys.meta_path.insert(0, Watch())
runpy.run_path(sys.argv[1], run_name="example")
import torch  # what the example's main() loads next, if its imports did not
print(seen["torch"])
"""


@pytest.mark.parametrize("example", ["support_triage.py", "tool_use.py"])
def test_the_examples_set_the_waits_before_torch_loads(example: str) -> None:
    """`python examples/X.py` is not a `clora` command: it sets the spin itself, first."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    path = Path(__file__).resolve().parent.parent / "examples" / example
    out = subprocess.run(
        [sys.executable, "-c", _WATCH_TORCH, str(path)],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.strip() == str(SPIN_COUNT)


def test_other_load_is_the_busy_time_this_process_did_not_use(tmp_path: Path) -> None:
    proc = _Proc(tmp_path)
    proc.write(busy=1000, own=400)
    load = proc.load()
    assert load.cores() == 0.0  # one sample: nothing to compare yet
    proc.now, _ = 2.0, proc.write(busy=1000 + 300, own=400 + 100)  # 3 s busy, 1 s ours, in 2 s
    assert load.cores() == pytest.approx(1.0)
    proc.now, _ = 2.5, proc.write(busy=5000, own=500)  # within the interval: not re-read
    assert load.cores() == pytest.approx(1.0)
    proc.now, _ = 4.5, proc.write(busy=1300 + 200, own=500 + 200)  # only this process since
    assert load.cores() == 0.0


def test_other_load_reads_nothing_where_proc_is_not(tmp_path: Path) -> None:
    load = OtherLoad(stat=tmp_path / "absent", own=tmp_path / "absent")
    assert load.cores() == 0.0 and load.cores() == 0.0


class _Load(OtherLoad):
    def __init__(self, cores: float):
        super().__init__()
        self.value = cores

    def cores(self) -> float:
        return self.value


def test_the_engine_takes_every_core_until_a_step_or_another_process_wants_them() -> None:
    load = _Load(0.0)
    share = CoreShare(4, load=load)
    assert share.trainer_threads() == 4  # no engine in the process: the trainer takes all
    share.serving = True
    assert share.trainer_threads() == 2 and share.engine_threads(4) == 4
    with share.training():
        assert share.engine_threads(4) == 2 and share.engine_threads(1) == 1
        with share.training():
            assert share.engine_threads(4) == 2
        assert share.engine_threads(4) == 2
    assert share.engine_threads(4) == 4  # the step ended
    load.value = BUSY_CORES
    assert share.engine_threads(4) == 3  # another process keeps a core busy: it is theirs
    load.value = 1.4
    assert share.engine_threads(4) == 3 and share.engine_threads(2) == 2
    load.value = 2.5
    assert share.engine_threads(4) == 1
    load.value = BUSY_CORES - 0.1
    assert share.engine_threads(4) == 4
    two = CoreShare(2, load=_Load(0.0))
    two.serving = True
    with two.training():  # on 2 cores: one thread each, neither holds a pool
        assert two.trainer_threads() == 1 and two.engine_threads(2) == 1
    two.load = _Load(0.6)
    assert two.engine_threads(2) == 1


def test_a_thread_team_size_is_the_calling_threads_own() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []

    def other(n: int) -> None:
        set_thread_teams(n)  # before this thread's first torch op: torch's default must not undo it
        torch.ones(4).sum()
        seen.append(torch.get_num_threads())

    torch.set_num_threads(1)  # as `main_thread_alone`: the default of new threads
    try:
        for n in (1, 3):
            thread = threading.Thread(target=other, args=(n,))
            thread.start()
            thread.join()
        assert seen == [1, 3] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_an_entry_point_computes_alone_on_the_main_thread_and_restores_the_count() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    with main_thread_alone():
        seen.append(torch.get_num_threads())
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
    assert seen == [1, 1] and torch.get_num_threads() == before
