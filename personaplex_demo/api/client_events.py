"""Client events as the door reads them: JSON text in, a checked `ClientEvent` out, or a
RealtimeError with the code of the rule it broke (api/errors.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import errors as e
from .errors import RealtimeError

# Events of the Realtime API that a full-duplex speech model has no counterpart for: it keeps no
# items to hand back, and its audio goes out as it is made (docs/realtime.md).
UNSUPPORTED = {
    "conversation.item.retrieve": "items are not stored: the audio went out as it was spoken",
    "output_audio_buffer.clear": "the agent's audio is streamed as it is made; use response.cancel",
    "transcription_session.update": "this server runs a conversation model, not a transcription session",
}
# Events the door takes (docs/realtime.md § Client events).
KNOWN = ("session.update", "input_audio_buffer.append", "input_audio_buffer.clear", "input_audio_buffer.commit",
         "response.create", "response.cancel", "conversation.item.create", "conversation.item.truncate",
         "conversation.item.delete")


@dataclass(frozen=True)
class ClientEvent:
    type: str
    event_id: str | None
    body: dict[str, Any]


def parse(text: str | bytes | None, max_bytes: int, known: tuple[str, ...] = KNOWN,
          unsupported: Mapping[str, str] = UNSUPPORTED) -> ClientEvent:
    """One WebSocket message as a client event of a protocol that takes `known` and refuses
    `unsupported` (the Realtime API's by default); RealtimeError for anything the door cannot take."""
    if text is None or isinstance(text, bytes):
        raise RealtimeError(e.BINARY_MESSAGE, "send each event as a JSON text message, not binary")
    size = len(text) if len(text) > max_bytes or len(text) * 4 <= max_bytes else len(text.encode("utf-8", "replace"))
    if size > max_bytes:
        raise RealtimeError(e.MESSAGE_TOO_LARGE, f"an event may be at most {max_bytes} bytes, this one has "
                            f"{size}; send audio in smaller appends")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise RealtimeError(e.INVALID_JSON, f"the event is not valid JSON: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise RealtimeError(e.INVALID_JSON, f"an event must be a JSON object, got {type(body).__name__}")
    event_id = body.get("event_id") if isinstance(body.get("event_id"), str) else None
    kind = body.get("type")
    if not isinstance(kind, str) or not kind:
        raise RealtimeError(e.MISSING_FIELD, "the event has no \"type\"", param="type", event_id=event_id)
    if kind in unsupported:
        raise RealtimeError(e.UNSUPPORTED_EVENT, f"{kind} is not supported: {unsupported[kind]}",
                            param="type", event_id=event_id)
    if kind not in known:
        raise RealtimeError(e.UNKNOWN_EVENT, f"unknown event type {kind!r}; this server takes {', '.join(known)}",
                            param="type", event_id=event_id)
    return ClientEvent(kind, event_id, body)


def field(event: ClientEvent, name: str, kind: type) -> Any:
    """`event.body[name]`, checked to be of `kind` (missing_field when absent or null)."""
    if event.body.get(name) is None:
        raise RealtimeError(e.MISSING_FIELD, f"{event.type} needs \"{name}\"", param=name,
                            event_id=event.event_id)
    return typed(event.body[name], kind, name, event.event_id, where=f"\"{name}\" of {event.type}")


def typed(value: Any, kind: type, param: str, event_id: str | None, where: str | None = None) -> Any:
    """`value` checked to be of `kind`, or invalid_field naming `where` (default: `param`). A whole
    number where a float is wanted becomes one; a bool is never taken for a number."""
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            ok, value = True, float(value)
        except OverflowError:
            ok = False
    if not ok:
        raise RealtimeError(e.INVALID_FIELD, f"{where or param} must be {kind.__name__}, got {type(value).__name__}",
                            param=param, event_id=event_id)
    return value
