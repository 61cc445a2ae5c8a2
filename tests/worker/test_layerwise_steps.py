"""Which tokens and blocks each engine step computes for layer-wise prompts, from stand-ins for
vLLM's SchedulerOutput (the e2e tests drive real vLLM with chunked prefill)."""

from types import SimpleNamespace

from pdmesh.kv.tasks import LayerwiseStep
from worker.layerwise_steps import LayerwiseSteps

NAMES_100 = [b"n0", b"n1", b"n2", b"n3"]   # a 100-token prompt's 4 block names (worker/prompt_hashes.py)


def _output(new=(), cached=(), preempted=(), resumed=()):
    """new: (req_id, block_ids, num_computed, num_scheduled); cached: (req_id, new_block_ids, num_computed, n)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached], new_block_ids=[(b,) if b is not None else None for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached], resumed_req_ids=set(resumed)),
        num_scheduled_tokens={r: n for r, *_, n in [*new, *cached]},
        preempted_req_ids=set(preempted))


def test_chunks_report_their_token_ranges_and_the_blocks_so_far():
    steps = LayerwiseSteps()
    steps.track("e1", "t1", "mesh-1", 100, NAMES_100)
    assert steps.take(_output(new=[("e1", [4, 5], 0, 64), ("other", [9], 0, 10)])) == (
        [LayerwiseStep("t1", "mesh-1", [4, 5], 0, 64)], [], [])
    assert steps.take(_output(cached=[("e1", [6, 7], 64, 36)])) == (
        [LayerwiseStep("t1", "mesh-1", [4, 5, 6, 7], 64, 100, NAMES_100)], [], [])  # the last: it names the blocks


def test_only_the_step_completing_the_prompt_carries_its_block_names():
    steps = LayerwiseSteps()
    steps.track("e1", "t1", "mesh-1", 100, NAMES_100)
    (first,), _, _ = steps.take(_output(new=[("e1", [4, 5], 0, 64)]))
    (last,), _, _ = steps.take(_output(cached=[("e1", [6, 7], 64, 36)]))
    assert (first.block_hashes, last.block_hashes) == (None, NAMES_100)


def test_a_prefix_hit_is_ready_from_the_first_step():
    steps = LayerwiseSteps()
    steps.track("e1", "t1", "mesh-1", 70, NAMES_100[:3])
    (step,), _, _ = steps.take(_output(new=[("e1", [4, 5, 6], 64, 6)]))
    assert (step.num_tokens_before, step.num_tokens_after) == (64, 70)


def test_preemption_restarts_and_the_resumed_request_names_all_its_new_blocks():
    steps = LayerwiseSteps()
    steps.track("e1", "t1", "mesh-1", 100, NAMES_100)
    steps.take(_output(new=[("e1", [4, 5], 0, 64)]))
    assert steps.take(_output(preempted=["e1"])) == ([], ["t1"], [])
    steps.track("e1", "t1", "mesh-1", 100, NAMES_100)  # allocated again: kept as it is
    (step,), restarted, _ = steps.take(_output(cached=[("e1", [8, 9, 10, 11], 0, 100)], resumed=["e1"]))
    assert (step.block_ids, step.num_tokens_before, step.num_tokens_after, restarted) == ([8, 9, 10, 11], 0, 100, [])


def test_a_request_that_ends_unheld_ends_its_transfer_once():
    steps = LayerwiseSteps()
    steps.track("e1", "t1", "mesh-1", 100, NAMES_100)
    steps.finish("e1", "t1", held=False)
    steps.finish("e2", "t2", held=True)
    assert steps.take(_output()) == ([], [], ["t1"])
    assert steps.take(_output(cached=[("e1", None, 64, 36)])) == ([], [], [])  # no longer tracked
