"""Recordings: nothing is written into the store's folder once it is closed."""

from __future__ import annotations

import threading
import time

import numpy as np

from personaplex_demo.web.recording import CallRecording, RecordingStore


def recorded(store: RecordingStore, seconds: float = 2.0):
    rec = store.start("caller", {"voice": "NATF2"})
    tone = (3000 * np.sin(np.arange(int(24000 * seconds)) / 10)).astype(np.int16)
    for chunk in np.split(tone, int(seconds * 12.5)):
        rec.add_caller(chunk)
        rec.add_agent(chunk, "hi ")
    return rec


def test_a_finish_after_the_store_closed_writes_nothing(tmp_path):
    store = RecordingStore(tmp_path / "calls")
    rec = recorded(store)
    store.close()
    assert rec.finish("hangup") is None
    assert not (tmp_path / "calls").exists()


def test_closing_the_store_waits_for_a_recording_being_written(tmp_path, monkeypatch):
    # The hang-up writes its recording in an executor thread while the app may be closing the store:
    # the close waits for that write (which succeeds), then removes everything.
    writing = threading.Event()
    write_wav = CallRecording._write_wav

    def slow_write_wav(self, *args):
        writing.set()
        time.sleep(0.3)
        write_wav(self, *args)

    monkeypatch.setattr(CallRecording, "_write_wav", slow_write_wav)
    store = RecordingStore(tmp_path / "calls")
    rec = recorded(store)
    results = []
    writer = threading.Thread(target=lambda: results.append(rec.finish("hangup")))
    writer.start()
    assert writing.wait(5)
    store.close()
    assert not writer.is_alive()  # close returned only after the write
    assert results and results[0] is not None  # the write was not cut off by the close
    assert not (tmp_path / "calls").exists()


def test_a_finished_recording_has_its_files(tmp_path):
    store = RecordingStore(tmp_path / "calls")
    files = recorded(store).finish("hangup")
    assert files is not None and files.wav.stat().st_size > 4 * 24000 and files.transcript.is_file()
    store.close()
    assert not (tmp_path / "calls").exists()
