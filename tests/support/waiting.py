"""Waiting in a test for something that happens on another thread, loop or process: the check is
looked at every 20 ms until it holds, with a deadline, never a fixed sleep that races it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


async def eventually(check: Callable[[], Any], what: str, seconds: float = 10.0) -> Any:
    """`check()`'s value once it is true; the test fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (result := check()):
        assert time.monotonic() < deadline, f"waited {seconds:g} s for {what}"
        await asyncio.sleep(0.02)
    return result
