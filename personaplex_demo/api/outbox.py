"""What waits to be sent to a Realtime client, and how much of it the client has not read.

The writer task sends these events in order. A client that stops reading is noticed by what
waits for it: this queue, and the bytes the kernel holds for the connection (a send blocks only
once the kernel's buffer, megabytes on a fast link, is full).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any

from ..frame import FRAME_SECONDS
from .send_queue import kernel_send_queue

AUDIO_EVENTS = {"response.output_audio.delta", "response.audio.delta", "session.output_audio.delta"}
AUDIO_EVENT_BYTES = 5300  # one audio delta as JSON: 80 ms of PCM16 in base64, with its ids
CHECK_SECONDS = 1.0


class Outbox:
    """Events waiting for the writer, as JSON text (or binary messages, for a protocol of bytes);
    counts the audio frames among them. `frame_bytes`: what one frame of audio weighs on the wire,
    to read the kernel's queue in frames."""

    def __init__(self, frame_bytes: int = AUDIO_EVENT_BYTES) -> None:
        self.frame_bytes = frame_bytes
        self._items: collections.deque[tuple[str | bytes, bool]] = collections.deque()
        self._ready = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self.audio_frames = 0
        self._checked_at = time.monotonic()

    def put(self, ev: dict[str, Any] | str | bytes, audio: bool = False) -> None:
        """A JSON event (an audio delta is counted as audio), or a text or binary message (`audio` says)."""
        if isinstance(ev, dict):
            audio = ev["type"] in AUDIO_EVENTS
            self._items.append((json.dumps(ev, separators=(",", ":")), audio))
        else:
            self._items.append((ev, audio))
        self.audio_frames += audio
        self._ready.set()
        self._empty.clear()

    async def get(self) -> tuple[str | bytes, bool]:
        while not self._items:
            self._ready.clear()
            self._empty.set()
            await self._ready.wait()
        return self._items.popleft()

    def sent(self, audio: bool) -> None:
        self.audio_frames -= audio

    async def drained(self) -> None:
        await self._empty.wait()

    def client_stopped_reading(self, scope: dict[str, Any], limit_seconds: float) -> bool:
        """Once a second: whether more than `limit_seconds` of agent audio wait for the client."""
        now = time.monotonic()
        if now - self._checked_at < CHECK_SECONDS:
            return False
        self._checked_at = now
        return self.unread_seconds(scope) > limit_seconds

    def unread_seconds(self, scope: dict[str, Any]) -> float:
        """Agent audio queued here or sent and not read: this queue, and what the kernel holds for
        the connection (api/send_queue.py)."""
        kernel = kernel_send_queue(scope.get("server"), scope.get("client")) or 0
        return (self.audio_frames + kernel / self.frame_bytes) * FRAME_SECONDS
