"""The Realtime door's pieces, without a socket: session updates in both shapes, client events,
appended audio, turns into responses, and the checks at the door (docs/realtime.md)."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import numpy as np
import pytest

from personaplex_demo.addresses import client_address
from personaplex_demo.api import errors as codes
from personaplex_demo.api.client_events import parse
from personaplex_demo.api.config import ApiConfig
from personaplex_demo.api.conversation import Conversation, TurnTracker
from personaplex_demo.api.doors import SocketLimiter, key_accepted
from personaplex_demo.api.errors import RealtimeError
from personaplex_demo.api.feeder import Feeder, InputAudio, decode_pcm16
from personaplex_demo.api.live_socket import KNOWN as LIVE_EVENTS
from personaplex_demo.api.live_socket import start_settings
from personaplex_demo.api.session import Dialect, SessionSettings, apply_update, join_persona, session_object
from personaplex_demo.api.socket_base import presented_key
from personaplex_demo.call_settings import VOICE_NAMES
from personaplex_demo.errors import PersonaTooLongError
from personaplex_demo.frame import FRAME_SAMPLES
from personaplex_demo.serving.door import DoorCall
from personaplex_demo.serving.room import CallState


class Rules:
    voice_names = list(VOICE_NAMES)
    max_persona_tokens = 10

    def persona_tokens(self, persona: str) -> list[int]:
        words = persona.split()
        if len(words) > self.max_persona_tokens:
            raise PersonaTooLongError(f"the persona is {len(words)} tokens long; the limit is 10 tokens")
        return list(range(len(words)))


def update(session: dict, current: SessionSettings | None = None, started: bool = False) -> SessionSettings:
    return apply_update(current or SessionSettings(), session, Rules(), started=started, event_id="evt_1")


def refused(session: dict, **kw) -> RealtimeError:
    with pytest.raises(RealtimeError) as info:
        update(session, **kw)
    assert info.value.event_id == "evt_1"
    return info.value


# ---- session.update --------------------------------------------------------------------------


def test_both_shapes_of_session_update_set_voice_persona_and_sampling():
    current = update({"type": "realtime", "instructions": "You teach.", "audio": {
        "input": {"format": {"type": "audio/pcm", "rate": 24000}}, "output": {"voice": "VARM1"}},
        "personaplex": {"seed": 5, "text_top_k": 10, "room_events": True}})
    assert (current.voice, current.persona, current.sampling.seed, current.sampling.text_top_k) == (
        "VARM1", "You teach.", 5, 10)
    assert current.room_events
    beta = update({"voice": "NATM0", "instructions": "Hi.", "input_audio_format": "pcm16", "temperature": 0.6,
                   "modalities": ["text", "audio"]})
    assert (beta.voice, beta.persona, beta.sampling.audio_temperature) == ("NATM0", "Hi.", 0.6)
    assert update({}).voice == "NATF2"  # an empty update: the defaults


def test_fields_this_model_has_no_use_for_are_ignored_and_named_back():
    current = update({"type": "realtime", "tools": [{"type": "function", "name": "f"}],
                      "audio": {"input": {"turn_detection": {"type": "server_vad"}}, "output": {"speed": 1.0}}})
    assert set(current.ignored) == {"tools", "speed"}
    assert current.speech_events  # server VAD (or semantic VAD) is what the speech detector gives
    for dialect in Dialect:
        obj = session_object(current, dialect, "sess_1", "personaplex")
        assert obj["personaplex"]["ignored"] == list(current.ignored)
        assert obj["tools"] == [] and json.dumps(obj)
    assert session_object(current, Dialect.BETA, "s", "m")["input_audio_format"] == "pcm16"
    assert session_object(current, Dialect.CURRENT, "s", "m")["audio"]["input"]["format"]["rate"] == 24000


@pytest.mark.parametrize(("session", "code"), [
    ({"voice": "robot"}, codes.UNKNOWN_VOICE),
    ({"audio": {"output": {"voice": 3}}}, codes.INVALID_FIELD),
    ({"instructions": " ".join(["word"] * 11)}, codes.PERSONA_TOO_LONG),
    ({"instructions": ["a list"]}, codes.INVALID_FIELD),
    ({"input_audio_format": "g711_ulaw"}, codes.UNSUPPORTED_AUDIO_FORMAT),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, codes.UNSUPPORTED_AUDIO_FORMAT),
    ({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}, codes.UNSUPPORTED_AUDIO_FORMAT),
    ({"output_modalities": ["text"]}, codes.UNSUPPORTED_MODALITIES),
    ({"personaplex": {"text_temperature": 9.0}}, codes.INVALID_SAMPLING),
    ({"personaplex": {"audio_top_k": 0}}, codes.INVALID_SAMPLING),
    ({"personaplex": {"top_p": 0.5}}, codes.INVALID_FIELD),
    ({"personaplex": "loud"}, codes.INVALID_FIELD),
    ({"personaplex": []}, codes.INVALID_FIELD),
    ({"audio": ["not", "an", "object"]}, codes.INVALID_FIELD),
    ({"audio": {"output": "NATF1"}}, codes.INVALID_FIELD),
    ({"temperature": 10**400}, codes.INVALID_FIELD),
    ({"personaplex": {"audio_temperature": float("nan")}}, codes.INVALID_SAMPLING),
    ({"voice": ["NATF1"]}, codes.INVALID_FIELD),
])
def test_a_bad_session_update_is_refused_with_its_code_and_changes_nothing(session, code):
    err = refused(session)
    assert err.code == code, err
    assert err.as_error()["code"] == code and err.message


def test_unknown_voice_lists_the_valid_ones_and_openai_voices_are_ignored():
    message = refused({"voice": "Alloy2"}).message
    assert all(name in message for name in VOICE_NAMES)
    # What agent frameworks send by default starts the session with its own voice, named as ignored.
    for session in ({"voice": "alloy"}, {"type": "realtime", "audio": {"output": {"voice": "marin"}}}):
        settings = update(session, current=SessionSettings(voice="VARF0"))
        assert settings.voice == "VARF0" and "voice" in settings.ignored


def test_voice_persona_and_sampling_are_kept_and_named_once_the_call_started():
    current = update({"voice": "NATF1", "instructions": "A."})
    later = update({"voice": "NATF0", "instructions": "B.", "personaplex": {"seed": 1}}, current=current,
                   started=True)
    assert later.call_fields() == current.call_fields()  # no error: frameworks take any error as fatal
    assert later.locked == ("voice", "instructions", "sampling")
    assert session_object(later, Dialect.CURRENT, "s", "m")["personaplex"]["locked"] == list(later.locked)
    # The same values again, or room events alone, change nothing that is locked.
    again = update({"voice": "NATF1", "instructions": "A.", "personaplex": {"room_events": True}},
                   current=current, started=True)
    assert again.room_events and again.voice == "NATF1" and again.locked == ()
    # Several updates before the start all apply (LiveKit: the voice first, the instructions next).
    two = update({"instructions": "Be brief."}, current=update({"audio": {"output": {"voice": "VARM1"}}}))
    assert (two.voice, two.persona) == ("VARM1", "Be brief.")


def test_turn_detection_null_turns_the_speech_events_off():
    off = update({"audio": {"input": {"turn_detection": None}}})
    assert not off.speech_events
    assert session_object(off, Dialect.CURRENT, "s", "m")["audio"]["input"]["turn_detection"] is None
    on = update({"turn_detection": {"type": "semantic_vad"}}, current=off)
    assert on.speech_events
    assert session_object(on, Dialect.BETA, "s", "m")["turn_detection"]["type"] == "server_vad"


# ---- client events ---------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "code"), [
    ("{not json", codes.INVALID_JSON),
    ("[1, 2]", codes.INVALID_JSON),
    (b"\x00\x01", codes.BINARY_MESSAGE),
    ('{"event_id": "e"}', codes.MISSING_FIELD),
    ('{"type": "input_audio_buffer.flush"}', codes.UNKNOWN_EVENT),
    ('{"type": "conversation.item.retrieve", "item_id": "x"}', codes.UNSUPPORTED_EVENT),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 2000}), codes.MESSAGE_TOO_LARGE),
    (json.dumps({"type": "session.update", "session": {"instructions": "é" * 300}}, ensure_ascii=False), None),
    ('{"type": "session.update", "session": {"instructions": "' + "é" * 600 + '"}}', codes.MESSAGE_TOO_LARGE),
    ("[" * 100_000, codes.INVALID_JSON),  # deeper than the parser recurses
])
def test_client_events_that_cannot_be_taken_get_their_code(text, code):
    if code is None:
        assert parse(text, max_bytes=1000).type == "session.update"
        return
    with pytest.raises(RealtimeError) as info:
        parse(text, max_bytes=10**6 if isinstance(text, str) and text.startswith("[[") else 1000)
    assert info.value.code == code


def test_a_known_event_keeps_its_id_and_body():
    event = parse('{"type": "response.create", "event_id": "e7", "response": {"metadata": {"k": "v"}}}', 1000)
    assert (event.type, event.event_id, event.body["response"]) == ("response.create", "e7", {"metadata": {"k": "v"}})


# ---- appended audio --------------------------------------------------------------------------


def b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<i2").tobytes()).decode()


def test_appended_audio_is_cut_into_frames_across_chunks_of_any_length():
    audio = InputAudio(limit_seconds=1.0)
    samples = np.arange(2 * FRAME_SAMPLES + 7, dtype=np.int16)
    for start in range(0, samples.size, 333):
        audio.append(decode_pcm16(b64(samples[start:start + 333])))
    first, second = audio.pop(), audio.pop()
    assert np.array_equal(np.concatenate([first, second]), samples[:2 * FRAME_SAMPLES])
    assert audio.pop() is None and audio.samples == 7
    audio.clear()
    assert audio.samples == 0


def test_audio_beyond_the_bound_is_refused_whole():
    audio = InputAudio(limit_seconds=0.2)  # 4800 samples
    audio.append(np.zeros(4000, np.int16))
    with pytest.raises(RealtimeError) as info:
        audio.append(np.zeros(1000, np.int16))
    assert info.value.code == codes.INPUT_BUFFER_FULL
    assert audio.samples == 4000  # nothing of the refused chunk was kept


@pytest.mark.parametrize(("payload", "code"), [("not base64!", codes.INVALID_BASE64),
                                               (base64.b64encode(b"abc").decode(), codes.ODD_BYTE_COUNT)])
def test_bad_audio_payloads(payload, code):
    with pytest.raises(RealtimeError) as info:
        decode_pcm16(payload)
    assert info.value.code == code


def test_a_waiting_callers_audio_is_not_decoded():
    door_call = DoorCall(None, "realtime")
    door_call.call = SimpleNamespace(state=CallState.QUEUED)
    feeder = Feeder(ApiConfig(), door_call, lambda pcm: None)
    feeder.append("not base64!", None)  # dropped unread
    assert feeder.audio.samples == 0
    door_call.call = None
    with pytest.raises(RealtimeError):  # before any call, a bad chunk is still refused
        feeder.append("not base64!", None)


# ---- turns -----------------------------------------------------------------------------------

LOUD = 0.3 * np.sin(np.linspace(0, 200, FRAME_SAMPLES)).astype(np.float32)
QUIET = np.zeros(FRAME_SAMPLES, np.float32)


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_a_turn_is_one_response_in_the_order_clients_wait_for():
    turns = TurnTracker(Dialect.CURRENT, turn_end_seconds=0.24, speech_dbfs=-40)
    assert turns.frame(QUIET, "") == []  # silence between turns is not sent
    opening = turns.frame(LOUD, "Hel")
    assert types(opening) == ["response.created", "response.output_item.added", "conversation.item.added",
                              "response.content_part.added", "response.output_audio.delta",
                              "response.output_audio_transcript.delta"]
    rid, item = opening[0]["response"]["id"], opening[1]["item"]["id"]
    assert all(e.get("response_id", rid) == rid for e in opening)
    assert all(e.get("item_id", item) == item for e in opening[3:])
    delta = base64.b64decode(opening[4]["delta"])
    assert len(delta) == 2 * FRAME_SAMPLES
    events = turns.frame(LOUD, "lo") + turns.frame(QUIET, "") + turns.frame(QUIET, "")
    assert "response.done" not in types(events)  # a short pause stays inside the turn
    closing = turns.frame(QUIET, "")
    assert types(closing) == ["response.output_audio.delta", "response.output_audio.done",
                              "response.output_audio_transcript.done", "response.content_part.done",
                              "response.output_item.done", "conversation.item.done", "response.done"]
    done = closing[-1]["response"]
    assert closing[-1]["type"] == "response.done" and done["status"] == "completed"
    assert done["output"][0]["content"][0]["transcript"] == "Hello"
    assert done["usage"]["output_token_details"]["audio_tokens"] == 8 * 5  # five frames in the turn
    assert turns.current is None and turns.frame(QUIET, "") == []


def test_beta_clients_get_the_beta_names():
    turns = TurnTracker(Dialect.BETA, turn_end_seconds=0.08, speech_dbfs=-40)
    names = types(turns.frame(LOUD, "a") + turns.frame(QUIET, ""))
    assert "conversation.item.created" in names and "response.audio.delta" in names
    assert "response.audio_transcript.delta" in names and "response.audio.done" in names
    assert not any("output_audio" in n for n in names)


def test_response_create_opens_at_once_with_its_metadata_and_cancel_ends_the_response():
    turns = TurnTracker(Dialect.CURRENT, turn_end_seconds=0.16, speech_dbfs=-40)
    opened = turns.request({"client_event_id": "abc"})
    assert opened[0]["response"]["metadata"] == {"client_event_id": "abc"}
    first = opened[0]["response"]["id"]
    assert types(turns.frame(LOUD, "x"))[0] == "response.output_audio.delta"
    # A second request completes the open response and opens its own (LiveKit waits for it).
    again = turns.request({"client_event_id": "def"})
    assert again[-5]["response"]["status"] == "completed" and again[-5]["response"]["id"] == first
    assert again[-4]["response"]["metadata"] == {"client_event_id": "def"}
    cancelled = turns.cancel()
    assert cancelled[-1]["response"]["status"] == "cancelled"
    assert cancelled[-1]["response"]["status_details"]["reason"] == "client_cancelled"
    assert turns.cancel() == []
    # The model heard the caller and goes on if it wants: its next words are a new response, a new item.
    resumed = turns.frame(LOUD, "y")
    assert types(resumed)[0] == "response.created" and resumed[1]["item"]["id"] != again[-3]["item"]["id"]
    assert resumed[2]["previous_item_id"] == again[-3]["item"]["id"]


def test_an_open_response_ends_cancelled_with_the_call():
    turns = TurnTracker(Dialect.CURRENT, turn_end_seconds=0.8, speech_dbfs=-40)
    turns.frame(LOUD, "a")
    done = turns.cancel("time_limit")[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "time_limit"
    assert turns.cancel("time_limit") == []


def test_items_are_acknowledged_by_the_clients_id_and_text_before_the_start_joins_the_persona():
    conversation = Conversation(Dialect.CURRENT)
    events, text = conversation.create(parse(json.dumps({
        "type": "conversation.item.create", "event_id": "e1",
        "item": {"id": "item_client", "type": "message", "role": "developer",
                 "content": [{"type": "input_text", "text": "Say hello!"}]}}), 4096))
    assert types(events) == ["conversation.item.added", "conversation.item.done"]
    assert events[0]["item"]["id"] == "item_client" and events[0]["item"]["role"] == "system"
    assert events[0]["previous_item_id"] is None and text == "Say hello!"
    assert join_persona("You are Ada.", text) == "You are Ada.\nSay hello!"
    events, text = conversation.create(parse(json.dumps({
        "type": "conversation.item.create", "item": {"type": "message", "role": "assistant",
                                                     "content": [{"type": "output_text", "text": "Hi"}]}}), 4096))
    assert text is None and events[0]["previous_item_id"] == "item_client"
    truncated = conversation.truncate(parse(json.dumps({"type": "conversation.item.truncate", "item_id": "item_client",
                                                        "content_index": 0, "audio_end_ms": 1500}), 4096))
    assert truncated["type"] == "conversation.item.truncated" and truncated["audio_end_ms"] == 1500
    assert conversation.delete(parse('{"type": "conversation.item.delete", "item_id": "item_client"}', 4096))[
        "item_id"] == "item_client"
    with pytest.raises(RealtimeError):
        conversation.truncate(parse('{"type": "conversation.item.truncate", "item_id": "nope"}', 4096))
    spoken = conversation.user_audio("item_user")
    assert types(spoken) == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    assert spoken[1]["item"]["content"][0]["type"] == "input_audio"


def test_gpt_live_session_start_is_read_by_the_realtime_rules():
    settings = start_settings({"model": "gpt-live-1", "instructions": "You are Ada.",
                               "audio": {"format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "NATM1"}},
                               "delegation": {"type": "responses", "responses": {"model": "gpt-5.6-luna"}},
                               "input": [{"type": "message", "role": "developer",
                                          "content": [{"type": "input_text", "text": "Be brief."}]},
                                         {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                          "text": "Hi"}]}]},
                              Rules(), "e1")
    assert (settings.voice, settings.persona) == ("NATM1", "You are Ada.\nBe brief.")
    assert {"model", "delegation", "input"} <= set(settings.ignored)
    assert start_settings({"audio": {"output": {"voice": {"id": "marin"}}}}, Rules(), None).voice == "NATF2"
    for bad, code in (({"audio": {"format": {"type": "audio/pcmu"}}}, codes.UNSUPPORTED_AUDIO_FORMAT),
                      ({"audio": {"output": {"voice": "NOPE"}}}, codes.UNKNOWN_VOICE),
                      ({"instructions": "word " * 11}, codes.PERSONA_TOO_LONG), (None, codes.MISSING_FIELD)):
        with pytest.raises(RealtimeError) as info:
            start_settings(bad, Rules(), "e2")
        assert info.value.code == code and info.value.event_id == "e2"
    assert parse('{"type": "session.start", "session": {}}', 4096, LIVE_EVENTS, {}).type == "session.start"
    with pytest.raises(RealtimeError) as info:
        parse('{"type": "input_audio_buffer.append"}', 4096, LIVE_EVENTS, {})
    assert info.value.code == codes.UNKNOWN_EVENT


# ---- at the door -----------------------------------------------------------------------------


def test_the_key_comes_as_a_bearer_header_or_a_browser_subprotocol():
    assert presented_key({"authorization": "Bearer s3cret"}, []) == "s3cret"
    assert presented_key({}, ["realtime", "openai-insecure-api-key.s3cret"]) == "s3cret"
    assert presented_key({"authorization": "Basic xyz"}, []) is None
    assert key_accepted(None, None)
    assert key_accepted("s3cret", "s3cret") and not key_accepted("s3cret", "guess") and not key_accepted("s3cret", None)


def test_sockets_are_limited_per_client_address():
    forged = {"x-forwarded-for": "6.6.6.6, 10.0.0.7"}
    assert client_address(forged, "127.0.0.1") == "127.0.0.1"  # no proxy: the header is the client's word
    assert client_address(forged, "127.0.0.1", trust_forwarded_for=True) == "10.0.0.7"  # the proxy's own hop
    assert client_address({}, "127.0.0.1", trust_forwarded_for=True) == "127.0.0.1"
    limiter = SocketLimiter(2)
    assert limiter.take("a") and limiter.take("a") and not limiter.take("a") and limiter.take("b")
    limiter.give_back("a")
    assert limiter.take("a") and not limiter.take("a")


# ---- the flags -------------------------------------------------------------------------------


def test_the_door_follows_its_flags_and_help_never_shows_the_key(capsys):
    from types import SimpleNamespace

    from personaplex_demo.cli.app import api_doors
    from personaplex_demo.cli.config import parse_config

    topology = SimpleNamespace(room=object(), runtime=SimpleNamespace(engine=Rules(), model_name="tiny"))
    assert api_doors(parse_config(["--no-api"], environ={}), topology) is None
    # The former names still work.
    assert api_doors(parse_config(["--no-realtime"], environ={}), topology) is None
    assert api_doors(parse_config([], environ={"PERSONAPLEX_NO_REALTIME": "1"}), topology) is None
    old = api_doors(parse_config(["--realtime-max-sockets", "3"], environ={}), topology)
    assert old.status()["realtime"]["max_sockets_per_client"] == 3
    door = api_doors(parse_config(["--api-key", "k1", "--api-max-sockets", "2"], environ={}), topology)
    status = door.status()
    assert status["realtime"]["api_key_required"] and status["realtime"]["max_sockets_per_client"] == 2
    assert door.config.api_key == "k1"
    assert [r.path for r in door.routes()] == ["/v1/realtime", "/v1/live/sessions", "/api/chat", "/api/voices"]
    assert status["chat"]["api_key_required"] and status["twilio"] is None  # no TWILIO_AUTH_TOKEN: no phone door
    opened = api_doors(parse_config(["--api-key", "k1", "--chat-without-key"], environ={}), topology).status()
    assert not opened["chat"]["api_key_required"] and opened["realtime"]["api_key_required"]
    no_chat = api_doors(parse_config(["--no-chat"], environ={}), topology)
    assert [r.path for r in no_chat.routes()] == ["/v1/realtime", "/v1/live/sessions"]
    phone = api_doors(parse_config([], environ={"TWILIO_AUTH_TOKEN": "t0ken"}), topology)
    assert [r.path for r in phone.routes()][-2:] == ["/telephony/twilio/stream/{ticket}", "/telephony/twilio"]
    assert not phone.status()["twilio"]["api_key_required"]
    assert parse_config([], environ={"PERSONAPLEX_API_KEY": "from-env"}).api_key == "from-env"
    with pytest.raises(SystemExit):
        parse_config(["--help"], environ={"PERSONAPLEX_API_KEY": "s3cret-value"})
    shown = capsys.readouterr().out
    assert "--api-key" in shown and "s3cret-value" not in shown and "set, from PERSONAPLEX_API_KEY" in shown


# ---- when the caller speaks ------------------------------------------------------------------


async def test_the_speech_detector_finds_the_callers_speech_off_the_event_loop(tmp_path):
    import asyncio
    import threading

    from personaplex_demo.api import speech_detector
    from personaplex_demo.api.speech_detector import SpeechConfig, SpeechEvents

    from .browser_support import missing_tools, require
    from .sdk_callers import speech_pcm

    require([t for t in missing_tools() if t in ("espeak-ng", "sox")], "apt-get install -y espeak-ng sox")
    speech = speech_pcm(tmp_path, "Hello there. Can you tell me about the weather on Mars today?")
    pcm = np.concatenate([np.zeros(24000, np.int16), speech, np.zeros(36000, np.int16)])
    found, threads = [], set()
    hear = speech_detector.SpeechDetector.hear

    def hear_and_note(self, frames):
        threads.add(threading.current_thread().name)
        return hear(self, frames)

    speech_detector.SpeechDetector.hear = hear_and_note
    try:
        events = SpeechEvents(SpeechConfig(), lambda kind, ms: found.append((kind, ms)))
        for k in range(pcm.size // FRAME_SAMPLES):  # four times real time
            events.hear(pcm[k * FRAME_SAMPLES:(k + 1) * FRAME_SAMPLES])
            await asyncio.sleep(0.02)
        for _ in range(100):
            if len(found) == 2:
                break
            await asyncio.sleep(0.05)
    finally:
        speech_detector.SpeechDetector.hear = hear
    assert [kind for kind, _ in found] == ["started", "stopped"], found
    speech_ms = 1000 * speech.size / 24000
    assert 1000 - 400 <= found[0][1] <= 1000 + 300  # the first word, less the padding before it
    assert speech_ms <= found[1][1] <= 1000 + speech_ms + 1000  # after the last, within the quiet that ends it
    assert threads and all(name.startswith("speech-detector") for name in threads)
    assert events.skipped_frames == 0
    off = SpeechEvents(SpeechConfig(enabled=False), lambda kind, ms: found.append((kind, ms)))
    off.hear(pcm[:FRAME_SAMPLES])
    assert off._pending == []


class FakeSocket:
    """What a socket class needs of Starlette's WebSocket: sends recorded, the close's code."""

    scope: dict = {}

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.close_code: int | None = None

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))

    async def close(self, code: int, reason: str) -> None:
        self.close_code = code


async def test_a_gpt_live_session_the_room_ends_is_closed_with_the_rooms_reason():
    import asyncio

    from personaplex_demo.api.live_socket import LiveDoor, LiveSocket
    from personaplex_demo.api.socket_base import DoorStats

    ws = FakeSocket()
    sock = LiveSocket(ws, LiveDoor(None, Rules(), ApiConfig(), DoorStats()))
    sock.settings = start_settings({"instructions": "You are Ada."}, Rules(), None)
    writer = asyncio.create_task(sock._write())
    await sock.on_ended("time_limit")
    writer.cancel()
    closed = ws.sent[-1]
    assert closed["type"] == "session.closed" and closed["reason"] == "time_limit"
    assert closed["message"].startswith("Time is up") and closed["session"]["status"] == "closed"
    assert ws.close_code == 1000 and not [e for e in ws.sent if e["type"] == "error"]


def test_an_api_chat_query_is_read_as_nvidias_server_reads_it_and_checked_as_a_page_call():
    from personaplex_demo.api.chat_socket import chat_request

    request = chat_request({"voice_prompt": "VARF3.pt", "text_prompt": "You are Ada.", "seed": "12",
                            "text_temperature": "0.5", "audio_topk": "100", "room_events": "1"}, Rules())
    assert (request.voice, request.persona, request.sampling.seed) == ("VARF3", "You are Ada.", 12)
    assert request.sampling.text_temperature == 0.5 and request.sampling.audio_top_k == 100 and request.room_events
    defaults = chat_request({"voice_prompt": "NATM0", "seed": "-1"}, Rules())
    assert defaults.voice == "NATM0" and defaults.sampling.seed is None and defaults.persona == ""
    for query, code in (({"voice_prompt": "ROBOT.pt"}, codes.UNKNOWN_VOICE),
                        ({"text_prompt": "word " * 11}, codes.PERSONA_TOO_LONG),
                        ({"seed": "x"}, codes.INVALID_SAMPLING), ({"audio_topk": "0"}, codes.INVALID_SAMPLING)):
        with pytest.raises(RealtimeError) as info:
            chat_request(query, Rules())
        assert info.value.code == code and len(info.value.message) < 120
