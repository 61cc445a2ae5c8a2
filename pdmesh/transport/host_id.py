"""Which host (and shared-memory mount) this process is on: peers with the same id can read each
other's /dev/shm."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path


@functools.cache
def host_id() -> str:
    boot_id = Path("/proc/sys/kernel/random/boot_id")
    boot = boot_id.read_text().strip() if boot_id.exists() else ""
    shm_device = os.stat("/dev/shm").st_dev if os.path.isdir("/dev/shm") else 0
    return f"{socket.gethostname()}/{boot}/{shm_device}"
