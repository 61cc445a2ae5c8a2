"""Stacks of every mesh process while the mesh stalls: once requests have been in flight for
`stall_s` with none ending, `py-spy dump --nonblocking` of each worker's and the gateway's process
(its engine and other children included; not paused, so the dump does not lengthen the stall it
measures), a `ps` of every process and every thread (which core each ran on last, its state, the
kernel function it sleeps in) go to a folder named by the wall-clock time, and again every `stall_s`
while the stall lasts. From a stall's second dump on, the stacks also carry native frames (py-spy
pauses each process for that: a thread blocked on a lock, the GIL or a syscall shows which). What a
stall's cause is then reads from the stacks, not from guesses."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

POLL_S = 0.5
MAX_STALLS_DUMPED = 20   # dumps in all


async def dump_stalls(load, pids, out_dir: Path, stall_s: float = 5.0) -> None:
    """Runs until cancelled. `load` has `in_flight` and `results` (each with `ended_s`); `pids()` maps
    a process name to its pid."""
    py_spy = find_py_spy()
    if py_spy is None:
        logger.warning("py-spy not found: stalls are measured but not dumped")
        return
    last_end, num_dumped = time.monotonic(), 0
    last_dump = last_end   # a stall that goes on is dumped again every stall_s: what changed, what did not
    while num_dumped < MAX_STALLS_DUMPED:
        await asyncio.sleep(POLL_S)
        if load.results and load.results[-1].ended_s > last_end:
            last_end = last_dump = load.results[-1].ended_s
        if not load.in_flight:
            last_end = last_dump = time.monotonic()
        elif time.monotonic() - max(last_end, last_dump) > stall_s:
            num_dumped += 1
            folder = out_dir / f"{time.strftime('stall-%H%M%S')}-{num_dumped}"
            await _dump_all(py_spy, pids(), folder, native=last_dump > last_end)   # the same stall again
            last_dump = time.monotonic()
            logger.warning("stall: %d requests in flight, none ended for %.1f s; stacks in %s",
                           load.in_flight, last_dump - last_end, folder)


def find_py_spy() -> str | None:
    """py-spy on the PATH or beside this interpreter (a virtual environment's bin/)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


async def _dump_all(py_spy: str, pids: dict[str, int], folder: Path, native: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mode = ["--native"] if native else ["--nonblocking"]
    await asyncio.gather(_run(["ps", "-eo", "pid,ppid,psr,pcpu,stat,wchan:24,etime,args"], folder / "ps.txt"),
                         _run(["ps", "-eLo", "pid,tid,psr,stat,wchan:32,comm"], folder / "threads.txt"),
                         *(_run([py_spy, "dump", *mode, "--subprocesses", "--pid", str(pid)],
                                folder / f"{name}.txt") for name, pid in pids.items()))


async def _run(command: list[str], path: Path) -> None:
    with path.open("w") as out:
        process = await asyncio.create_subprocess_exec(*command, stdout=out, stderr=asyncio.subprocess.STDOUT)
        try:
            await asyncio.wait_for(process.wait(), timeout=30)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
