"""A benchmark's second process (the KV producer or store holder on core 0): started with
`python -m <module> --serve spec.json`, it writes what the measuring process needs into a ready file
and serves until that file is gone (or its parent is)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

STARTUP_TIMEOUT_S = 300.0


@contextlib.contextmanager
def peer_process(module: str, spec: dict, work: Path) -> Iterator[dict]:
    """Runs the peer with `spec` (plus the ready file's path) and yields what it wrote there; this
    process then pins itself to core 1. The peer stops when the block exits."""
    ready, spec_path = work / "ready.json", work / "spec.json"
    spec_path.write_text(json.dumps({**spec, "ready": str(ready)}))
    process = subprocess.Popen([sys.executable, "-m", module, "--serve", str(spec_path)])
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {module} peer process did not start")
            time.sleep(0.2)
        time.sleep(0.2)  # the file is complete
        served = json.loads(ready.read_text())
        os.sched_setaffinity(0, {1 % (os.cpu_count() or 1)})
        yield served
    finally:
        ready.unlink(missing_ok=True)
        process.wait(timeout=60)


def serve_until_released(spec: dict, served: dict) -> None:
    """The peer's side: says it is ready, then waits until the measuring process is done."""
    ready = Path(spec["ready"])
    ready.write_text(json.dumps(served))
    while os.getppid() != 1 and ready.exists():
        time.sleep(0.2)
