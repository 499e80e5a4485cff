"""What waits to be sent to an API client, and how much of it the client has not read. Linux grows a
socket's send buffer to megabytes for a client that stopped reading, so the door also asks the kernel:
/proc/net/tcp(6) `tx_queue` (proc(5)). Elsewhere than Linux it goes by its own queue alone."""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import json
import time
from pathlib import Path
from typing import Any

from ..frame import FRAME_SECONDS

AUDIO_EVENTS = {"response.output_audio.delta", "response.audio.delta", "session.output_audio.delta"}
AUDIO_EVENT_BYTES = 5300  # one audio delta as JSON: 80 ms of PCM16 in base64, with its ids
CHECK_SECONDS = 1.0
TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


class Outbox:
    """Messages waiting for the writer; counts the audio frames among them. `frame_bytes`: what one
    frame of audio weighs on the wire, to read the kernel's queue in frames."""

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
        """Once a second: whether more than `limit_seconds` of agent audio wait for the client,
        queued here or held by the kernel."""
        now = time.monotonic()
        if now - self._checked_at < CHECK_SECONDS:
            return False
        self._checked_at = now
        kernel = kernel_send_queue(scope.get("server"), scope.get("client")) or 0
        return (self.audio_frames + kernel / self.frame_bytes) * FRAME_SECONDS > limit_seconds


def proc_address(host: str, port: int) -> str:
    """An address as /proc/net/tcp writes it: the address in 32-bit words of host byte order
    (little-endian here), then the port, in upper-case hex."""
    packed = ipaddress.ip_address(host.split("%")[0]).packed
    words = "".join(packed[i:i + 4][::-1].hex() for i in range(0, len(packed), 4))
    return f"{words.upper()}:{port:04X}"


def kernel_send_queue(local: tuple[str, int] | None, remote: tuple[str, int] | None) -> int | None:
    """Bytes queued in the kernel for the connection `local` -> `remote` (the ASGI scope's two
    addresses); None if unknown."""
    if local is None or remote is None:
        return None
    try:
        ends = (proc_address(*local), proc_address(*remote))
    except ValueError:  # not an IP address (a Unix socket, a test client)
        return None
    for table in TCP_TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 4 and (fields[1], fields[2]) == ends:
                return int(fields[4].split(":")[0], 16)
    return None
