"""How a continuous full-duplex stream becomes the Realtime API's responses, one per agent turn
(docs/realtime.md § Turns and responses)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..frame import FRAME_SECONDS, frame_dbfs
from .conversation import Conversation
from .server_events import ResponseEvents, new_id
from .session import Dialect

log = logging.getLogger(__name__)

REQUESTED_WAIT_SECONDS = 5.0  # a response opened by response.create, before the agent speaks


def is_speech(pcm: np.ndarray, text: str, speech_dbfs: float) -> bool:
    return bool(text.strip()) or frame_dbfs(pcm) > speech_dbfs


class TurnTracker:
    """Agent frames in, Realtime events out; one per socket."""

    def __init__(self, dialect: Dialect, turn_end_seconds: float, speech_dbfs: float,
                 conversation: Conversation | None = None) -> None:
        self.dialect = dialect
        self.conversation = conversation or Conversation(dialect)
        self.end_frames = max(1, round(turn_end_seconds / FRAME_SECONDS))
        self.speech_dbfs = speech_dbfs
        self.current: ResponseEvents | None = None
        self._transcript: list[str] = []
        self._frames = 0
        self._quiet = 0  # frames since the agent last spoke
        self._spoke = False  # in the open response

    def frame(self, pcm: np.ndarray, text: str) -> list[dict[str, Any]]:
        """The events of one agent frame."""
        speech = is_speech(pcm, text, self.speech_dbfs)
        self._quiet = 0 if speech else self._quiet + 1
        events: list[dict[str, Any]] = []
        if self.current is None:
            if not speech:
                return events
            events += self._open(None)
        current = self.current
        assert current is not None
        self._spoke |= speech
        self._frames += 1
        events.append(current.audio(pcm))
        if text:
            self._transcript.append(text)
            events.append(current.transcript(text))
        waited = self._frames * FRAME_SECONDS
        if (self._spoke and self._quiet >= self.end_frames) or (not self._spoke and waited >= REQUESTED_WAIT_SECONDS):
            events += self._close("completed", None)
        return events

    def request(self, metadata: Any) -> list[dict[str, Any]]:
        """`response.create`: a response opened now, after the open one, if any, completed (each request
        gets its own: LiveKit waits for the one that echoes its metadata)."""
        events = self._close("completed", None) if self.current is not None else []
        return events + self._open(metadata)

    def cancel(self, reason: str = "client_cancelled") -> list[dict[str, Any]]:
        """The open response, if any, ends as cancelled. `reason`: the client's cancel or truncation,
        "turn_detected" when the caller began to speak, or the call's end (not "incomplete": that
        would read as a failure to the clients)."""
        return self._close("cancelled", {"type": "cancelled", "reason": reason}) if self.current is not None else []

    @property
    def open_item(self) -> str | None:
        return self.current.item_id if self.current is not None else None

    def _open(self, metadata: Any) -> list[dict[str, Any]]:
        self.current = ResponseEvents(self.dialect, new_id("resp"), new_id("item"), metadata)
        self._transcript, self._frames, self._spoke = [], 0, False
        return self.current.opening(self.conversation.add(self.current.item_id))

    def _close(self, status: str, details: dict[str, Any] | None) -> list[dict[str, Any]]:
        current, self.current = self.current, None
        assert current is not None
        return current.closing(status, "".join(self._transcript), self._frames, details)
