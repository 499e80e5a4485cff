"""The conversation's items as a Realtime client sees them (docs/realtime.md § Conversation items).
The model keeps no editable conversation, but agent frameworks wait for the server to acknowledge
each item they add, by its id: so the door keeps the ids in order and answers every item event.
"""

from __future__ import annotations

import collections
from typing import Any

from . import errors as e
from .client_events import ClientEvent
from .errors import RealtimeError
from .server_events import event, new_id
from .session import Dialect

PERSONA_ROLES = ("system", "developer", "user")  # message items whose text, before the start, joins the persona
KEEP_IDS = 256  # item ids remembered for truncate and delete


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
        audio_end_ms = ev.body.get("audio_end_ms")
        return event("conversation.item.truncated", item_id=item_id,
                     content_index=ev.body.get("content_index") if isinstance(ev.body.get("content_index"), int) else 0,
                     audio_end_ms=audio_end_ms if isinstance(audio_end_ms, int) else 0)

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
