from types import SimpleNamespace

import pytest

from worker.step_time import DecodeStepTime, num_decodes


def test_back_to_back_decoding_steps_are_the_tpot_and_idle_pauses_are_not():
    step_time = DecodeStepTime(max_gap_s=2.0, alpha=0.5)
    step_time.on_step(0, now=10.0)      # a prompt's step
    step_time.on_step(2, now=10.3)      # its first decode: the prompt stalled the batch 0.3 s
    assert (step_time.step_s, step_time.num_samples) == (pytest.approx(0.3), 1)
    step_time.on_step(2, now=10.4)      # 0.1 s: EWMA 0.3 -> 0.2
    assert step_time.step_s == pytest.approx(0.2)
    step_time.on_step(0, now=11.0)      # a new prompt after a pause: no decode, no sample
    step_time.on_step(1, now=14.0)      # 3 s later: past max_gap_s (the engine idled), no sample
    assert (step_time.step_s, step_time.num_samples) == (pytest.approx(0.2), 2)


def test_a_step_decodes_the_running_requests_given_one_token():
    output = SimpleNamespace(num_scheduled_tokens={"decoding": 1, "chunk": 512, "new": 1, "other": 1},
                             scheduled_cached_reqs=SimpleNamespace(req_ids=["decoding", "chunk", "other"]))
    assert num_decodes(output) == 2   # "new" is first scheduled now (a cached prompt's last token)
