"""The layer-wise producer's progress reports on an accelerator: applied once the device has done
what they report.

vLLM calls save_kv_layer when a layer's attention has been launched. On the CPU the launch is the
computation, so the engine thread reports the layer to LayerProgress at once. On CUDA and Ascend
NPUs the kernels run later, on the compute stream: a layer reported at launch could be read before
it is written. So here each layer (and the step's end) records an event on the current stream, and
one thread waits for the events in order and reports each layer once its event has completed
(vllm-ascend's MooncakeLayerwiseConnector records such an event before it sends a layer). The
compute stream never waits and nothing synchronizes the device: the engine thread only records
events. Every report goes through the same queue, so a step's start is never applied before the
previous step's end.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from prefill.kv.layer_progress import LayerProgress

logger = logging.getLogger(__name__)


class DeviceEvent(Protocol):
    def record(self) -> None: ...        # on the current stream of its device
    def synchronize(self) -> None: ...   # waits (this thread only) until the device has reached it


def device_events(device: str) -> Callable[[], DeviceEvent] | None:
    """A new event on `device` per call (the device module's: torch.cuda, torch_npu's torch.npu; else
    torch.Event), or None on the CPU, where a layer is written when its call returns."""
    where = torch.device(device)
    if where.type == "cpu":
        return None
    # The device module's own event (torch.cuda.Event, torch.npu.Event) can block: its synchronize
    # sleeps instead of spinning a core (torch.Event ignores `blocking`).
    device_event = getattr(getattr(torch, where.type, None), "Event", None)
    if device_event is not None:
        return lambda: device_event(blocking=True)
    return lambda: torch.Event(device=where)


class DeviceOrderedProgress:
    """LayerProgress's engine-thread reports, each applied after the device reached the point where
    it was made."""

    def __init__(self, progress: LayerProgress, new_event: Callable[[], DeviceEvent]) -> None:
        self._progress = progress
        self._new_event = new_event
        self._in_step: set[str] = set()  # transfer ids the running step computes (engine thread's view)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._apply_in_order, name="pdmesh-kv-layers", daemon=True)
        self._thread.start()

    # ---- the engine thread: never waits ----
    def start_step(self, transfer_id: str, request_id: str, block_ids: list[int], num_tokens_before: int,
                   num_tokens_after: int) -> None:
        self._in_step.add(transfer_id)
        self._queue.put((None, self._progress.start_step,
                         (transfer_id, request_id, list(block_ids), num_tokens_before, num_tokens_after)))

    def restart(self, transfer_id: str) -> None:
        self._in_step.discard(transfer_id)
        self._queue.put((None, self._progress.restart, (transfer_id,)))

    def end(self, transfer_id: str) -> None:
        self._in_step.discard(transfer_id)
        self._queue.put((None, self._progress.end, (transfer_id,)))

    def held(self, transfer_id: str) -> None:
        self._in_step.discard(transfer_id)
        self._queue.put((None, self._progress.held, (transfer_id,)))

    def layer_done(self, layer_index: int) -> None:
        if self._in_step:  # a step without layer-wise transfers records nothing
            self._queue.put((self._recorded(), self._progress.layer_done, (layer_index,)))

    def step_done(self) -> None:
        if self._in_step:
            self._in_step.clear()
            self._queue.put((self._recorded(), self._progress.step_done, ()))

    def close(self, timeout_s: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _recorded(self) -> DeviceEvent:
        event = self._new_event()
        event.record()
        return event

    # ---- its thread ----
    def _apply_in_order(self) -> None:
        while (item := self._queue.get()) is not None:
            event, report, args = item
            try:
                if event is not None:
                    event.synchronize()
                report(*args)
            except Exception:  # noqa: BLE001 - the later reports still apply (held, end)
                logger.exception("layer-wise progress report %s failed", report.__name__)


def ordered_progress(progress: LayerProgress, device: str) -> LayerProgress | DeviceOrderedProgress:
    """Where the engine thread sends its progress reports: straight to `progress` on the CPU, through
    the device's events elsewhere."""
    new_event = device_events(device)
    return progress if new_event is None else DeviceOrderedProgress(progress, new_event)
