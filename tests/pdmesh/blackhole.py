"""A peer that takes connections and never answers: a loopback socket listening with a backlog that
nothing accepts (the kernel completes the TCP handshake, no byte ever comes back), as a producer
does when its host hangs or a firewall drops its replies."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def blackholed_address() -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
