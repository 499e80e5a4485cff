"""How late a door's event loop wakes up: when it falls behind, agent audio reaches callers late
however fast the engine ticks, so the room seats nobody new. One probe per loop reports its worst
oversleep every `PERIOD`; it starts with the first call on that loop.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from .room import Room

log = logging.getLogger(__name__)

INTERVAL = 0.05  # seconds between two wake-ups
PERIOD = 1.0  # seconds between two reports

_probes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task] = weakref.WeakKeyDictionary()


async def probe(room: Room, interval: float = INTERVAL, period: float = PERIOD) -> None:
    """Report the worst wake-up lateness of this loop to `room`, every `period` seconds, forever."""
    loop = asyncio.get_running_loop()
    worst, since = 0.0, loop.time()
    while True:
        asked = loop.time()
        await asyncio.sleep(interval)
        now = loop.time()
        worst = max(worst, now - asked - interval)
        if now - since >= period:
            try:
                room.report_media_lag(worst)
            except Exception:  # a room that cannot take the report must not stop the probe
                log.exception("reporting the event loop's lag failed")
            worst, since = 0.0, now


def ensure_probe(room: Room) -> None:
    """Start this loop's probe unless it runs already (call on the loop)."""
    loop = asyncio.get_running_loop()
    task = _probes.get(loop)
    if task is None or task.done():
        _probes[loop] = loop.create_task(probe(room), name="event-loop-lag-probe")
