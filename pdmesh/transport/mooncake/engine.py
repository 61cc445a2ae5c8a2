"""One Mooncake Transfer Engine per process (mooncake-transfer-engine-non-cuda here; the CUDA and
NPU wheels on GPU and Ascend hosts), with P2P handshake metadata: no etcd or metadata server.

The Python `protocol` argument does not pick the transport: the engine installs RDMA whenever it
finds HCAs, so TCP is forced with MC_FORCE_TCP=1 (set here when protocol is "tcp")."""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Sequence

from pdmesh.errors import WorkerFailed
from pdmesh.transport.kv_layout import LayerRegion

logger = logging.getLogger(__name__)
MAX_BATCH = 512  # descriptors per batch call


def mooncake_available() -> bool:
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except (ImportError, ValueError):
        return False


class MooncakeEngine:
    def __init__(self, host: str, protocol: str = "tcp", device_name: str = "", timeout_s: float = 30.0) -> None:
        if protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"
        # A transfer to a peer that died fails after this long (the engine's floor is 5 s).
        os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, int(timeout_s)))
        from mooncake.engine import TransferEngine  # imported here: the wheel needs libibverbs etc.

        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise OSError(f"Mooncake Transfer Engine did not start on {host} ({protocol})")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self.protocol = protocol
        logger.info("Mooncake Transfer Engine %s (%s)", self.session, protocol)

    def register(self, regions: Sequence[LayerRegion]) -> None:
        if self._engine.batch_register_memory([r.base for r in regions], [r.nbytes for r in regions]) != 0:
            raise OSError("Mooncake could not register the KV cache")

    def unregister(self, regions: Sequence[LayerRegion]) -> None:
        self._engine.batch_unregister_memory([r.base for r in regions])

    def read(self, session: str, local_addresses: Sequence[int], remote_addresses: Sequence[int],
             lengths: Sequence[int]) -> None:
        """Copies remote_addresses[i] (in `session`'s registered memory) to local_addresses[i]; blocks."""
        for start in range(0, len(lengths), MAX_BATCH):
            end = start + MAX_BATCH
            status = self._engine.batch_transfer_sync_read(session, list(local_addresses[start:end]),
                                                           list(remote_addresses[start:end]), list(lengths[start:end]))
            if status != 0:
                raise WorkerFailed(f"Mooncake read from {session} failed (status {status})")


_lock = threading.Lock()
_engines: dict[tuple[str, str, str], MooncakeEngine] = {}


def shared_engine(host: str, protocol: str = "tcp", device_name: str = "", timeout_s: float = 30.0) -> MooncakeEngine:
    """The process's engine for (host, protocol, device): a producer and a consumer in one process share it."""
    with _lock:
        key = (host, protocol, device_name)
        if key not in _engines:
            _engines[key] = MooncakeEngine(host, protocol, device_name, timeout_s)
        return _engines[key]
