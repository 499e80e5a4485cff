"""Helpers shared by the tests that place calls: waiting for a pool to empty, WebRTC callers."""

from __future__ import annotations

import asyncio
import time


async def wait_all_free(pool, seconds: float = 3.0) -> None:
    """Wait until every slot of `pool` (anything with `snapshot()` and `slots_total`) is free."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and pool.snapshot().slots_free < pool.slots_total:
        await asyncio.sleep(0.05)
    assert pool.snapshot().slots_free == pool.slots_total
