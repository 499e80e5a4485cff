"""Start and stop: stale recordings removed at start; SIGTERM and SIGINT end calls and exit 0 in 10 s."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import websockets

from personaplex_demo.cli.lifecycle import StopSignals, shut_down
from personaplex_demo.web.recording import (
    LEGACY_MAX_AGE_SECONDS,
    RecordingStore,
    recordings_prefix,
    remove_stale_recordings,
)

from .browser_support import (
    ARTIFACTS,
    RECORD_PCS,
    ROOT,
    chromium,
    launched_app,
    make_mic_wav,
    missing_tools,
    require,
    start_call,
    wait_for,
)


def dead_pid() -> int:
    """The pid of a process that has exited (reaped, so the number is free)."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_stale_recordings_are_removed_and_live_ones_kept(tmp_path):
    gone = tmp_path / f"personaplex-calls-{dead_pid()}-abc"
    mine = tmp_path / f"{recordings_prefix()}mine"
    parent = tmp_path / f"personaplex-calls-{os.getppid()}-xyz"  # another app, still running
    old_legacy = tmp_path / "personaplex-calls-k3j4h5"  # no pid: from an older version
    new_legacy = tmp_path / "personaplex-calls-q9w8e7"
    other = tmp_path / "personaplex-callsign"
    for folder in (gone, mine, parent, old_legacy, new_legacy, other):
        (folder / "rec").mkdir(parents=True)
    a_file = tmp_path / "personaplex-calls-1-file"
    a_file.write_text("not a folder")
    past = time.time() - LEGACY_MAX_AGE_SECONDS - 60
    os.utime(old_legacy, (past, past))
    removed = remove_stale_recordings(tmp_path)
    assert sorted(removed) == sorted([gone, old_legacy])
    assert not gone.exists() and not old_legacy.exists()
    assert mine.exists() and parent.exists() and new_legacy.exists() and other.exists() and a_file.exists()


def test_a_store_names_its_folder_after_the_process():
    store = RecordingStore()
    try:
        assert store.root.name.startswith(f"personaplex-calls-{os.getpid()}-")
    finally:
        store.close()
    assert not store.root.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signals_wake_the_main_thread_instead_of_killing_it(sig):
    saved = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    stop = StopSignals()
    try:
        stop.install()
        os.kill(os.getpid(), sig)
        assert stop.wait() == signal.Signals(sig).name
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_shutdown_steps_run_in_order_past_a_failure():
    done = []

    def fail():
        raise RuntimeError("boom")

    shut_down([("a", lambda: done.append("a")), ("b", fail), ("c", lambda: done.append("c"))],
              deadline_seconds=30)
    assert done == ["a", "c"]


def test_a_hung_shutdown_step_still_exits_0_in_time(tmp_path):
    marker = tmp_path / "cleaned"
    code = ("import time; from pathlib import Path; from personaplex_demo.cli.lifecycle import shut_down; "
            f"shut_down([('hang', lambda: time.sleep(60))], deadline_seconds=1.0, "
            f"on_timeout=lambda: Path({str(marker)!r}).write_text('yes'))")
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - began < 20 and marker.read_text() == "yes"
    assert "clean shutdown took more than 1 s; exiting now" in proc.stderr


# ---- the launched app -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mic_wav(tmp_path_factory):
    require(missing_tools())
    return make_mic_wav(tmp_path_factory.mktemp("mic"))


@pytest.mark.browser
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_live_calls_with_a_message_cleans_up_and_exits_0(sig, mic_wav, tiny_cache_dir, tmp_path):
    name = signal.Signals(sig).name
    tmpdir = tmp_path / "app" / "tmp"
    tmpdir.mkdir(parents=True)
    crashed = tmpdir / f"personaplex-calls-{dead_pid()}-crashed"  # left by an app that was killed
    running = tmpdir / f"personaplex-calls-{os.getpid()}-running"  # another live app's
    for folder in (crashed, running):
        (folder / "personaplex-x").mkdir(parents=True)
    with launched_app(tmp_path / "app", tiny_cache_dir, args=["--slots", "1"]) as app, \
            chromium(tmp_path / "udd", mic_wav) as ctx:
        assert not crashed.exists() and running.exists()  # the start removed only the crashed app's folder
        own = app.recordings_folders()
        assert len(own) == 1
        page = ctx.new_page()
        page.add_init_script(RECORD_PCS)
        page.goto(app.base_url + "/", wait_until="networkidle")
        start_call(page)
        page.wait_for_function("document.querySelector('#status-line').innerText.startsWith('Live')",
                               timeout=15_000)
        wait_for(lambda: any(own[0].iterdir()), 5, "the call's recording was not started")
        seconds = app.stop(sig)
        assert app.proc.returncode == 0, app.log_text()[-3000:]
        assert seconds < 10, f"{name} took {seconds:.1f} s"
        # The caller is told why the call ended, on the page and in a toast.
        page.wait_for_function("document.querySelector('#status-line').innerText.includes('restarting')",
                               timeout=5_000)
        assert "The server is restarting" in " ".join(page.locator(".toast-body").all_inner_texts())
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"browser-{name.lower()}.png"), full_page=True)
    log = app.log_text()
    assert f"{name}: ending 1 call(s) with a message" in log and "delete the recordings" in log
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
    assert "content_type" not in log  # Gradio's print for the page's offer, a DEBUG record now
    assert not own[0].exists() and running.exists()
    Path(running, "personaplex-x").rmdir()
    running.rmdir()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_is_a_quiet_stop(sig, tiny_cache_dir, tmp_path):
    """A terminal's Ctrl-C, a container's stop or a service manager signals every process of the
    app at once (its media worker and engine process too): the caller is still told why, the app
    exits 0, no replacement worker starts, and the log has no ERROR and no traceback."""
    with launched_app(tmp_path, tiny_cache_dir, own_group=True) as app:
        ended = asyncio.run_coroutine_threadsafe(realtime_call_until_it_ends(app), background_loop())
        wait_for(lambda: app.status()["slots_live"] == 1, 30, "the socket's call live")
        seconds = app.stop(sig, group=True)
        code, reason = ended.result(10)
        assert app.proc.returncode == 0 and seconds < 10, app.log_text()[-3000:]
    assert code == 1001 and "restarting" in reason
    log = app.log_text()
    assert f"{signal.Signals(sig).name}: ending" in log
    for noise in (" ERROR ", "Traceback", "replacement", "killing it", "content_type"):
        assert noise not in log, (noise, log[-3000:])


def background_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


async def realtime_call_until_it_ends(app) -> tuple[int | None, str]:
    """A raw Realtime client that configures a persona, streams silence in real time and reads
    every event until the server closes the socket: its close code and reason."""
    url = app.base_url.replace("http", "ws", 1) + "/v1/realtime"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "You are a teacher."}}))
        silence = base64.b64encode(bytes(1920)).decode()

        async def stream() -> None:
            while True:
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
                await asyncio.sleep(0.04)

        sending = asyncio.create_task(stream())
        try:
            async for _ in ws:  # read on, so that the close frame is read as soon as it comes
                pass
        except websockets.ConnectionClosed:
            pass
        finally:
            sending.cancel()
        return ws.close_code, ws.close_reason or ""


def test_what_a_library_prints_becomes_a_log_record_and_nothing_reaches_stdout(capsys, caplog):
    import contextlib
    import logging

    from personaplex_demo.cli.app import PrintsToLog

    with caplog.at_level(logging.DEBUG, logger="print"), contextlib.redirect_stdout(PrintsToLog(logging.DEBUG)):
        print("content_type", "application/json")
        print("two\nlines", end="")
        print(" done")
        print()
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "print"] == [
        (logging.DEBUG, "content_type application/json"), (logging.DEBUG, "two"), (logging.DEBUG, "lines done")]
    assert capsys.readouterr().out == ""
