"""BackgroundTasks: spawned coroutines run to the end, are awaited by wait(), then forgotten."""

from __future__ import annotations

import asyncio

from pdmesh.background import BackgroundTasks


async def test_spawned_coroutines_run_and_wait_lets_them_finish():
    background, finished = BackgroundTasks(), []

    async def release(name: str) -> None:
        await asyncio.sleep(0.05)
        finished.append(name)

    tasks = [background.spawn(release("a")), background.spawn(release("b"))]
    assert finished == []
    await background.wait(timeout_s=5)
    assert sorted(finished) == ["a", "b"]
    assert all(t.done() for t in tasks)
    assert background._tasks == set()


async def test_wait_gives_up_after_its_timeout():
    background = BackgroundTasks()
    stuck = background.spawn(asyncio.sleep(60))
    await background.wait(timeout_s=0.05)
    assert not stuck.done()
    stuck.cancel()
    await asyncio.gather(stuck, return_exceptions=True)
    assert background._tasks == set()
