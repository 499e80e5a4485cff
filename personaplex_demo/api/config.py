"""The API doors' settings (docs/api.md): one dataclass, mapped from the app's flags in
cli/app.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..frame import SOUND_DBFS
from .speech_detector import SpeechConfig


@dataclass(frozen=True)
class ApiConfig:
    api_key: str | None = None  # when set, a socket must present it before it may take a slot
    max_sockets_per_client: int = 4  # open sockets per client address: one script cannot take the room
    # Audio a client may send ahead of real time; the door hands it to the room at the room's pace.
    input_buffer_seconds: float = 5.0
    # Frames handed to the room beyond the outputs read back. One: each frame reaches the room right
    # after the tick before the one that takes it, so the room's inbox sees no standing backlog to cut.
    feed_lead_frames: int = 1
    # A client that pauses its audio gets silence played into the call after `fill_after_seconds`,
    # for up to `fill_silence_seconds`; then the room's idle release ends the call.
    fill_after_seconds: float = 0.5
    fill_silence_seconds: float = 30.0
    max_message_bytes: int = 1 << 20  # one client event (a 1 MiB append holds about 16 s of audio)
    # Agent audio a client has not read yet; beyond it the socket is closed and the slot freed.
    send_backlog_seconds: float = 5.0
    # An agent turn (one response) ends after this long without text or audible agent speech.
    turn_end_seconds: float = 0.8
    speech_dbfs: float = SOUND_DBFS  # agent audio louder than this (RMS) counts as speech
    # The call starts once a client that configured its session or sent audio has changed nothing for
    # this long (or at its first response.create): frameworks configure a session in several events.
    settle_seconds: float = 0.25
    start_timeout_seconds: float = 60.0  # a socket that starts no call by then is closed
    # Take the client's address from X-Forwarded-For (its last hop): only behind a proxy that sets it,
    # such as a Hugging Face Space's; elsewhere a client could name any address it likes.
    trust_forwarded_for: bool = False
    model_name: str = "personaplex"
    # /api/chat, NVIDIA's protocol; with an api_key, open without one only when asked (the reference
    # protocol carries no key and LiveKit's plugin cannot add one).
    chat: bool = True
    chat_without_key: bool = False
    # The phone door: on with the Twilio account's auth token, which signs its webhooks; a webhook's
    # one-time stream URL lapses unused after `phone_ticket_seconds`.
    twilio_auth_token: str | None = None
    phone_ticket_seconds: float = 30.0
    # When the caller speaks: the Realtime door's input_audio_buffer.speech_started / speech_stopped.
    speech: SpeechConfig = field(default_factory=SpeechConfig)
