"""Fire-and-forget coroutines (best-effort releases) kept referenced until they finish: the event
loop holds only weak references to tasks, so an unreferenced one may vanish mid-flight."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coroutine: Coroutine) -> asyncio.Task:
        """Runs `coroutine` on the running loop without waiting for it."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self, timeout_s: float) -> None:
        """Lets the tasks still running finish, for at most timeout_s."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


async def cancel_task(task: asyncio.Task) -> None:
    """Cancels a task and waits for it; a cancellation of the caller itself still propagates."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise


async def wait_or_cancel(task: asyncio.Task, timeout_s: float) -> None:
    """Lets a task end on its own within timeout_s; cancels it after that."""
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        await cancel_task(task)
