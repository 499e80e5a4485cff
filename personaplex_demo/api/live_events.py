"""OpenAI's GPT-Live events as the GPT-Live door reads and writes them (docs/realtime.md § GPT-Live).
`session.start` is read through the Realtime door's rules, so both doors judge a voice, a persona or a
format alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..frame import SAMPLE_RATE
from . import errors as e
from .client_events import ClientEvent, typed
from .errors import RealtimeError
from .server_events import event
from .session import PromptRules, SessionSettings, apply_update, join_persona

# The client events the door takes; what each does: docs/realtime.md § GPT-Live.
KNOWN = ("session.start", "session.update", "session.input_audio.append", "session.input_audio.mute",
         "session.input_audio.unmute", "session.commentary.append", "session.thinking.append",
         "session.instructions.append", "response.item.create", "response.create", "session.close")
TEXT_APPENDS = {"session.commentary.append": "session.commentary.appended",
                "session.thinking.append": "session.thinking.appended",
                "session.instructions.append": "session.instructions.appended"}
# What a session.start may hold that this model has no use for: accepted, ignored, named back.
IGNORED = ("model", "delegation", "store", "tools", "tool_choice", "context_management")
PERSONA_ROLES = ("system", "developer")  # `input` messages that become part of the persona


def _input_texts(items: Any, event_id: str | None) -> tuple[list[str], int]:
    """The text of the `input` messages that join the persona, and how many others were ignored
    (the model hears no text turns: user and assistant messages cannot be played into it)."""
    if items is None:
        return [], 0
    if not isinstance(items, list):
        raise RealtimeError(e.INVALID_FIELD, "session.input must be a list of messages", param="session.input",
                            event_id=event_id)
    texts, ignored = [], 0
    for item in items:
        if not isinstance(item, dict) or item.get("role") not in PERSONA_ROLES:
            ignored += 1
            continue
        content = item.get("content")
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        texts += [part if isinstance(part, str) else str(part.get("text", "")) for part in parts
                  if isinstance(part, str) or (isinstance(part, dict) and isinstance(part.get("text"), str))]
    return [text for text in texts if text.strip()], ignored


def start_settings(session: Any, rules: PromptRules, event_id: str | None) -> SessionSettings:
    """The call's settings from a `session.start`'s session object, or RealtimeError."""
    if not isinstance(session, dict):
        raise RealtimeError(e.MISSING_FIELD, "session.start needs a \"session\" object", param="session",
                            event_id=event_id)
    audio = session.get("audio") if isinstance(session.get("audio"), dict) else {}
    audio_out = audio.get("output") if isinstance(audio.get("output"), dict) else {}
    voice = audio_out.get("voice")
    voice = voice.get("id") if isinstance(voice, dict) else voice
    texts, ignored_input = _input_texts(session.get("input"), event_id)
    instructions = session.get("instructions")
    if texts:
        base = typed(instructions, str, "session.instructions", event_id) if instructions is not None else ""
        instructions = join_persona(base, *texts)
    # The Realtime API's (current) session shape, read by the same rules.
    realtime = {"instructions": instructions, "personaplex": session.get("personaplex"),
                "audio": {"input": {"format": audio.get("format")},
                          "output": {"format": audio.get("format"), "voice": voice}}}
    settings = apply_update(SessionSettings(), realtime, rules, started=False, event_id=event_id)
    ignored = tuple(name for name in IGNORED if session.get(name) not in (None, [], "", {}))
    return dataclasses.replace(settings, ignored=settings.ignored + ignored + (("input",) if ignored_input else ()))


def session_resource(settings: SessionSettings, session_id: str, model: str, status: str) -> dict[str, Any]:
    """The session as `session.started`, `session.updated` and `session.closed` show it."""
    return {"id": session_id, "object": "live.session", "status": status, "model": model,
            "instructions": settings.persona,
            "audio": {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE}, "output": {"voice": settings.voice}},
            "delegation": None, "personaplex": {"ignored": list(settings.ignored),
                                                "room_events": settings.room_events}}


def answer(kind: str, ev: ClientEvent, **fields: Any) -> dict[str, Any]:
    """A server event that answers client event `ev` (its id echoed as `client_event_id`)."""
    return event(kind, client_event_id=ev.event_id, **fields)


def error_event(err: RealtimeError) -> dict[str, Any]:
    return event("error", client_event_id=err.event_id,
                 error={"type": err.kind, "code": err.code, "message": err.message, "param": err.param,
                        "client_event_id": err.event_id})
