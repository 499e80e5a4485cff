"""`GET /metrics`: the pool in the Prometheus text format, scraped during real calls on the tiny engine."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.serving.room import PoolFullError
from personaplex_demo.web.prometheus import metrics_routes


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a scrape."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(http: httpx.AsyncClient) -> dict[tuple[str, tuple], float]:
    r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
    return samples(r.text)


@pytest.fixture(scope="module")
def runtime(tiny_cache_dir):
    return build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir))


async def test_metrics_during_and_after_calls(runtime):
    pool = SlotPool(runtime.engine, PoolConfig(max_queue=0, time_limit_seconds=60))
    app = Starlette(routes=metrics_routes(pool))
    pool.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            before = await scrape(http)
            assert before[("personaplex_slots", ())] == 2 and before[("personaplex_slots_free", ())] == 2
            assert before[("personaplex_calls_ended_total", (("reason", "hangup"),))] == 0
            assert before[("personaplex_tick_seconds_count", ())] == 0
            assert ("process_resident_memory_bytes", ()) in before

            a = pool.admit("NATF2", "You enjoy having a good conversation.")
            b = pool.admit("NATM1", "")
            with pytest.raises(PoolFullError):
                pool.admit("NATF2", "")
            await asyncio.gather(a.wait_live(10), b.wait_live(10))
            frame = (0.1 * np.sin(np.arange(1920) / 10)).astype(np.float32)
            for _ in range(25):  # 2 s of microphone audio for each call, in real time
                a.push_audio(frame)
                b.push_audio(frame)
                await asyncio.sleep(0.08)
                while await a.next_output(0) is not None or await b.next_output(0) is not None:
                    pass
            during = await scrape(http)
            assert during[("personaplex_slots_live", ())] == 2 and during[("personaplex_slots_free", ())] == 0
            assert during[("personaplex_calls_started_total", ())] == 2
            assert during[("personaplex_calls_refused_total", ())] == 1
            ticks = during[("personaplex_tick_seconds_count", ())]
            assert ticks >= 15 and during[("personaplex_ticks_total", ())] >= ticks - 1
            assert during[("personaplex_tick_seconds_bucket", (("le", "+Inf"),))] == ticks
            assert 0 < during[("personaplex_tick_seconds_sum", ())] < ticks * 1.0
            # Every frame pushed and stepped has its latency in the histogram, two calls per tick.
            frames = during[("personaplex_frame_latency_seconds_count", ())]
            assert frames >= 30 and frames <= 2 * ticks
            buckets = [v for (name, labels), v in during.items() if name == "personaplex_frame_latency_seconds_bucket"]
            assert buckets == sorted(buckets)  # cumulative

            a.release("hangup")
            b.release("error: RuntimeError: boom")
            await asyncio.sleep(0.3)
            after = await scrape(http)
            assert after[("personaplex_calls_ended_total", (("reason", "hangup"),))] == 1
            assert after[("personaplex_calls_ended_total", (("reason", "error"),))] == 1
            assert after[("personaplex_slots_free", ())] == 2 and after[("personaplex_slots_live", ())] == 0
            assert after[("personaplex_engine_errors_total", ())] == 0
    finally:
        pool.shutdown()
