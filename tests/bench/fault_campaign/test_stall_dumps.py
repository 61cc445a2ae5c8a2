"""dump_stalls against a real process: py-spy's stacks of it land when a stall begins and again while it
lasts, none while requests end."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from bench.fault_campaign import stall_dumps
from bench.fault_campaign.stall_dumps import dump_stalls

pytestmark = pytest.mark.skipif(stall_dumps.find_py_spy() is None, reason="py-spy not installed")


@dataclass
class Ended:
    ended_s: float


@dataclass
class FakeLoad:
    in_flight: int = 0
    results: list[Ended] = field(default_factory=list)


@pytest.fixture
def sleeper():
    process = subprocess.Popen([sys.executable, "-c", "import time\ndef waiting_here():\n    time.sleep(60)\n"
                                                      "waiting_here()"])
    time.sleep(0.5)
    yield process
    process.kill()
    process.wait()


async def _until(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return condition()


def _dumped(folder) -> bool:
    # the frame, not the command line py-spy's header repeats (a dump still being written has only that)
    return (folder / "worker.txt").is_file() and "waiting_here (<string>" in (folder / "worker.txt").read_text()


async def test_a_stall_dumps_every_process_and_a_busy_mesh_none(tmp_path, sleeper, monkeypatch):
    monkeypatch.setattr(stall_dumps, "POLL_S", 0.05)
    load = FakeLoad(in_flight=3)
    task = asyncio.create_task(dump_stalls(load, lambda: {"worker": sleeper.pid}, tmp_path, stall_s=0.5))
    for _ in range(10):  # requests ending every 0.1 s: no stall
        await asyncio.sleep(0.1)
        load.results.append(Ended(time.monotonic()))
    assert list(tmp_path.iterdir()) == []
    assert await _until(lambda: any(_dumped(folder) for folder in tmp_path.iterdir()))   # none ends: a stall
    task.cancel()
    folder = sorted(tmp_path.iterdir())[0]
    assert folder.name.startswith("stall-")
    assert sorted(p.name for p in folder.iterdir()) == ["ps.txt", "threads.txt", "worker.txt"]
    assert str(sleeper.pid) in (folder / "ps.txt").read_text()
    assert str(sleeper.pid) in (folder / "threads.txt").read_text()


async def test_a_long_stall_is_dumped_again_every_stall_s(tmp_path, sleeper, monkeypatch):
    monkeypatch.setattr(stall_dumps, "POLL_S", 0.05)
    load = FakeLoad(in_flight=3, results=[Ended(time.monotonic())])
    task = asyncio.create_task(dump_stalls(load, lambda: {"worker": sleeper.pid}, tmp_path, stall_s=0.5))
    assert await _until(lambda: sum(_dumped(folder) for folder in tmp_path.iterdir()) >= 2)
    task.cancel()
    first, second = sorted(tmp_path.iterdir(), key=lambda folder: int(folder.name.rsplit("-", 1)[1]))[:2]
    # from the second dump of a stall on, native frames: where the sleeper's thread sleeps in C
    assert "time_sleep" not in (first / "worker.txt").read_text()
    assert "time_sleep" in (second / "worker.txt").read_text()
