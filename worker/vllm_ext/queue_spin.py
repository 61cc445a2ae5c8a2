"""How vLLM's queues between an engine core and its model workers wait: spin, or sleep briefly.

Each reader of vLLM's shared-memory MessageQueue (the model worker waiting for the next step, the
engine core waiting for the step's result) busy-polls with sched_yield for `busy_loop_s` (1 s) after
every message, and only then sleeps on a socket its writer notifies. An engine with requests steps
without pause, so its engine core and model workers spin for as long as it has any: a core each
where no one else needs it (vLLM's case: the model runs on an accelerator). On the CPU the model
runs on the host's cores, and on a host where engines share cores the spinners took them from
everything else: in the soak (4 engines on 2 cores) an engine whose requests waited for another's
KV spun its model worker on a shared core for seconds while that other engine's model worker,
runnable on the same core and serving the KV, got 0.3 ms of it in 6.4 s (bench/REPORT.md, Soak).

A reader that does not spin sleeps on the socket, and vLLM's writer can lose that wake-up: its
PUB socket keeps one notification in flight (SNDHWM 1) and drops the next while one is queued,
which a sleeping reader may already have taken as stale. vLLM's reader then rechecks only after
5 s (every engine of the soak sat in that sleep, both ends of each queue waiting). So a reader
that does not spin sleeps at most `MIN_SLEEP_MS` after a message, doubling up to `MAX_SLEEP_MS`
while none comes: a lost wake-up costs a busy engine a millisecond, an idle one at most 64 ms.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

MIN_SLEEP_MS = 1
MAX_SLEEP_MS = 64


def default_spin_s() -> float | None:
    """0 on the CPU platform (the spin takes the cores the model computes on); None elsewhere (vLLM's)."""
    from vllm.platforms import current_platform

    return 0.0 if current_platform.is_cpu() else None


def set_queue_spin(spin_s: float | None, condition_class: type | None = None) -> None:
    """Every MessageQueue reader of this process, those made before included, spins `spin_s` after a
    message, then sleeps in bounded turns (None: vLLM's own waits). `condition_class`: vLLM's
    SpinCondition unless given (tests). Where this vLLM has none, its queues wait as it has them."""
    if spin_s is None:
        return
    if condition_class is None:
        try:
            from vllm.distributed.device_communicators.shm_broadcast import SpinCondition as condition_class
        except ImportError:
            logger.warning("this vLLM has no SpinCondition: its queues wait as it has them")
            return
    vllm_wait = getattr(condition_class.wait, "_pdmesh_vllm_wait", condition_class.wait)

    def wait(self, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = spin_s   # read by vLLM's wait: spin while the last read is this recent
        sleep_ms = _next_sleep_ms(self)
        return vllm_wait(self, sleep_ms if timeout_ms is None else min(timeout_ms, sleep_ms))

    wait._pdmesh_vllm_wait = vllm_wait
    condition_class.wait = wait


def _next_sleep_ms(condition) -> int:
    """MIN_SLEEP_MS for the first wait after a message (vLLM's reader records each read), then
    twice the last, up to MAX_SLEEP_MS."""
    if condition.last_read != getattr(condition, "_pdmesh_last_read", None):
        condition._pdmesh_last_read = condition.last_read
        condition._pdmesh_sleep_ms = MIN_SLEEP_MS
    else:
        condition._pdmesh_sleep_ms = min(2 * condition._pdmesh_sleep_ms, MAX_SLEEP_MS)
    return condition._pdmesh_sleep_ms
