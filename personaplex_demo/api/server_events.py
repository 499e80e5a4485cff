"""Server events as the door sends them, in the client's dialect (api/session.py `Dialect`): plain
dicts, JSON-ready, each with its own `event_id`."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np

from .feeder import to_pcm16
from .session import Dialect

# Tokens the model reads and writes per 80 ms frame: 8 Mimi codebooks each way and one text
# token (docs/model.md); `usage` counts these, so that a client's accounting adds up to time.
CODEBOOKS = 8

_NAMES = {
    Dialect.CURRENT: {"audio.delta": "response.output_audio.delta", "audio.done": "response.output_audio.done",
                      "transcript.delta": "response.output_audio_transcript.delta",
                      "transcript.done": "response.output_audio_transcript.done",
                      "item.added": "conversation.item.added", "content": "output_audio"},
    Dialect.BETA: {"audio.delta": "response.audio.delta", "audio.done": "response.audio.done",
                   "transcript.delta": "response.audio_transcript.delta",
                   "transcript.done": "response.audio_transcript.done",
                   "item.added": "conversation.item.created", "content": "audio"},
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def pcm16_base64(pcm: np.ndarray) -> str:
    """Float samples in [-1, 1] as base64 little-endian 16-bit PCM."""
    ints = to_pcm16(pcm).astype("<i2", copy=False)
    return base64.b64encode(ints.tobytes()).decode("ascii")


def usage(frames: int) -> dict[str, Any]:
    """What `frames` agent frames of one response cost in tokens (CODEBOOKS each way, one text token)."""
    heard, said, text = CODEBOOKS * frames, CODEBOOKS * frames, frames
    return {"total_tokens": heard + said + text, "input_tokens": heard, "output_tokens": said + text,
            "input_token_details": {"cached_tokens": 0, "text_tokens": 0, "audio_tokens": heard, "image_tokens": 0,
                                    "cached_tokens_details": {"text_tokens": 0, "audio_tokens": 0,
                                                              "image_tokens": 0}},
            "output_token_details": {"text_tokens": text, "audio_tokens": said}}


class ResponseEvents:
    """The events of one response (one agent turn) for one dialect."""

    def __init__(self, dialect: Dialect, response_id: str, item_id: str, metadata: Any = None) -> None:
        self.names = _NAMES[dialect]
        self.dialect = dialect
        self.response_id, self.item_id, self.metadata = response_id, item_id, metadata
        self._where = {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0}

    def response(self, status: str, output: list[dict[str, Any]], frames: int | None = None,
                 details: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.response_id, "object": "realtime.response", "status": status,
                                "status_details": details, "output": output, "metadata": self.metadata,
                                "usage": usage(frames) if frames is not None else None}
        if self.dialect is Dialect.BETA:
            body.update(modalities=["audio", "text"], output_audio_format="pcm16")
        else:
            body.update(output_modalities=["audio"], conversation_id="conv_default",
                        audio={"output": {"format": {"type": "audio/pcm", "rate": 24000}}})
        return body

    def item(self, status: str, transcript: str | None) -> dict[str, Any]:
        content = [] if transcript is None else [{"type": self.names["content"], "transcript": transcript}]
        return {"id": self.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": content}

    def opening(self, previous_item_id: str | None) -> list[dict[str, Any]]:
        """response.created ... response.content_part.added: what clients wait for before audio."""
        item = self.item("in_progress", None)
        return [event("response.created", response=self.response("in_progress", [])),
                event("response.output_item.added", response_id=self.response_id, output_index=0, item=item),
                event(self.names["item.added"], previous_item_id=previous_item_id, item=item),
                event("response.content_part.added", **self._where, part={"type": "audio", "transcript": ""})]

    def audio(self, pcm: np.ndarray) -> dict[str, Any]:
        return event(self.names["audio.delta"], **self._where, delta=pcm16_base64(pcm))

    def transcript(self, text: str) -> dict[str, Any]:
        return event(self.names["transcript.delta"], **self._where, delta=text)

    def closing(self, status: str, transcript: str, frames: int, details: dict[str, Any] | None) -> list[dict]:
        """response.output_audio.done ... response.done."""
        item_status = "completed" if status == "completed" else "incomplete"
        item = self.item(item_status, transcript)
        events = [event(self.names["audio.done"], **self._where),
                  event(self.names["transcript.done"], **self._where, transcript=transcript),
                  event("response.content_part.done", **self._where,
                        part={"type": "audio", "transcript": transcript}),
                  event("response.output_item.done", response_id=self.response_id, output_index=0, item=item)]
        if self.dialect is Dialect.CURRENT:
            events.append(event("conversation.item.done", item=item))
        events.append(event("response.done", response=self.response(status, [item], frames, details)))
        return events
