"""The soak's warm-up: its first checkpoint waits for the requests it names, within a deadline."""

from __future__ import annotations

import asyncio
import time

from bench.fault_campaign.soak import _until_ended


def test_warmup_waits_for_the_requests_it_names():
    results: list[int] = []

    async def finish_requests():
        for index in range(3):
            await asyncio.sleep(0.3)
            results.append(index)

    async def scenario():
        finishing = asyncio.create_task(finish_requests())
        await _until_ended(results, 3, time.monotonic() + 30)
        await finishing

    started = time.monotonic()
    asyncio.run(scenario())
    assert len(results) == 3 and 0.9 <= time.monotonic() - started < 5


def test_warmup_gives_up_at_its_deadline():
    started = time.monotonic()
    asyncio.run(_until_ended([], 1, time.monotonic() + 1.5))
    assert 1.5 <= time.monotonic() - started < 3
