"""About a minute of churn: callers come, talk, hang up, vanish and misbehave; nothing leaks."""

from __future__ import annotations

import asyncio

from .support.soak import run_soak


def test_soak_leaves_every_slot_free(tiny_cache_dir):
    rep = asyncio.run(run_soak(seconds=45, slots=3, callers=12, cache_dir=tiny_cache_dir, seed=1))
    assert not rep.unexpected_errors, rep.unexpected_errors
    assert rep.slots_free_at_end == 3 and rep.queue_at_end == 0
    assert rep.live_calls >= 10 and rep.frames_out > 500
    assert rep.refused_bad_input > 0 and rep.vanished > 0 and rep.released_early > 0
    assert rep.end_reasons.get("idle", 0) > 0  # vanished callers were released by the idle timer
    assert rep.pool["engine_errors"] == 0
    # Memory stays flat once warm (generous bound: the allocator keeps what it has).
    assert rep.rss_end_mb - rep.rss_warm_mb < 200, (rep.rss_warm_mb, rep.rss_end_mb)
