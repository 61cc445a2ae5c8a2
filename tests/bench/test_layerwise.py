"""The layer-wise benchmark's summary: medians per flow, the issue's target, and the alternating pairs."""

from bench.bench_layerwise import _summary


def _sample(ttft_s: float, transfer_s: float = 0.004, prefill_s: float = 0.05, handoff_s: float = 0.01) -> dict:
    return {"ttft_s": ttft_s, "transfer_s": transfer_s, "after_s": 0.001, "overlap_ratio": 0.5,
            "prefill_s": prefill_s, "handoff_s": handoff_s}


def test_the_target_compares_medians_and_the_pairs_are_counted_in_order():
    pull = [_sample(t) for t in (0.100, 0.300, 0.102)]
    layerwise = [_sample(t) for t in (0.095, 0.098, 0.110)]
    (row,) = _summary({512: {"pull": pull, "layerwise": layerwise}}).values()
    assert round(row["ttft_saved_ms"], 6) == 4.0                 # medians 102 vs 98 ms
    assert row["target_met"] is True                              # 98 <= 102 - 0.8 * 4
    assert round(row["paired_saved_ms"], 6) == 5.0                # pairs: +5, +202, -8 ms
    assert (row["pairs_layerwise_faster"], row["num_pairs"]) == (2, 3)
    assert row["target_met_paired"] is True                       # 5 >= 0.8 * 4


def test_the_paired_target_and_the_split_at_prefills_answer():
    pull = [_sample(t, prefill_s=p, handoff_s=h)
            for t, p, h in ((0.100, 0.080, 0.020), (0.150, 0.090, 0.018), (0.120, 0.085, 0.019))]
    layerwise = [_sample(t, prefill_s=p, handoff_s=h)
                 for t, p, h in ((0.095, 0.100, 0.004), (0.145, 0.109, -0.002), (0.125, 0.104, 0.001))]
    (row,) = _summary({512: {"pull": pull, "layerwise": layerwise}}).values()
    assert round(row["paired_saved_ms"], 6) == 5.0                # pairs: +5, +5, -5 ms
    assert (row["target_met"], row["target_met_paired"]) == (False, True)  # medians 120 vs 125; 5 >= 3.2
    assert [round(row[k], 6) for k in ("pull_prefill_ms", "layerwise_prefill_ms", "pull_handoff_ms",
                                       "layerwise_handoff_ms")] == [85.0, 104.0, 19.0, 1.0]


def test_saving_less_than_four_fifths_of_the_transfer_misses_the_target():
    pull = [_sample(0.100, transfer_s=0.010)]
    layerwise = [_sample(0.093)]
    (row,) = _summary({512: {"pull": pull, "layerwise": layerwise}}).values()
    assert row["target_met"] is False                             # 93 > 100 - 8
