"""A serving process's start-up heap frozen out of garbage collection, and long collections logged
(pdmesh/gc_heap.py). The workers' own freeze at start: tests/e2e/test_mesh_telemetry.py."""

from __future__ import annotations

import gc
import logging

import pytest

from pdmesh import gc_heap
from pdmesh.gc_heap import GcPauses, freeze_startup_heap


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def unfrozen(monkeypatch):
    monkeypatch.setattr(gc_heap, "_process_pauses", None)
    yield
    gc.unfreeze()
    if gc_heap._process_pauses is not None:
        gc_heap._process_pauses.uninstall()


def test_the_heap_left_after_a_collection_is_frozen_and_later_collections_are_timed(unfrozen):
    kept = [[index] for index in range(50_000)]   # containers the collector tracks
    frozen = freeze_startup_heap()
    # frozen objects may still be freed (other threads of the suite drop references), never added
    assert frozen.num_objects >= gc.get_freeze_count() >= len(kept)
    assert frozen.collect_s >= 0.0
    assert gc.get_count()[2] == 0   # nothing left for a full collection to walk
    pauses = gc_heap._process_pauses
    assert pauses is not None and pauses.longest_s == 0.0   # the freeze's own collection is not one of them
    gc.collect()
    assert pauses.longest_s > 0.0
    del kept


def test_a_long_collection_is_logged_and_counted(caplog):
    clock = FakeClock()
    pauses = GcPauses(long_pause_s=0.2, clock=clock)
    with caplog.at_level(logging.WARNING, logger="pdmesh.gc_heap"):
        pauses._on_collection("start", {"generation": 2})
        clock.now += 0.5
        pauses._on_collection("stop", {"generation": 2, "collected": 7})
        pauses._on_collection("start", {"generation": 0})
        clock.now += 0.01
        pauses._on_collection("stop", {"generation": 0, "collected": 0})
    assert (pauses.num_long, pauses.longest_s) == (1, pytest.approx(0.5))
    assert [r.getMessage() for r in caplog.records] == [
        "garbage collection of generation 2 took 0.50 s (7 collected); every thread waited"]


def test_installed_it_times_the_processs_real_collections():
    pauses = GcPauses(long_pause_s=60.0).install()
    try:
        gc.collect()
    finally:
        pauses.uninstall()
    assert pauses.longest_s > 0.0 and pauses.num_long == 0
    assert pauses._on_collection not in gc.callbacks
