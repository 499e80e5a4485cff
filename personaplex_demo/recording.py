"""Per-call recording: a stereo WAV (caller left, agent right) and the transcript, for download."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf

SAMPLE_RATE = 24000
MAX_SECONDS = 15 * 60  # a recording stops growing after this (a call cannot hold memory forever)


@dataclass
class CallRecording:
    call_id: str
    voice: str
    persona: str
    started: float = field(default_factory=time.time)
    _caller: list[np.ndarray] = field(default_factory=list)
    _agent: list[np.ndarray] = field(default_factory=list)
    _frames: list[dict] = field(default_factory=list)
    _n_agent: int = 0
    _n_caller: int = 0

    def add_caller(self, pcm: np.ndarray) -> None:
        if self._n_caller < MAX_SECONDS * SAMPLE_RATE:
            self._caller.append(np.asarray(pcm, np.float32).reshape(-1))
            self._n_caller += pcm.size

    def add_agent(self, pcm: np.ndarray, text: str) -> None:
        if self._n_agent >= MAX_SECONDS * SAMPLE_RATE:
            return
        if text:
            t = self._n_agent / SAMPLE_RATE
            self._frames.append({"start_s": round(t, 3), "end_s": round(t + 0.08, 3), "text": text})
        self._agent.append(np.asarray(pcm, np.float32).reshape(-1))
        self._n_agent += pcm.size

    @property
    def transcript(self) -> str:
        return "".join(f["text"] for f in self._frames)

    def save(self, directory: Path) -> tuple[Path, Path]:
        caller = np.concatenate(self._caller) if self._caller else np.zeros(0, np.float32)
        agent = np.concatenate(self._agent) if self._agent else np.zeros(0, np.float32)
        n = max(caller.size, agent.size)
        stereo = np.zeros((n, 2), np.float32)
        stereo[: caller.size, 0] = caller
        stereo[: agent.size, 1] = agent
        directory.mkdir(parents=True, exist_ok=True)
        wav = directory / f"call-{self.call_id}.wav"
        sf.write(wav, np.clip(stereo, -1, 1), SAMPLE_RATE, subtype="PCM_16")
        js = directory / f"call-{self.call_id}.json"
        js.write_text(json.dumps({"voice": self.voice, "persona": self.persona, "started": self.started,
                                  "sample_rate": SAMPLE_RATE, "text": self.transcript, "frames": self._frames},
                                 indent=1))
        return wav, js


class RecordingStore:
    """Finished recordings by call id; the oldest are deleted beyond `keep`."""

    def __init__(self, directory: Path | None = None, keep: int = 64):
        self.directory = directory or Path(tempfile.mkdtemp(prefix="personaplex-calls-"))
        self.keep = keep
        self._files: dict[str, tuple[Path, Path]] = {}
        self._lock = threading.Lock()

    def save(self, rec: CallRecording) -> tuple[Path, Path]:
        files = rec.save(self.directory)
        with self._lock:
            self._files[rec.call_id] = files
            while len(self._files) > self.keep:
                old = self._files.pop(next(iter(self._files)))
                for p in old:
                    p.unlink(missing_ok=True)
        return files

    def get(self, call_id: str) -> tuple[Path, Path] | None:
        with self._lock:
            return self._files.get(call_id)
