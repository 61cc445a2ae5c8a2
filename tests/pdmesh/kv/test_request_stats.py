"""A request's stats cross vLLM's processes as plain values and come back typed, of their kind."""

from __future__ import annotations

import json

from pdmesh.kv.params import REQUEST_STATS
from pdmesh.kv.request_stats import PullStats, StoreLoadStats, decode_stats, encode_stats, pull_stats, store_load_stats

PULL = PullStats(num_blocks=3, num_bytes=393216, seconds=0.012, num_reused_tokens=96, transport="shm",
                 layerwise=True, overlap_ratio=0.5)
LOAD = StoreLoadStats(tokens_by_tier={"dram": 64, "remote": 32}, num_local_tokens=32, num_blocks=3, cut=True,
                      transport="grpc")


def test_each_kind_comes_back_as_itself_through_json():
    for stats in (PULL, LOAD):
        assert decode_stats(json.loads(json.dumps(encode_stats(stats)))) == stats


def test_the_servicers_get_only_the_kind_they_read():
    pulled, loaded = {REQUEST_STATS: encode_stats(PULL)}, {REQUEST_STATS: encode_stats(LOAD)}
    assert (pull_stats(pulled), store_load_stats(pulled)) == (PULL, None)
    assert (pull_stats(loaded), store_load_stats(loaded)) == (None, LOAD)
    assert pull_stats(None) is None and store_load_stats({}) is None
