"""The inet sockets a set of processes listens on (TCP) or is bound to (UDP), read from /proc: what
a peer on the network could reach."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

TCP_LISTEN = "0A"


@dataclass(frozen=True)
class ListeningSocket:
    pid: int
    name: str        # the process's name
    protocol: str    # "tcp", "tcp6", "udp", "udp6"
    ip: str
    port: int

    @property
    def loopback_only(self) -> bool:
        address = ipaddress.ip_address(self.ip)
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback   # ::ffff:127.0.0.1 too


def process_tree(pid: int) -> list[int]:
    """pid and every process descended from it."""
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def listening_sockets(pids: list[int]) -> list[ListeningSocket]:
    found = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        name = _name(pid)
        for protocol in ("tcp", "tcp6", "udp", "udp6"):
            for ip, port, state, inode in _table(pid, protocol):
                if inode in inodes and (protocol.startswith("udp") or state == TCP_LISTEN):
                    found.append(ListeningSocket(pid, name, protocol, ip, port))
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def _table(pid: int, protocol: str) -> list[tuple[str, int, str, str]]:
    """(ip, port, state, inode) of each row of /proc/<pid>/net/<protocol>."""
    try:
        lines = Path(f"/proc/{pid}/net/{protocol}").read_text().splitlines()[1:]
    except OSError:
        return []
    rows = []
    for line in lines:
        fields = line.split()
        address, port = fields[1].split(":")
        rows.append((_ip(address), int(port, 16), fields[3], fields[9]))
    return rows


def _ip(hex_address: str) -> str:
    """/proc/net's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))
