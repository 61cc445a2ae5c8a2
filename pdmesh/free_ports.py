"""Ports for processes that must bind the same port again after a restart."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
SEARCH_SPAN = 12_000   # how far below the ephemeral range ports are drawn from


def ports_outside_ephemeral_range(count: int) -> list[int]:
    """`count` distinct free loopback ports the kernel never hands out by itself (bind to port 0,
    outgoing connections). A port from bind(0) may be taken while its process is down: a client
    retrying the dead server gets it as its source port (or connects to itself on it), and the
    restart cannot bind ("Address already in use")."""
    low, _ = map(int, PORT_RANGE_FILE.read_text().split())
    found: list[int] = []
    candidates = range(max(1024, low - SEARCH_SPAN), low)
    for port in random.sample(candidates, min(len(candidates), 200 + count)):
        with socket.socket() as sock:
            with contextlib.suppress(OSError):
                sock.bind(("127.0.0.1", port))
                found.append(port)
        if len(found) == count:
            return found
    raise OSError(f"no {count} free ports below the ephemeral range")
