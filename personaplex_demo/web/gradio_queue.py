"""Gradio's record of every event it ran, kept bounded.

Gradio 5.50's queue keeps one analytics entry per event it has ever run (`Queue.event_analytics`,
for its `/monitoring` dashboard), and after each event it builds a pandas table of all of them to
summarise it again. Every open page here raises an event every few seconds (the room's stats), and
each call a few more, so on a server that runs for days the entries pile up without end, and the
summary after each event costs more the longer the server has run: about 20 ms at 10,000 entries
and 60-90 ms at 50,000 on the test machine, after every one of a dozen events a second with 60
pages open (docs/design-notes.md § Gradio event log). `bound_event_log` keeps the newest entries only
and turns the per-event summary off; the dashboard, which this app does not link to, then shows
the figures of its first events.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

KEEP_EVENTS = 512
_FINISHED = ("success", "failed", "cancelled")
_NEVER = 10**12  # events between two summaries: never again


class BoundedEventLog(dict):
    """A dict that, past twice its limit, forgets its oldest finished entries. Entries of events
    still queued or running stay: Gradio updates them when they finish."""

    def __init__(self, limit: int, entries: dict[str, Any] | None = None) -> None:
        super().__init__(entries or {})
        self.limit = limit

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if len(self) > 2 * self.limit:
            excess = len(self) - self.limit
            finished = [k for k, entry in self.items() if isinstance(entry, dict) and entry.get("status") in _FINISHED]
            for k in finished[:excess]:  # insertion order: the oldest first
                del self[k]


def bound_event_log(demo: Any, limit: int = KEEP_EVENTS) -> None:
    """Bound `demo`'s queue record (Gradio 5.50's `Queue.event_analytics`); a Gradio without it is left alone."""
    queue = getattr(demo, "_queue", None)
    entries = getattr(queue, "event_analytics", None)
    if not isinstance(entries, dict) or not hasattr(queue, "ANAYLTICS_CACHE_FREQUENCY"):
        log.warning("this Gradio's queue keeps no event_analytics record; not bounding it")
        return
    queue.event_analytics = BoundedEventLog(limit, entries)
    queue.ANAYLTICS_CACHE_FREQUENCY = _NEVER  # (Gradio's spelling) no pandas table after each event
