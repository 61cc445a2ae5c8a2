"""One Mooncake Transfer Engine per process (mooncake-transfer-engine-non-cuda here; the CUDA and
NPU wheels on GPU and Ascend hosts), with P2P handshake metadata: no etcd or metadata server.

The Python `protocol` argument does not pick the transport: the engine installs RDMA whenever it
finds HCAs, so TCP is forced with MC_FORCE_TCP=1 (set here when protocol is "tcp")."""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections.abc import Sequence

from pdmesh.errors import WorkerFailed
from pdmesh.kv.kv_layout import LayerRegion

logger = logging.getLogger(__name__)


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
        self.timeout_s = timeout_s
        self.protocol = protocol
        logger.info("Mooncake Transfer Engine %s (%s)", self.session, protocol)

    def register(self, regions: Sequence[LayerRegion]) -> None:
        if self._engine.batch_register_memory([r.base for r in regions], [r.nbytes for r in regions]) != 0:
            raise OSError("Mooncake could not register the KV cache")

    def unregister(self, regions: Sequence[LayerRegion]) -> None:
        self._engine.batch_unregister_memory([r.base for r in regions])

    def start_read(self, session: str, local_addresses: Sequence[int], remote_addresses: Sequence[int],
                   lengths: Sequence[int]) -> list[int]:
        """Starts copying remote_addresses[i] (in `session`'s registered memory) to local_addresses[i];
        returns what to wait on. One engine batch per piece: the engine's non-blocking status check
        looks at a batch's first task only, and its blocking one spins a core until the batch is done
        (on two cores, beside spinning vLLM engines, that starved the engine's own TCP threads)."""
        batch_ids = []
        for local, remote, nbytes in zip(local_addresses, remote_addresses, lengths):
            batch_id = self._engine.batch_transfer_async_read(session, [local], [remote], [nbytes])
            if batch_id == 0:
                raise WorkerFailed(f"Mooncake could not start a read from {session}")
            batch_ids.append(batch_id)
        return batch_ids

    def wait(self, session: str, batch_ids: Sequence[int], timeout_s: float) -> None:
        """Until every started read is done, polling with a growing sleep (0.05 to 1 ms); raises
        WorkerFailed on a failure or after timeout_s (what failed or timed out may still land)."""
        pending, delay, deadline = list(batch_ids), 50e-6, time.monotonic() + timeout_s
        while pending:
            statuses = [self._engine.transfer_check_status(batch_id) for batch_id in pending]
            if any(status < 0 for status in statuses):
                raise WorkerFailed(f"Mooncake read from {session} failed (status {min(statuses)})")
            pending = [batch_id for batch_id, status in zip(pending, statuses) if status == 0]
            if pending:
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"Mooncake read from {session} timed out after {timeout_s:.1f} s")
                time.sleep(delay)
                delay = min(2 * delay, 1e-3)

    def read(self, session: str, local_addresses: Sequence[int], remote_addresses: Sequence[int],
             lengths: Sequence[int]) -> None:
        """start_read, then wait (at most the engine's timeout)."""
        self.wait(session, self.start_read(session, local_addresses, remote_addresses, lengths), self.timeout_s)


_lock = threading.Lock()
_engines: dict[tuple[str, str, str], MooncakeEngine] = {}


def shared_engine(host: str, protocol: str = "tcp", device_name: str = "", timeout_s: float = 30.0) -> MooncakeEngine:
    """The process's engine for (host, protocol, device): a producer and a consumer in one process share it."""
    with _lock:
        key = (host, protocol, device_name)
        if key not in _engines:
            _engines[key] = MooncakeEngine(host, protocol, device_name, timeout_s)
        return _engines[key]
