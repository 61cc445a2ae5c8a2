"""Tasks named as the connector's scheduler side names them (worker/prompt_hashes.py): for tests
that hand a worker its tasks directly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from pdmesh.compat import fingerprint_seed
from pdmesh.kv.block_hash import chain_block_hashes

Task = TypeVar("Task")


def names(worker, token_ids: Sequence[int], extra_key: bytes = b"") -> list[bytes]:
    """The chained names of the blocks holding token_ids (the partial last one too), under the
    worker's model fingerprint."""
    compat = worker.compat
    return chain_block_hashes(fingerprint_seed(compat), token_ids, compat.block_size, extra_key, include_partial=True)


def named(worker, task: Task) -> Task:
    """A SendTask, RecvTask or StoreLoadTask with the names of its tokens' blocks."""
    task.block_hashes = names(worker, task.token_ids, task.extra_key)
    return task
