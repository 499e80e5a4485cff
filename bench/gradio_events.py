"""What Gradio's queue spends after each event, against how many events the server has run.

Gradio 5.50 keeps an analytics entry for every event it has run and, after each event, summarises
all of them with a pandas table (rtc/patches.py). This times that step (`Queue.
compute_analytics_summary`, as the queue calls it) after 1,000 to 50,000 past events, for a page
as Gradio builds it and for one with `bound_event_log`, and turns it into cores at the rate of
events that 60 open pages raise (the room's stats every 5 s each: 12 a second).

    .venv/bin/python bench/gradio_events.py [--write]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradio as gr  # noqa: E402

from bench.common import md_table, replace_section  # noqa: E402
from personaplex_demo.rtc.patches import bound_event_log  # noqa: E402

log = logging.getLogger("bench.gradio_events")
EVENTS_PER_SECOND = 60 / 5  # 60 open pages, one stats event every 5 s each


def per_event_ms(bounded: bool, past: int, repeats: int = 5) -> float:
    with gr.Blocks() as demo:
        gr.Markdown("page")
    if bounded:
        bound_event_log(demo)
    queue = demo._queue
    functions = ["tick", "relay", "stats", "start_recording"]
    for i in range(past):
        queue.event_analytics[f"past-{i}"] = {"time": 0.0, "status": "success", "process_time": 0.002,
                                             "function": functions[i % 4], "session_hash": f"s{i % 60}"}
    queue.compute_analytics_summary(queue.event_analytics)  # warm: pandas imported, caches filled
    start = time.perf_counter()
    for k in range(repeats):
        queue.event_analytics[f"new-{k}"] = {"time": 0.0, "status": "success", "process_time": 0.002,
                                            "function": "stats", "session_hash": "s0"}
        queue.compute_analytics_summary(queue.event_analytics)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for past in (1_000, 10_000, 50_000):
        gradio_ms, bounded_ms = per_event_ms(False, past), per_event_ms(True, past)
        hours = past / EVENTS_PER_SECOND / 3600
        rows.append([f"{past:,}", f"{hours:.1f}", f"{gradio_ms:.1f}", f"{gradio_ms * EVENTS_PER_SECOND / 1e3:.2f}",
                     f"{bounded_ms:.3f}"])
        log.info("%s past events: %.1f ms per event as Gradio builds the page, %.3f ms bounded", past, gradio_ms,
                 bounded_ms)
    body = md_table(["past events", "hours of 60 open pages", "per event, Gradio as built (ms)",
                     "cores at 12 events/s", "per event, bounded (ms)"], rows)
    body += ("\n\nThe summary runs after every event Gradio's queue finishes; 60 open pages raise 12 a second "
             "from the room's stats alone. With `bound_event_log` (what `build_ui` does) the record keeps "
             "the newest 512-1,024 finished events and no summary is built "
             "(docs/design-notes.md § Gradio event log).")
    print(body)
    if a.write:
        replace_section("Gradio's record of past events", body)


if __name__ == "__main__":
    main()
