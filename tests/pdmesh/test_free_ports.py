"""Ports a restarted worker binds again (pdmesh/free_ports.py): distinct, free, below the ephemeral range."""

from __future__ import annotations

import socket

import pytest

from pdmesh import free_ports
from pdmesh.free_ports import ports_outside_ephemeral_range


def test_the_ports_are_distinct_free_and_below_the_kernels_ephemeral_range():
    low, _ = map(int, free_ports.PORT_RANGE_FILE.read_text().split())
    ports = ports_outside_ephemeral_range(8)
    assert len(set(ports)) == 8
    assert all(max(1024, low - free_ports.SEARCH_SPAN) <= port < low for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_drawn(tmp_path, monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        range_file = tmp_path / "ip_local_port_range"
        range_file.write_text(f"{taken + 2}\t60999\n")
        monkeypatch.setattr(free_ports, "SEARCH_SPAN", 2)   # draws from {taken, taken + 1}
        monkeypatch.setattr(free_ports, "PORT_RANGE_FILE", range_file)
        with socket.socket() as neighbour:
            try:
                neighbour.bind(("127.0.0.1", taken + 1))
            except OSError:
                pytest.skip("the neighbouring port is in use")
        assert ports_outside_ephemeral_range(1) == [taken + 1]
        with pytest.raises(OSError, match="no 2 free ports below the ephemeral range"):
            ports_outside_ephemeral_range(2)
