"""The Python heap a serving process builds at start, kept out of garbage collection, and the
collections that still pause it, measured.

A model worker's heap after start-up is millions of objects (torch modules, the compiled graphs,
vLLM's runner); CPython's full collection walks all of them while holding the GIL, so every other
thread of the process waits: in an engine's model worker that is the KV port (a pull's answer, a
store export) and the connector's transfer threads. On a CPU-starved host such a collection froze a
prefill worker's every thread for 6-14 s in the soak (every thread's stack unchanged between two
dumps 6 s apart, the main thread holding the GIL). vLLM freezes its engine core's heap after start
for the same reason (`freeze_gc_heap`); the model worker's it leaves. `freeze_startup_heap` moves
what exists into the permanent generation, so later collections walk only what came after;
`GcPauses` times each collection and logs the long ones."""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)
LONG_PAUSE_S = 0.2   # a collection longer than this is logged


@dataclass(frozen=True)
class FrozenHeap:
    num_objects: int          # moved into the permanent generation
    collect_s: float          # the full collection just before: what one cost before the freeze


def freeze_startup_heap() -> FrozenHeap:
    """Collects once, then freezes everything left, and from then on logs the process's long
    collections (process_gc_pauses; not this deliberate one). Call once the process has started:
    the model loaded and warmed up."""
    started = time.perf_counter()
    gc.collect()
    collect_s = time.perf_counter() - started
    gc.freeze()
    process_gc_pauses()
    return FrozenHeap(gc.get_freeze_count(), collect_s)


class GcPauses:
    """Times the process's garbage collections (gc.callbacks); one per process: `process_gc_pauses`."""

    def __init__(self, long_pause_s: float = LONG_PAUSE_S, clock=time.perf_counter) -> None:
        self._long_pause_s = long_pause_s
        self._clock = clock
        self._started: float | None = None
        self.num_long = 0
        self.longest_s = 0.0

    def install(self) -> "GcPauses":
        gc.callbacks.append(self._on_collection)
        return self

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        if self._started is None:
            return
        # gc.callbacks run holding the GIL, one collection at a time: no lock needed
        took_s, self._started = self._clock() - self._started, None
        self.longest_s = max(self.longest_s, took_s)
        if took_s <= self._long_pause_s:
            return
        self.num_long += 1
        logger.warning("garbage collection of generation %d took %.2f s (%d collected); every thread waited",
                       info.get("generation", -1), took_s, info.get("collected", 0))


_process_pauses: GcPauses | None = None
_install_lock = threading.Lock()


def process_gc_pauses() -> GcPauses:
    """This process's GcPauses, installed on the first call."""
    global _process_pauses
    with _install_lock:
        if _process_pauses is None:
            _process_pauses = GcPauses().install()
        return _process_pauses
