"""Which waiting slot the ticker prefills next, between two ticks: at most one uncached prompt (a
forward over all of it) per gap, so that callers arriving together go live on successive ticks
instead of one overrun (docs/engine.md § CUDA graphs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from .call import Call
from .clock import Clock
from .config import PoolConfig
from .slot_table import SlotTable


def next_prefill(table: SlotTable, lock: threading.Lock, prefix_cached: Callable[[str, str], bool],
                 cold_allowed: bool) -> tuple[int, Call, bool] | None:
    """The next slot to prefill, claimed (`Call.claim_prefill`), and whether its prompt must be
    computed (cold); a cold one only where `cold_allowed`. The cache is asked outside `lock`:
    it tokenizes the persona."""
    with lock:
        waiting = table.waiting_prefills()
    for slot, call in waiting:
        try:
            cold = not prefix_cached(call.voice, call.persona)
        except Exception:  # start_session will say what is wrong with the request
            cold = True
        if cold and not cold_allowed:
            continue
        with lock:
            if call.claim_prefill():
                return slot, call, cold
    return None


def gap_prefills(table: SlotTable, lock: threading.Lock, prefix_cached: Callable[[str, str], bool], clock: Clock,
                 config: PoolConfig) -> Iterator[tuple[int, Call, bool]]:
    """The prefills of one gap between ticks, each claimed as it is due: until the gap's budget is
    spent (the first runs whatever the budget), at most `cold_prefills_per_gap` of them cold."""
    budget_end = clock.monotonic() + config.prefill_budget_seconds
    ran = cold_ran = 0
    limit = config.cold_prefills_per_gap
    while not ran or clock.monotonic() < budget_end:
        pending = next_prefill(table, lock, prefix_cached, not limit or cold_ran < limit)
        if pending is None:
            return
        ran, cold_ran = ran + 1, cold_ran + pending[2]
        yield pending
