"""Run as a script (`python -m tests.pdmesh.transport.mooncake_port_probe`): starts the pinned wheel's
Mooncake Transfer Engine on 127.0.0.1 with one registered buffer, then acts as an unauthenticated
peer on its ports (the P2P handshake, then the TCP transport's session header: size, addr, opcode,
little-endian) and prints what it could do as JSON. A process of its own: the engine cannot be
stopped, and its threads would outlive the test."""

from __future__ import annotations

import json
import os
import socket
import struct

import numpy as np

READ, WRITE, V2 = 0, 1, 0x80
STATUS_OK = 0x4D435456 << 32
METADATA = 1


def _recv(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def segment(port: int) -> dict:
    """The engine's segment descriptor, as its handshake daemon serves it to anyone."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        body = bytes([METADATA]) + b"{}"
        sock.sendall(struct.pack("<Q", len(body)) + body)
        (nbytes,) = struct.unpack("<Q", _recv(sock, 8))
        return json.loads(_recv(sock, nbytes)[1:])


def session(port: int, opcode: int, address: int, payload: bytes = b"", nbytes: int = 0) -> bytes | None:
    """One request on the TCP transport's data port: what a READ returned, b"" for a WRITE taken,
    None when the engine refused the address."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        size = len(payload) or nbytes
        sock.sendall(struct.pack("<QQB7x", size, address, opcode | V2) + payload)
        (status,) = struct.unpack("<Q", _recv(sock, 8))
        if status != STATUS_OK:
            return None
        return _recv(sock, size) if opcode == READ else b""


def main() -> None:
    os.environ["MC_FORCE_TCP"] = "1"
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    registered = np.full(1 << 16, 7, np.uint8)   # stands for a KV cache
    unregistered = np.full(4096, 42, np.uint8)   # any other memory of the process
    assert engine.register_memory(registered.ctypes.data, registered.nbytes) == 0
    handshake_port = engine.get_rpc_port()
    described = segment(handshake_port)
    data_port = described["tcp_data_port"]
    read = session(data_port, READ, registered.ctypes.data, nbytes=64)
    unregistered_read = session(data_port, READ, unregistered.ctypes.data, nbytes=64)
    wrote = session(data_port, WRITE, registered.ctypes.data, payload=b"\x99" * 16)
    print(json.dumps({
        "pid": os.getpid(), "handshake_port": handshake_port, "data_port": data_port,
        "buffers_described": [buffer["addr"] for buffer in described.get("buffers", [])],
        "registered_address": registered.ctypes.data,
        "read_registered": read.hex() if read is not None else None,
        "read_unregistered": unregistered_read.hex() if unregistered_read is not None else None,
        "write_taken": wrote is not None, "after_write": registered[:20].tolist(),
        "listening": listening_addresses(os.getpid()),
    }), flush=True)


def listening_addresses(pid: int) -> list[list]:
    from tests.pdmesh.listening import listening_sockets

    return [[s.ip, s.port] for s in listening_sockets([pid])]


if __name__ == "__main__":
    main()
