"""The Realtime door's errors: each becomes one `error` event with a specific code, and the socket
stays open unless the code says otherwise. The codes and their meaning: docs/realtime.md § Errors."""

from __future__ import annotations

from typing import Any


class RealtimeError(Exception):
    """A client event the door cannot take: `code` says which rule, `message` what to do."""

    def __init__(self, code: str, message: str, *, param: str | None = None, event_id: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.param, self.event_id, self.kind = code, message, param, event_id, kind

    def as_error(self, id_name: str = "event_id") -> dict[str, Any]:
        """The `error` field of the event, as OpenAI's servers shape it (GPT-Live: `client_event_id`)."""
        return {"type": self.kind, "code": self.code, "message": self.message, "param": self.param,
                id_name: self.event_id}


# The codes, one per rule, so that a client can match on them.
INVALID_JSON = "invalid_json"  # not JSON, or not a JSON object
BINARY_MESSAGE = "binary_message_unsupported"  # events are JSON text frames
MESSAGE_TOO_LARGE = "message_too_large"
MISSING_FIELD = "missing_field"
INVALID_FIELD = "invalid_field"  # a field of the wrong type or out of range
UNKNOWN_EVENT = "unknown_event"
UNSUPPORTED_EVENT = "unsupported_event"  # a Realtime event this model has no counterpart for
INVALID_BASE64 = "invalid_base64"
ODD_BYTE_COUNT = "odd_byte_count"  # PCM16 is two bytes a sample
UNSUPPORTED_AUDIO_FORMAT = "unsupported_audio_format"
UNSUPPORTED_MODALITIES = "unsupported_modalities"
UNKNOWN_VOICE = "unknown_voice"
PERSONA_TOO_LONG = "persona_too_long"
INVALID_SAMPLING = "invalid_sampling"
INPUT_BUFFER_FULL = "input_audio_buffer_full"  # audio ahead of real time beyond the bound
INTERNAL_ERROR = "internal_error"  # the server failed on an event (logged); the socket goes on
NO_SESSION = "no_session"  # a socket that never started a call is closed after a while
SESSION_NOT_STARTED = "session_not_started"  # GPT-Live: an event that needs session.start first
SESSION_ALREADY_STARTED = "session_already_started"  # GPT-Live: one session.start per socket
ROOM_FULL = "room_full"
ROOM_CLOSED = "room_closed"
CALL_ENDED = "call_ended"
