"""Gradio's record of past events stays bounded, and no table of it is built after each event."""

from __future__ import annotations

import gradio as gr
from gradio.queueing import Queue

from personaplex_demo.rtc.patches import BoundedEventLog, bound_event_log


def entry(status: str) -> dict:
    return {"time": 0.0, "status": status, "process_time": 0.001, "function": "tick", "session_hash": "s"}


def test_the_log_forgets_the_oldest_finished_events_and_keeps_running_ones():
    log = BoundedEventLog(limit=100)
    log["relay"] = entry("processing")  # a call's page relay runs for the whole call
    for i in range(5000):
        log[f"e{i}"] = entry("success" if i % 3 else "cancelled")
        log[f"e{i}"]["status"] = log[f"e{i}"]["status"]  # Gradio updates entries in place
    assert len(log) <= 201
    assert "relay" in log and "e4999" in log and "e0" not in log
    log["relay"]["status"] = "success"  # it finishes late: its entry is still there to update


def test_a_built_page_keeps_a_bounded_log_and_builds_no_summary_table(monkeypatch):
    with gr.Blocks() as demo:
        gr.Markdown("page")
    bound_event_log(demo, limit=50)
    queue = demo._queue
    assert isinstance(queue.event_analytics, BoundedEventLog)

    def no_table(_entries):
        raise AssertionError("a pandas table of every past event was built")

    monkeypatch.setattr(Queue, "_get_df", staticmethod(no_table))
    for i in range(500):
        queue.event_analytics[f"e{i}"] = entry("success")
        queue.compute_analytics_summary(queue.event_analytics)  # what Gradio runs after each event
    assert len(queue.event_analytics) <= 101


def test_without_the_bound_gradio_would_build_the_table_after_each_event(monkeypatch):
    """The premise of `bound_event_log` (rtc/patches.py), checked against the installed Gradio."""
    with gr.Blocks() as demo:
        gr.Markdown("page")
    built, get_df = [], Queue._get_df
    monkeypatch.setattr(Queue, "_get_df", staticmethod(lambda entries: built.append(len(entries)) or get_df(entries)))
    demo._queue.event_analytics["e0"] = entry("success")
    demo._queue.compute_analytics_summary(demo._queue.event_analytics)
    assert built == [1]
