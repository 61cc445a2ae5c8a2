"""A scheduler-stats query for the engine core process.

vLLM reports scheduler stats (running, waiting, KV-cache usage) only with the outputs of an engine
step, so an idle engine's last report is stale: a request aborted while the engine had nothing
else to do never shows up as freed blocks. vLLM's utility calls (`call_utility_async(name)`) run
an `EngineCore` method between steps in the engine core's process, which is where the scheduler
connector is built; installing the method from there gives the worker an exact, current answer
without waking the model workers (collective_rpc would: each call busy-polls them for a second).
"""

from __future__ import annotations

METHOD_NAME = "pdmesh_scheduler_stats"


def _scheduler_stats(engine_core) -> dict:
    scheduler = engine_core.scheduler
    num_running, num_waiting = scheduler.get_request_counts()
    connector = scheduler.get_kv_connector()
    quiet = getattr(connector, "quiet_steps", None)
    rate = getattr(connector, "compute_rate", None)
    step_time = getattr(connector, "decode_step_time", None)
    return {
        "prefill_tokens_per_s": rate.tokens_per_s if rate is not None else 0.0,
        "decode_step_s": step_time.step_s if step_time is not None else 0.0,
        "engine_quiet_steps": quiet.num_skipped if quiet is not None else 0,
        "num_running_requests": num_running,
        "num_waiting_requests": num_waiting,
        "kv_cache_usage": float(scheduler.get_kv_cache_usage()),
        "num_kv_blocks": int(scheduler.kv_cache_manager.block_pool.num_gpu_blocks),
    }


def install_scheduler_stats() -> None:
    """Adds `EngineCore.pdmesh_scheduler_stats` (idempotent); called in the engine core process."""
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, METHOD_NAME):
        setattr(EngineCore, METHOD_NAME, _scheduler_stats)


async def scheduler_stats(engine) -> dict:
    """The engine's scheduler right now (AsyncLLM in the worker's main process)."""
    return await engine.engine_core.call_utility_async(METHOD_NAME)
