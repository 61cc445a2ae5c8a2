"""Keeps KV threads off the engine's core.

vLLM's CPU worker binds its process to the cores its OpenMP threads use, and threads inherit the
mask of the thread that starts them. An engine that spin-steps (while it waits for KV or holds
blocks for a consumer) then starves the KV server and pull threads sharing its core: first
connections time out before the HTTP/2 handshake. vLLM's own NIXL connector moves its KV threads
to a reserved core for the same reason. Threads started inside `all_cores()`, and pool threads
set up with `widen_affinity` as initializer, may run on any core of the machine.
"""

from __future__ import annotations

import contextlib
import os


def widen_affinity(cpus: set[int] | None = None) -> None:
    """Lets the calling thread run on `cpus` (None or empty: every core)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus or range(os.cpu_count() or 1))


@contextlib.contextmanager
def all_cores():
    """Threads started in this block (gRPC's own among them) inherit every core."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    original = os.sched_getaffinity(0)
    widen_affinity()
    try:
        yield
    finally:
        os.sched_setaffinity(0, original)


def parse_cpus(text: str) -> set[int]:
    """A cpu list as taskset and cgroups write it: "1", "2-3", "0,2-3"."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pin_process(cpus: str) -> None:
    """Runs this process, and the processes it starts, on `cpus` ("": leaves it as it is)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, parse_cpus(cpus))
