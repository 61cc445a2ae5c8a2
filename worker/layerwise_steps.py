"""Producer scheduler side of the layer-wise flow: which tokens and blocks each step computes for
the prompts whose KV a consumer reads while they are prefilled (chunked prefill: one step per
chunk). Read from vLLM's SchedulerOutput; nothing here waits on anything."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdmesh.kv.tasks import LayerwiseStep


@dataclass
class _Prefilling:
    transfer_id: str
    pdmesh_request_id: str
    num_prompt_tokens: int
    block_hashes: list[bytes]   # the prompt's chained block names (worker/prompt_hashes.py)
    block_ids: list[int] = field(default_factory=list)


class LayerwiseSteps:
    def __init__(self) -> None:
        self._prefilling: dict[str, _Prefilling] = {}  # engine request id: its layer-wise transfer
        self._restarted: list[str] = []
        self._ended: list[str] = []

    def track(self, request_id: str, transfer_id: str, pdmesh_request_id: str, num_prompt_tokens: int,
              block_hashes: list[bytes]) -> None:
        """A layer-wise request was allocated blocks (again, after a preemption: kept as it is)."""
        self._prefilling.setdefault(request_id, _Prefilling(transfer_id, pdmesh_request_id, num_prompt_tokens,
                                                            block_hashes))

    def finish(self, request_id: str, transfer_id: str, held: bool) -> None:
        """The request left the engine (perhaps before it was ever scheduled); held: its blocks are
        held under the transfer id, else the transfer ends here and its watchers are told."""
        self._prefilling.pop(request_id, None)
        if not held:
            self._ended.append(transfer_id)

    def has_news(self) -> bool:
        """Restarted or ended transfers the workers have not been told of."""
        return bool(self._restarted or self._ended)

    def take(self, scheduler_output: Any) -> tuple[list[LayerwiseStep], list[str], list[str]]:
        """This step's (steps, restarted transfer ids, ended transfer ids)."""
        restarted, ended, self._restarted, self._ended = self._restarted, self._ended, [], []
        if not self._prefilling or scheduler_output is None:
            return [], restarted, ended
        for request_id in scheduler_output.preempted_req_ids or ():
            prefilling = self._prefilling.get(request_id)
            if prefilling is not None:  # its blocks are freed: what was read of them is stale
                prefilling.block_ids = []
                restarted.append(prefilling.transfer_id)
        steps = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prefilling = self._prefilling.get(new.req_id)
            if prefilling is not None:
                prefilling.block_ids = list(new.block_ids[0])
                steps.append(self._step(prefilling, new.num_computed_tokens, num_scheduled[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            prefilling = self._prefilling.get(request_id)
            if prefilling is None:
                continue
            new_block_ids = cached.new_block_ids[i]
            if request_id in cached.resumed_req_ids:
                prefilling.block_ids = []
            if new_block_ids is not None:
                prefilling.block_ids += new_block_ids[0]
            steps.append(self._step(prefilling, cached.num_computed_tokens[i], num_scheduled[request_id]))
        return steps, restarted, ended

    @staticmethod
    def _step(prefilling: _Prefilling, num_computed_tokens: int, num_scheduled_tokens: int) -> LayerwiseStep:
        before = min(num_computed_tokens, prefilling.num_prompt_tokens)
        after = min(num_computed_tokens + num_scheduled_tokens, prefilling.num_prompt_tokens)
        completes = before < after == prefilling.num_prompt_tokens  # this step computes its last tokens
        return LayerwiseStep(prefilling.transfer_id, prefilling.pdmesh_request_id, list(prefilling.block_ids),
                             before, after, prefilling.block_hashes if completes else None)
