"""The layer-wise consumer's idle timeout: a producer that shows no progress for idle_timeout_s is
given up on; a step's start shows progress though it is not announced (no new version)."""

import pytest

from decode.kv import layerwise_read
from decode.kv.layerwise_read import LayerwiseTarget, LayerwiseTiming, read_layerwise
from pdmesh.errors import WorkerFailed
from pdmesh.transport.kv_transport import PeerLink, ReadOptions
from pdmesh.v1 import kv_transfer_pb2

WATCH_S = 1.0   # each Watch answers this long after it was asked (as one answering at its wait)
IDLE_S = 2.5
HASHES = [b"h0", b"h1"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(layerwise_read, "time", fake)
    return fake


class ScriptedControl:
    """Answers Watch with the next of `answers`, WATCH_S later on `clock`."""

    def __init__(self, clock: FakeClock, answers: list[kv_transfer_pb2.WatchResponse]) -> None:
        self._clock, self._answers = clock, list(answers)

    def watch(self, address, transfer_id, seen_version, wait_s, block_indexes, transport):
        self._clock.now += WATCH_S
        return self._answers.pop(0)


class RecordingReader:
    transport = "shm"

    def __init__(self) -> None:
        self.landed: list[tuple[list[int], range]] = []

    def digest_matrix(self, num_blocks: int):
        return None

    def land_layers(self, link, transfer_id, block_indexes, src_ids, dst_ids, layers, digests, options) -> None:
        self.landed.append((list(src_ids), layers))


def _step(num_partial_tokens: int) -> kv_transfer_pb2.WatchResponse:
    return kv_transfer_pb2.WatchResponse(version=1, started=True, block_ids=[5, 6], num_ready_tokens=0,
                                         num_partial_tokens=num_partial_tokens)


def _read(clock: FakeClock, answers: list[kv_transfer_pb2.WatchResponse]) -> RecordingReader:
    reader = RecordingReader()
    target = LayerwiseTarget(block_size=4, num_tokens=8, num_layers=2, idle_timeout_s=IDLE_S)
    control, link = ScriptedControl(clock, answers), PeerLink("peer:1", "shm")
    list(read_layerwise(reader, control, link, "t1", [0, 1], [0, 1], HASHES, target, LayerwiseTiming(),
                        ReadOptions(verify=False)))
    return reader


HELD = kv_transfer_pb2.WatchResponse(version=2, started=True, block_ids=[5, 6], num_ready_tokens=8,
                                     num_partial_tokens=8, held=True, checksums=[1, 2], block_hashes=HASHES)


def test_a_steps_unannounced_start_is_progress(clock):
    # the first chunk computes, then the second chunk starts (same version), then the prompt is
    # held: no new version for 4 answers (4 s > IDLE_S), but the step's tokens moved at the 3rd
    reader = _read(clock, [_step(4), _step(4), _step(8), _step(8), HELD])
    assert reader.landed == [([5, 6], range(0, 2))]  # every layer once held


def test_a_producer_without_progress_is_given_up_on(clock):
    with pytest.raises(WorkerFailed, match="no prefill progress for 2 s"):
        _read(clock, [_step(4)] * 5 + [HELD])
    assert clock.now == 4 * WATCH_S  # given up at the first answer past IDLE_S
