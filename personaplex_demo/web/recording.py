"""Per-call recordings for the page's download buttons: `<name>.wav` (16-bit stereo at 24 kHz, caller LEFT,
agent RIGHT) and `<name>.json` (docs/transcripts.md § Transcripts). While a call runs its audio streams to two
raw files, so memory stays flat; recordings hold the caller's voice, so they go after `max_age_seconds`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..frame import FRAME_SAMPLES, SAMPLE_RATE

logger = logging.getLogger(__name__)

_CHUNK_SAMPLES = SAMPLE_RATE * 10  # interleave 10 s at a time when writing the WAV
_WRITE_BUFFER_BYTES = SAMPLE_RATE * 2 * 4  # 4 s of int16 audio per track
RECORDINGS_PREFIX = "personaplex-calls-"
LEGACY_MAX_AGE_SECONDS = 3600.0  # folders named without a pid are removed once untouched this long
_OWNED = re.compile(re.escape(RECORDINGS_PREFIX) + r"(\d+)-")


def recordings_prefix() -> str:
    """The name prefix of this process's recordings folder."""
    return f"{RECORDINGS_PREFIX}{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_recordings(tmpdir: str | Path | None = None) -> list[Path]:
    """Delete recordings folders whose process has exited (a reused pid's waits for the next start);
    folders named without a pid go once untouched for an hour. Returns what was removed."""
    root = Path(tmpdir) if tmpdir is not None else Path(tempfile.gettempdir())
    now = time.time()
    removed = []
    for path in root.glob(f"{RECORDINGS_PREFIX}*"):
        try:
            if not path.is_dir() or path.is_symlink():
                continue
            owner = _OWNED.match(path.name)
            if owner is not None:
                if int(owner.group(1)) == os.getpid() or _alive(int(owner.group(1))):
                    continue
            elif now - path.stat().st_mtime < LEGACY_MAX_AGE_SECONDS:
                continue
        except OSError:
            continue  # gone meanwhile, or not ours to read
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    if removed:
        logger.info("removed %d recordings folder(s) left by exited processes", len(removed))
    return removed


class RecordingFiles(NamedTuple):
    wav: Path
    transcript: Path


def _to_int16(samples: np.ndarray) -> np.ndarray:
    arr = np.asarray(samples).reshape(-1)
    if arr.dtype == np.int16:
        return arr
    return (np.clip(arr.astype(np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


@dataclass
class CallRecording:
    """One call's audio and transcript. Thread-safe; every method is cheap except `finish`."""

    directory: Path
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._caller_path = self.directory / "caller.raw"
        self._agent_path = self.directory / "agent.raw"
        # A few seconds of audio per write instead of a system call per 80 ms frame.
        self._caller = open(self._caller_path, "wb", buffering=_WRITE_BUFFER_BYTES)  # noqa: SIM115 - closed in finish()
        self._agent = open(self._agent_path, "wb", buffering=_WRITE_BUFFER_BYTES)  # noqa: SIM115
        self._caller_samples = 0
        self._agent_samples = 0
        self._segments: list[dict[str, Any]] = []
        self._started_at = time.time()
        self._finished = threading.Event()
        self.files: RecordingFiles | None = None  # once `finish` wrote them

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def add_caller(self, samples: np.ndarray) -> None:
        data = _to_int16(samples)
        with self._lock:
            if self._caller.closed:
                return
            self._caller.write(data.tobytes())
            self._caller_samples += data.size

    def add_agent(self, samples: np.ndarray, text: str = "") -> None:
        """Agent audio, and the transcript text that became final with it."""
        data = _to_int16(samples)
        with self._lock:
            if self._agent.closed:
                return
            if text:
                start = self._agent_samples / SAMPLE_RATE
                self._segments.append({"frame": self._agent_samples // FRAME_SAMPLES, "start_s": round(start, 3),
                                       "end_s": round(start + data.size / SAMPLE_RATE, 3), "text": text})
            self._agent.write(data.tobytes())
            self._agent_samples += data.size

    def _close_tracks(self) -> bool:
        """Close the tracks, once: False (after waiting for it) where `finish` or `abandon` came first."""
        with self._lock:
            if first := not self._caller.closed:
                self._caller.close()
                self._agent.close()
        if not first:
            self._finished.wait(60)
        return first

    def abandon(self) -> None:
        """Close the tracks without writing any file; if `finish` is already writing, wait for it.
        A later `finish` writes nothing."""
        if self._close_tracks():
            self._finished.set()

    def finish(self, end_reason: str | None = None) -> RecordingFiles | None:
        """Close the tracks and write the WAV and the JSON. Idempotent; returns None if nothing was
        recorded (the call never went live)."""
        if not self._close_tracks():  # another thread wrote the files
            return self.files
        with self._lock:
            caller_n, agent_n, segments = self._caller_samples, self._agent_samples, list(self._segments)
        try:
            if caller_n == 0 and agent_n == 0:
                return None
            wav_path = self.directory / f"{self.directory.name}.wav"
            self._write_wav(wav_path, caller_n, agent_n)
            json_path = self.directory / f"{self.directory.name}.json"
            payload = {
                **self.meta,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self._started_at)),
                "duration_seconds": round(max(caller_n, agent_n) / SAMPLE_RATE, 3),
                "end_reason": end_reason,
                "channels": {"left": "caller", "right": "agent"},
                "sample_rate": SAMPLE_RATE,
                "text": "".join(s["text"] for s in segments),
                "segments": segments,
            }
            json_path.write_text(json.dumps(payload, ensure_ascii=False, indent=2), encoding="utf-8")
            self.files = RecordingFiles(wav_path, json_path)
            return self.files
        except OSError:
            logger.exception("could not write the recording in %s", self.directory)
            return None
        finally:
            for raw in (self._caller_path, self._agent_path):
                raw.unlink(missing_ok=True)
            self._finished.set()

    def _write_wav(self, path: Path, caller_n: int, agent_n: int) -> None:
        total = max(caller_n, agent_n)
        with open(self._caller_path, "rb") as left, open(self._agent_path, "rb") as right, \
                wave.open(str(path), "wb") as out:
            out.setnchannels(2)
            out.setsampwidth(2)
            out.setframerate(SAMPLE_RATE)
            for _ in range(0, total, _CHUNK_SAMPLES):
                a = np.frombuffer(left.read(_CHUNK_SAMPLES * 2), dtype=np.int16)
                b = np.frombuffer(right.read(_CHUNK_SAMPLES * 2), dtype=np.int16)
                n = max(a.size, b.size)
                frame = np.zeros((n, 2), dtype=np.int16)  # the shorter track is padded with silence
                frame[: a.size, 0] = a
                frame[: b.size, 1] = b
                out.writeframes(frame.tobytes())

    def finish_soon(self, end_reason: str, meta: dict) -> asyncio.Future | None:
        """Add `meta` and `finish`, off the running event loop if there is one (writing the WAV of a long
        call takes a moment): the executor's future, or None where it finished here or before."""
        if self.finished:
            return None
        self.meta.update(meta)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.finish(end_reason)
            return None
        return loop.run_in_executor(None, self.finish, end_reason)

    async def wait_finished(self, timeout: float) -> RecordingFiles | None:
        """Wait (without blocking the event loop) until `finish` has run; its files, or None."""
        deadline = time.monotonic() + timeout
        while not self._finished.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.files


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class RecordingStore:
    """Recordings by connection id, in one temporary directory that is pruned as calls come in."""

    max_age_seconds = 3600.0
    max_recordings = 256  # beyond this, the oldest finished recordings go first

    def __init__(self, root: Path | str | None = None) -> None:
        # The pid in the name lets the next start tell a crashed app's folder from a running one's.
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix=recordings_prefix()))
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._recordings: dict[str, tuple[float, CallRecording]] = {}

    def start(self, key: str, meta: dict[str, Any] | None = None) -> CallRecording:
        """A new recording for connection `key` (replacing an older one of the same key)."""
        self.prune()
        name = f"personaplex-{time.strftime('%Y%m%d-%H%M%S')}-{_SAFE.sub('_', key)[:40]}"
        recording = CallRecording(self.root / name, dict(meta or {}))
        with self._lock:
            old = self._recordings.pop(key, None)
            self._recordings[key] = (time.monotonic(), recording)
        if old is not None:
            shutil.rmtree(old[1].directory, ignore_errors=True)
        return recording

    def get(self, key: str) -> CallRecording | None:
        with self._lock:
            entry = self._recordings.get(key)
        return entry[1] if entry else None

    def prune(self) -> None:
        now = time.monotonic()
        with self._lock:
            by_age = sorted(self._recordings.items(), key=lambda kv: kv[1][0])
            doomed = [k for k, (t, rec) in by_age if rec.finished and now - t > self.max_age_seconds]
            finished = [k for k, (_, rec) in by_age if rec.finished and k not in doomed]
            excess = len(self._recordings) - len(doomed) - self.max_recordings + 1
            doomed += finished[: max(0, excess)]
            removed = [self._recordings.pop(k)[1] for k in doomed]
        for rec in removed:
            shutil.rmtree(rec.directory, ignore_errors=True)

    def close(self) -> None:
        """Delete every recording and the directory (the app calls this on exit). A recording still
        being written is waited for, so that no file lands in the folder after it is gone."""
        with self._lock:
            recordings = [rec for _, rec in self._recordings.values()]
            self._recordings.clear()
        for rec in recordings:
            rec.abandon()
        shutil.rmtree(self.root, ignore_errors=True)
