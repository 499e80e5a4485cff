"""The conversation as a Realtime client sees it: its items (docs/realtime.md § Conversation items; the
model keeps none, but agent frameworks wait for each item they add to be acknowledged by its id), and
the responses a continuous full-duplex stream becomes, one per agent turn (§ Turns and responses)."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from ..frame import FRAME_SECONDS, frame_dbfs
from . import errors as e
from .client_events import ClientEvent
from .errors import RealtimeError
from .server_events import ResponseEvents, event, new_id
from .session import Dialect

PERSONA_ROLES = ("system", "developer", "user")  # message items whose text, before the start, joins the persona
KEEP_IDS = 256  # item ids remembered for truncate and delete
REQUESTED_WAIT_SECONDS = 5.0  # a response opened by response.create, before the agent speaks


def item_text(item: dict[str, Any]) -> str:
    """The text of a message item's text parts (input_text, text, output_text)."""
    content = item.get("content")
    parts = content if isinstance(content, list) else []
    return "\n".join(part["text"] for part in parts if isinstance(part, dict) and isinstance(part.get("text"), str))


class Conversation:
    """The ids of the items of one socket, in order, and the events that acknowledge them."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self.last_item: str | None = None
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, item_id: str) -> str | None:
        """Note a new last item; the one before it."""
        previous, self.last_item = self.last_item, item_id
        self._ids[item_id] = None
        while len(self._ids) > KEEP_IDS:
            self._ids.popitem(last=False)
        return previous

    def added(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """`conversation.item.added` + `.done` (beta: `.created`) for an item now in the conversation."""
        previous = self.add(item["id"])
        if self.dialect is Dialect.BETA:
            return [event("conversation.item.created", previous_item_id=previous, item=item)]
        return [event("conversation.item.added", previous_item_id=previous, item=item),
                event("conversation.item.done", previous_item_id=previous, item=item)]

    def create(self, ev: ClientEvent) -> tuple[list[dict[str, Any]], str | None]:
        """`conversation.item.create`: the acknowledging events, and the text that would join the
        persona (a system, developer or user message's), else None."""
        item = ev.body.get("item")
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise RealtimeError(e.MISSING_FIELD, "conversation.item.create needs an \"item\" object with a \"type\"",
                                param="item", event_id=ev.event_id)
        item_id = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else new_id("item")
        echoed = {**item, "id": item_id, "object": "realtime.item", "status": "completed"}
        if item.get("role") == "developer":
            echoed["role"] = "system"  # the Realtime API's roles; a developer message is a system one there
        text = item_text(item) if item["type"] == "message" and item.get("role") in PERSONA_ROLES else None
        return self.added(echoed), (text or None)

    def user_audio(self, item_id: str) -> list[dict[str, Any]]:
        """What the caller said between a speech start and stop, as the server-VAD flow shows it: the
        buffer committed into a user item (no transcript: the model does not transcribe the caller)."""
        previous = self.last_item
        item = {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed", "role": "user",
                "content": [{"type": "input_audio", "transcript": None}]}
        return [event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id),
                *self.added(item)]

    def truncate(self, ev: ClientEvent) -> dict[str, Any]:
        item_id = self._known_item(ev)
        where = {name: value if isinstance(value := ev.body.get(name), int) else 0
                 for name in ("content_index", "audio_end_ms")}
        return event("conversation.item.truncated", item_id=item_id, **where)

    def delete(self, ev: ClientEvent) -> dict[str, Any]:
        item_id = self._known_item(ev)
        self._ids.pop(item_id, None)
        return event("conversation.item.deleted", item_id=item_id)

    def _known_item(self, ev: ClientEvent) -> str:
        """The event's `item_id`, one of this conversation's; invalid_field otherwise."""
        item_id = ev.body.get("item_id")
        if not isinstance(item_id, str) or item_id not in self._ids:
            raise RealtimeError(e.INVALID_FIELD, f"{ev.type}: no item {item_id!r} in this conversation",
                                param="item_id", event_id=ev.event_id)
        return item_id


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

    def _open(self, metadata: Any) -> list[dict[str, Any]]:
        self.current = ResponseEvents(self.dialect, new_id("resp"), new_id("item"), metadata)
        self._transcript, self._frames, self._spoke = [], 0, False
        return self.current.opening(self.conversation.add(self.current.item_id))

    def _close(self, status: str, details: dict[str, Any] | None) -> list[dict[str, Any]]:
        current, self.current = self.current, None
        assert current is not None
        return current.closing(status, "".join(self._transcript), self._frames, details)
