"""Which waiting slot the ticker prefills next, between two ticks.

A prompt not in the prefix cache costs a forward over all of it (on a GPU's full model about as
much as several ticks), so the ticker computes at most one of those per gap: callers arriving
together then go live on successive ticks instead of adding their prefills into one overrun.
Cached prompts only copy and may share a gap (docs/engine.md § CUDA graphs, last paragraph).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .call import Call
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
