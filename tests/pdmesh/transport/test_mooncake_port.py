"""What the pinned Mooncake wheel's port lets any peer do (issue 30, item 1), shown against the real
engine from another connection with crafted requests: why pdmesh keeps Mooncake off unless the
operator names an isolated data network (--mooncake_host), and what docs/limits.md says.

- The handshake daemon tells anyone the registered buffers' addresses.
- Any peer reads and WRITES registered memory (a KV cache: other users' KV, or poisoned KV that the
  producer would then checksum as its own): no credential is asked.
- The wheel does check addresses: memory that is not registered is refused (upstream's
  validateAddress), so the hole is the registered memory, not the whole process.
- Both ports listen on every interface though the engine was given 127.0.0.1.
And pdmesh's side: Mooncake starts nowhere unless configured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdmesh.config import KVTransportSettings, WorkerSettings
from pdmesh.transport.mooncake.engine import mooncake_available

pytestmark = pytest.mark.skipif(not mooncake_available(), reason="Mooncake's wheel is not installed")


@pytest.fixture(scope="module")
def probed() -> dict:
    result = subprocess.run([sys.executable, "-m", "tests.pdmesh.transport.mooncake_port_probe"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_any_peer_learns_the_registered_addresses_and_reads_and_writes_them(probed):
    assert probed["buffers_described"] == [probed["registered_address"]]
    assert probed["read_registered"] == "07" * 64
    assert probed["write_taken"] and probed["after_write"] == [0x99] * 16 + [7] * 4


def test_the_pinned_wheel_refuses_addresses_outside_registered_memory(probed):
    assert probed["read_unregistered"] is None


def test_both_ports_listen_on_every_interface_though_given_loopback(probed):
    listening = {port: ip for ip, port in probed["listening"]}
    assert listening[probed["handshake_port"]] in ("0.0.0.0", "::")
    assert listening[probed["data_port"]] in ("0.0.0.0", "::")


def test_mooncake_is_off_unless_its_data_network_is_named():
    assert not KVTransportSettings().allows("mooncake")
    assert not WorkerSettings().kv_transport_settings.allows("mooncake")
    assert KVTransportSettings(mooncake_host="10.1.0.5").allows("mooncake")
    with pytest.raises(ValueError, match="kv_transport=mooncake needs --mooncake_host"):
        WorkerSettings(kv_transport="mooncake")
