"""The Realtime API door with real clients: the official `openai` SDK (and, for what the SDK will
not send, a plain `websockets` client) against the app launched as a user starts it, beside an
aiortc caller that drives the page's own Gradio events (docs/realtime.md)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import socket
import time

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from .browser_support import LaunchedApp, launched_app, missing_tools, require
from .callers import PageCaller, PageConfig, until
from .sdk_callers import ChatClient, LiveClient, SdkCaller, pcm_event, speech_pcm

pytestmark = pytest.mark.usefixtures("loopback_ice")

KEY = "realtime-test-key"
SILENCE = np.zeros(24000, np.int16)


@pytest.fixture(scope="module")
def app(tiny_cache_dir, tmp_path_factory) -> LaunchedApp:
    # Admission by slot count: these tests follow calls and sockets, on any host; admission by
    # headroom has tests of its own (test_headroom.py).
    args = ["--slots", "4", "--admission", "slots", "--api-key", KEY, "--api-max-sockets", "3"]
    with launched_app(tmp_path_factory.mktemp("app"), tiny_cache_dir, args=args) as launched:
        yield launched


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    require([t for t in missing_tools() if t in ("espeak-ng", "sox")], "apt-get install -y espeak-ng sox")
    return speech_pcm(tmp_path_factory.mktemp("speech"))


def ws_url(app: LaunchedApp) -> str:
    return app.base_url.replace("http", "ws", 1) + "/v1/realtime"


@pytest.fixture(autouse=True)
def empty_room(request) -> None:
    """Each test of the shared app starts from an empty room, whatever the one before left."""
    if "app" in request.fixturenames:
        request.getfixturevalue("app").wait_empty()


def room_is_empty(app: LaunchedApp) -> bool:
    return app.room_empty()


def real_time_share(app: LaunchedApp) -> float:
    """How much of real time a call's audio must cover here: 0.9 on a host that ticks in real
    time, less on one that cannot (the call still holds and audio keeps coming)."""
    status = app.status()
    return 0.9 if status["realtime_factor"] < 0.9 and status["resyncs"] == 0 else 0.5


async def test_an_sdk_session_streams_speech_and_hears_the_agent(app, speech):
    async with SdkCaller(app.base_url, KEY) as caller:
        created = await caller.wait_event("session.created")
        assert created.session.audio.output.format.rate == 24000
        sent_update = time.monotonic()
        await caller.configure("VARM1", "You are a wise and friendly teacher.", seed=11)
        updated = await caller.wait_event("session.updated")
        assert updated.session.audio.output.voice == "VARM1"
        await caller.wait_live()
        # The engine's figures reach the room twice a second when it runs in a process of its own.
        # The door's count and the engine's live slots come by different ways: wait until both say it.
        live = await until(lambda: (s := app.status())["calls_by_door"] == {"realtime": 1}
                           and s["slots_live"] == 1 and s, 3,
                           lambda: f"the call in the room's figures ({app.status()['calls_by_door']}, "
                                   f"{app.status()['slots_live']} live)")
        assert live["realtime"]["sockets_open"] == 1
        # The default topology serves the socket where the media is: in the media worker.
        assert [w["api_sockets"] for w in live["media_workers"]] == [1]

        await caller.stream(speech)
        await caller.stream(SILENCE)
        window_end = time.monotonic()
        window_start = caller.live_at + 1.0
        heard = caller.audio_seconds(window_start, window_end)
        assert heard >= real_time_share(app) * (window_end - window_start), (heard, window_end - window_start)
        assert caller.transcript.strip() and not caller.errors
        first_audio = caller.audio[0][0] - sent_update
        assert first_audio < 10.0, first_audio

        # The response lifecycle in the order agent frameworks wait for it, ids matching throughout.
        kinds = caller.types()
        start = kinds.index("response.created")
        assert kinds[start:start + 4] == ["response.created", "response.output_item.added",
                                          "conversation.item.added", "response.content_part.added"]
        events = [e for _, e in caller.events]
        response_id, item_id = events[start].response.id, events[start + 1].item.id
        deltas = [e for e in events if e.type == "response.output_audio.delta"]
        first = [d for d in deltas if d.response_id == response_id]
        assert first and all(d.item_id == item_id for d in first)
        assert len(base64.b64decode(deltas[0].delta)) == 2 * 1920  # one 80 ms frame of PCM16
        # The speech detector heard the caller: server VAD's events, and the response it cut off.
        started = kinds.index("input_audio_buffer.speech_started")
        assert "input_audio_buffer.speech_stopped" in kinds[started:]
        assert events[started].audio_start_ms < 1000 * len(speech) / 24000
        cancelled = [e.response for e in events if e.type == "response.done" and e.response.status == "cancelled"]
        assert all(r.status_details.reason == "turn_detected" for r in cancelled)

    # Hanging up frees the slot within 3 s.
    closed = time.monotonic()
    await until(lambda: room_is_empty(app), 3.0, "the socket's slot")
    assert time.monotonic() - closed < 3.0
    status = app.status()
    assert status["calls_started_by_door"].get("realtime", 0) >= 1
    assert status["realtime"]["sockets_open"] == 0
    assert [w["api_sockets"] for w in status["media_workers"]] == [0]
    assert "served by the main process" not in app.log_text()


async def test_a_beta_sdk_session_gets_the_beta_event_names(app):
    async with SdkCaller(app.base_url, KEY, beta=True) as caller:
        await caller.configure("NATM1", "You enjoy having a good conversation.")
        updated = await caller.wait_event("session.updated")
        assert updated.session.voice == "NATM1" and updated.session.input_audio_format == "pcm16"
        await caller.wait_live()
        streaming = asyncio.create_task(caller.stream(np.tile(SILENCE, 3)))
        await caller.wait_event("response.audio.delta", timeout=10)
        await caller.wait_event("conversation.item.created", timeout=1)
        streaming.cancel()
        assert not any("output_audio" in kind for kind in caller.types())
    await until(lambda: room_is_empty(app), 3.0, "the socket's slot")


async def test_two_sdk_sessions_and_a_page_caller_share_the_room(app, speech):
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http, \
            SdkCaller(app.base_url, KEY) as first, SdkCaller(app.base_url, KEY) as second:
        page = PageCaller(http, await PageConfig.fetch(http), "NATF2", "You work for a bank.", seed=3)
        await page.offer(300.0)
        await page.wait_connected()
        await first.configure("VARF1", "You are an astronaut on Mars.", seed=1)
        await second.configure("NATM3", "You are a chef who loves pasta.", seed=2)
        await first.wait_live()
        await second.wait_live()
        both = asyncio.gather(first.stream(np.concatenate([speech, SILENCE])),
                              second.stream(np.concatenate([SILENCE, speech])))
        await until(lambda: page.status.startswith("Live") and page.transcript, 30, "the page caller live")
        # The engine's figures reach the room twice a second when it runs in a process of its own.
        await until(lambda: app.status()["calls_by_door"] == {"realtime": 2, "page": 1}, 3,
                    lambda: f"every call in the room's figures ({app.status()['calls_by_door']})")
        # The page's room line follows the figures within a few status updates: wait for the
        # line that counts both sockets, not for the first one that mentions the API.
        await until(lambda: any("(2 via the API)" in s for _, s in page.updates), 10,
                    lambda: f"the room line on the page ({page.status!r})")
        await both
        # Each has its own transcript.
        assert first.transcript and second.transcript and page.transcript
        assert len({first.transcript, second.transcript, page.transcript}) == 3
        metrics = app.metrics()
        assert 'personaplex_calls{door="realtime"} 2.0' in metrics and 'personaplex_calls{door="page"} 1.0' in metrics

        # Hanging up either kind frees its slot within 3 s.
        await page.hang_up()
        await until(lambda: app.status()["calls_by_door"].get("page", 0) == 0, 3.0, "the page caller's slot")
        await first.conn.close()
        await until(lambda: app.status()["calls_by_door"].get("realtime") == 1, 3.0, "the first socket's slot")
    await until(lambda: room_is_empty(app), 3.0, "every slot")


async def test_a_socket_without_the_key_is_refused_before_it_takes_a_slot(app):
    before = app.status()["calls_started_by_door"].get("realtime", 0)
    for key in (None, "wrong-key"):
        with pytest.raises(InvalidStatus) as info:
            async with SdkCaller(app.base_url, key):
                pass
        assert info.value.response.status_code == 401
        assert b"invalid_api_key" in info.value.response.body
    status = app.status()
    assert status["realtime"]["refused"]["api_key"] >= 2
    assert not any(status["calls_by_door"].values())
    assert status["calls_started_by_door"].get("realtime", 0) == before
    # Browsers pass the key as a subprotocol; the server names "realtime" back.
    async with ws_connect(ws_url(app), subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(await ws.recv())["type"] == "session.created"


async def test_one_client_address_opens_at_most_its_share_of_sockets(app):
    headers = {"Authorization": f"Bearer {KEY}"}
    sockets = [await ws_connect(ws_url(app), additional_headers=headers) for _ in range(3)]
    try:
        with pytest.raises(InvalidStatus) as info:
            await ws_connect(ws_url(app), additional_headers=headers)
        assert info.value.response.status_code == 429
    finally:
        for ws in sockets:
            await ws.close()
    await until(lambda: app.status()["realtime"]["sockets_open"] == 0, 3.0, "the sockets to close")
    async with ws_connect(ws_url(app), additional_headers=headers):
        pass  # room again once they closed


BAD_BEFORE_THE_CALL = [  # (raw message, the error code it must get)
    ("{this is not json", "invalid_json"),
    (json.dumps({"type": "input_audio_buffer.rewind"}), "unknown_event"),
    (json.dumps({"type": "conversation.item.create"}), "missing_field"),
    (json.dumps({"type": "conversation.item.retrieve", "item_id": "item_1"}), "unsupported_event"),
    (json.dumps({"type": "conversation.item.truncate", "item_id": "no_such_item", "audio_end_ms": 10}),
     "invalid_field"),
    (json.dumps({"type": "session.update"}), "missing_field"),
    (json.dumps({"type": "input_audio_buffer.append"}), "missing_field"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "@@not base64@@"}), "invalid_base64"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}),
     "odd_byte_count"),
    (json.dumps({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}),
     "unsupported_audio_format"),
    (json.dumps({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}),
     "unsupported_audio_format"),
    (json.dumps({"type": "session.update", "session": {"voice": "robot"}}), "unknown_voice"),
    (json.dumps({"type": "session.update", "session": {"instructions": "word " * 2000}}), "persona_too_long"),
    (json.dumps({"type": "session.update", "session": {"personaplex": {"audio_top_k": 0}}}), "invalid_sampling"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (1 << 20)}), "message_too_large"),
    ("[" * 100_000, "invalid_json"),  # nested deeper than the parser goes
    ('{"type": "session.update", "session": {"instructions": "\\ud800 a lone surrogate"}}', "invalid_field"),
    ('{"type": "session.update", "session": {"temperature": 1' + "0" * 400 + "}}", "invalid_field"),
]


async def test_every_bad_input_gets_its_error_and_no_other_callers_audio_changes(app, speech):
    async with SdkCaller(app.base_url, KEY) as talker, SdkCaller(app.base_url, KEY) as rogue:
        await talker.configure("NATF2", "You enjoy having a good conversation.", seed=5)
        await talker.wait_live()
        talking = asyncio.create_task(talker.stream(np.concatenate([speech, speech, SILENCE, SILENCE])))
        await asyncio.sleep(2.0)
        calm = (talker.live_at + 0.5, time.monotonic())

        barrage_start = time.monotonic()
        for raw, code in BAD_BEFORE_THE_CALL:
            seen = len(rogue.events)
            await rogue.conn.send_raw(raw)
            error = await rogue.wait_event("error", timeout=5, after=seen)
            assert error.error.code == code, (raw[:80], error.error)
            assert error.error.message
            if code == "unknown_voice":
                assert "NATF0" in error.error.message and "VARM4" in error.error.message
        seen = len(rogue.events)
        await rogue.conn.send_raw(b"\x00\x01")
        assert (await rogue.wait_event("error", timeout=5, after=seen)).error.code == "binary_message_unsupported"

        # Still usable: a good session.update starts its call; then flooding is refused past the bound.
        await rogue.configure("VARF2", "You are a pirate.")
        await rogue.wait_live()
        four_seconds = np.zeros(4 * 24000, np.int16)
        seen = len(rogue.events)
        for _ in range(2):
            await rogue.conn.input_audio_buffer.append(audio=base64.b64encode(four_seconds.tobytes()).decode())
        assert (await rogue.wait_event("error", timeout=5, after=seen)).error.code == "input_audio_buffer_full"
        seen = len(rogue.events)
        await rogue.conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "NATM0"}}})
        updated = await rogue.wait_event("session.updated", timeout=5, after=seen)  # not an error: kept, and said
        assert updated.session.audio.output.voice == "VARF2"
        assert updated.session.model_extra["personaplex"]["locked"] == ["voice"]
        seen = len(rogue.events)
        await rogue.conn.input_audio_buffer.commit()
        await rogue.wait_event("input_audio_buffer.committed", timeout=5, after=seen)
        await talking  # the rogue's call stays live meanwhile, its flooded audio fed at real time
        barrage = (barrage_start, time.monotonic())

        # The other caller heard nothing of it: no error, and its audio kept coming as before.
        assert not talker.errors and not talker.ended.is_set()
        calm_rate = talker.audio_seconds(*calm) / (calm[1] - calm[0])
        barrage_rate = talker.audio_seconds(*barrage) / (barrage[1] - barrage[0])
        assert barrage_rate >= min(real_time_share(app), calm_rate - 0.1), (calm_rate, barrage_rate)
        arrivals = [at for at, _ in talker.audio if barrage[0] <= at <= barrage[1]]
        assert max(np.diff(arrivals)) < 1.0, "the talker's audio stalled during the barrage"
    status = app.status()
    for _, code in BAD_BEFORE_THE_CALL:
        assert status["realtime"]["errors"].get(code, 0) >= 1, code
    await until(lambda: room_is_empty(app), 3.0, "every slot")


@pytest.mark.parametrize("door", ["realtime", "live", "chat"])
async def test_a_client_that_stops_reading_is_disconnected_and_its_slot_freed(app, door):
    # A small receive buffer, so that the server's sends back up within seconds, as over a slow link.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = app.base_url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    frames = np.zeros(1920, np.int16)
    if door == "chat":  # the call is placed as the socket opens; audio is Ogg Opus
        import sphn

        url, start, opus = chat_url(app, api_key=KEY), None, sphn.OpusStreamWriter(24000)
        message = lambda: b"\x01" + opus.append_pcm(frames.astype(np.float32))  # noqa: E731
    else:
        url, start, append = ((ws_url(app), {"type": "session.update", "session": {}}, "input_audio_buffer.append")
                              if door == "realtime" else
                              (live_url(app), {"type": "session.start", "session": {}}, "session.input_audio.append"))
        message = lambda: json.dumps({"type": append, "audio": base64.b64encode(frames.tobytes()).decode()})  # noqa: E731
    async with ws_connect(url, sock=sock, additional_headers={"Authorization": f"Bearer {KEY}"}, max_queue=1) as ws:
        if start is not None:
            await ws.send(json.dumps(start))
        await until(lambda: app.status()["slots_live"] == 1, 30, "the call to go live")
        started = time.monotonic()

        async def keep_talking():  # it keeps sending, it just never reads
            while True:
                await ws.send(message())
                await asyncio.sleep(0.08)

        talking = asyncio.create_task(keep_talking())
        try:
            await until(lambda: app.status()[door]["errors"].get("client_not_reading"), 60,
                        "the server to give up on the client")
        finally:
            talking.cancel()
        assert time.monotonic() - started < 60
    await until(lambda: room_is_empty(app), 3.0, "its slot")


# ---- the GPT-Live door (/v1/live/sessions) ----------------------------------------------------


def live_url(app: LaunchedApp) -> str:
    return app.base_url.replace("http", "ws", 1) + "/v1/live/sessions"


async def test_a_gpt_live_session_streams_every_frame_and_closes_with_its_reason(app, speech):
    async with ws_connect(live_url(app), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        client = LiveClient(ws)
        await client.send({"type": "session.start", "event_id": "start_1", "session": {
            "model": "gpt-live-1", "instructions": "You are a calm radio host.",
            "audio": {"format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "NATM2"}},
            "delegation": {"type": "responses", "responses": {"model": "gpt-5.6-luna"}},
            "personaplex": {"room_events": True}}})
        started = await client.wait("session.started")
        assert started["client_event_id"] == "start_1"
        assert started["session"]["audio"]["output"]["voice"] == "NATM2"
        assert "delegation" in started["session"]["personaplex"]["ignored"]
        await client.wait("personaplex.live", timeout=30)
        await until(lambda: app.status()["calls_by_door"].get("live") == 1, 3, "the call in the room's figures")
        live_at = time.monotonic()
        for k in range(0, speech.size, 2400):  # 100 ms appends in real time, as LiveKit sends them
            await client.send(pcm_event(speech[k:k + 2400]))
            await asyncio.sleep(max(0.0, live_at + (k + 2400) / 24000 - time.monotonic()))
        seen = len(client.events)
        await client.send({"type": "session.input_audio.mute", "event_id": "m1"})
        assert (await client.wait("session.input_audio.muted", after=seen))["client_event_id"] == "m1"
        await client.send({"type": "session.commentary.append", "event_id": "c1", "content": "Greet them."})
        assert (await client.wait("session.commentary.appended", after=seen))["client_event_id"] == "c1"
        await asyncio.sleep(1.0)
        seen = len(client.events)
        await client.send({"type": "session.close", "event_id": "close_1"})
        closed = await client.wait("session.closed", after=seen)
        assert closed["reason"] == "close_requested" and closed["client_event_id"] == "close_1"
        await asyncio.wait_for(client.closed.wait(), 5)
        assert ws.close_code == 1000

    # A delta for every frame the room made, silence included, on one timeline with the text.
    elapsed = time.monotonic() - live_at
    deltas = client.of("session.output_audio.delta")
    pcm = [np.frombuffer(base64.b64decode(d["delta"]), "<i2") for d in deltas]
    assert all(p.size == 1920 for p in pcm)
    assert len(deltas) >= real_time_share(app) * (elapsed - 1.0) / 0.08
    words = client.of("session.output_transcript.delta")
    assert words and all(isinstance(w["start_ms"], int) and w["end_ms"] == w["start_ms"] + 80 for w in words)
    assert all(np.any(pcm[w["start_ms"] // 80]) for w in words), "text over silence"
    assert all(not p.any() or np.sqrt(np.mean(p.astype(float) ** 2)) > 300 for p in pcm), "faint hiss not zeroed"
    usage = client.of("session.usage.updated")
    assert usage and usage[-1]["usage"]["seconds"] > 1.0
    assert not client.of("error")
    await until(lambda: room_is_empty(app), 3.0, "the socket's slot")
    status = app.status()
    assert status["calls_started_by_door"].get("live", 0) >= 1 and status["live"]["sockets_open"] == 0
    assert "You are a calm radio host." in app.log_text()
    metrics = app.metrics()
    assert "personaplex_live_sockets 0.0" in metrics
    assert re.search(r'personaplex_calls_started_by_door_total\{door="live"\} [1-9]', metrics), metrics[:2000]


async def test_hostile_input_on_the_gpt_live_door(app):
    with pytest.raises(InvalidStatus) as refused:
        async with ws_connect(live_url(app), additional_headers={"Authorization": "Bearer wrong"}):
            pass
    assert refused.value.response.status_code == 401
    async with ws_connect(live_url(app), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        client = LiveClient(ws)
        assert (await client.error("{not json"))["code"] == "invalid_json"
        assert (await client.error({"type": "input_audio_buffer.append"}))["code"] == "unknown_event"
        assert (await client.error(pcm_event(SILENCE)))["code"] == "session_not_started"
        bad_format = {"type": "session.start", "session": {"audio": {"format": {"type": "audio/pcmu"}}}}
        assert (await client.error(bad_format))["code"] == "unsupported_audio_format"
        unknown_voice = {"type": "session.start", "event_id": "s0",
                         "session": {"audio": {"output": {"voice": "robot"}}}}
        error = await client.error(unknown_voice)
        assert error["code"] == "unknown_voice" and error["client_event_id"] == "s0"
        assert (await client.error("[" * 100_000))["code"] == "invalid_json"
        too_big = json.dumps({"type": "session.input_audio.append", "audio": "A" * (1 << 20)})
        assert (await client.error(too_big))["code"] == "message_too_large"
        await client.send({"type": "session.start", "session": {"instructions": "You are terse."}})
        await client.wait("session.started")
        # Audio is decoded once the call is live (while it is prepared nothing is decoded): its first
        # output says so.
        await client.wait("session.output_audio.delta", timeout=30.0)
        assert (await client.error({"type": "session.input_audio.append", "audio": "@@"}))["code"] == "invalid_base64"
        assert (await client.error({"type": "session.start", "session": {}}))["code"] == "session_already_started"
        assert not client.closed.is_set()  # every error left the socket usable
    await until(lambda: room_is_empty(app), 3.0, "the socket's slot")
    for code in ("invalid_json", "unknown_event", "session_not_started", "unsupported_audio_format",
                 "message_too_large", "invalid_base64", "session_already_started"):
        assert app.status()["live"]["errors"].get(code, 0) >= 1, code


# ---- NVIDIA's protocol (/api/chat) -------------------------------------------------------------


def chat_url(app: LaunchedApp, **query: str) -> str:
    from urllib.parse import urlencode

    return app.base_url.replace("http", "ws", 1) + "/api/chat?" + urlencode(query)


async def test_a_reference_client_gets_the_handshake_when_live_then_ogg_opus_and_text(app, speech):
    assert httpx.get(app.base_url + "/api/voices").json()["count"] == 18
    url = chat_url(app, voice_prompt="VARM2.pt", text_prompt="You are a keen astronomer.", seed="7",
                   api_key=KEY, room_events="1")
    async with ws_connect(url) as ws:
        client = ChatClient(ws)
        await until(lambda: client.handshake_at is not None, 30, "the handshake")
        # Nothing came before it but the room's news (asked for), and the handshake came once.
        kinds = [m[:1] for _, m in client.messages if m[:1] != b"\x04"]
        assert kinds[0] == b"\x00" and kinds.count(b"\x00") == 1
        assert [e["type"] for e in client.events()][-1] == "personaplex.live"
        await client.stream(np.concatenate([speech, SILENCE, SILENCE]))
        elapsed = time.monotonic() - client.handshake_at
        assert client.audio_seconds() >= real_time_share(app) * (elapsed - 1.0)
        pages = [m[1:] for _, m in client.messages if m[:1] == b"\x01"]
        assert pages[0].startswith(b"OggS") and all(p.startswith(b"OggS") for p in pages)
        assert client.text.strip()
        assert app.status()["calls_by_door"].get("chat") == 1
    await until(lambda: room_is_empty(app), 3.0, "the socket's slot")
    assert "voice VARM2, persona 'You are a keen astronomer.'" in app.log_text()
    status = app.status()
    assert status["calls_started_by_door"].get("chat", 0) >= 1 and status["chat"]["sockets_open"] == 0
    assert "personaplex_chat_sockets 0.0" in app.metrics()


async def test_bad_input_at_api_chat_closes_with_its_reason_and_no_other_caller_notices(app, speech):
    refusals = [  # (query, what the first message then the close say)
        ({"voice_prompt": "ROBOT.pt", "api_key": KEY}, "unknown voice_prompt"),
        ({"text_prompt": "word " * 700, "api_key": KEY}, "too long"),
        ({"seed": "many", "api_key": KEY}, "bad seed"),
    ]
    slots_free = app.status()["slots_free"]
    for query, words in refusals:
        async with ws_connect(chat_url(app, **query)) as ws:
            first = await asyncio.wait_for(ws.recv(), 5)
            assert first[:1] == b"\x05" and words in first[1:].decode()
            await asyncio.wait_for(ws.wait_closed(), 5)
            assert ws.close_code == 1008 and words in ws.close_reason
    with pytest.raises(InvalidStatus) as refused:
        async with ws_connect(chat_url(app, voice_prompt="NATF2.pt")):
            pass
    assert refused.value.response.status_code == 401  # --api-key without --chat-without-key
    assert app.status()["slots_free"] == slots_free  # none of them took a slot

    async with ws_connect(chat_url(app, api_key=KEY, text_prompt="You enjoy a good conversation.")) as talker_ws:
        talker = ChatClient(talker_ws)
        await until(lambda: talker.handshake_at is not None, 30, "the talker's handshake")
        talking = asyncio.create_task(talker.stream(np.concatenate([speech, speech])))
        await asyncio.sleep(2.0)
        calm = (talker.handshake_at + 0.5, time.monotonic())
        barrage_start = time.monotonic()
        junk = np.random.default_rng(3).integers(-20000, 20000, 24000).astype(np.int16)
        attacks = [  # (what the rogue does once live, the close code, words of the reason)
            (lambda c: c.ws.send(b"\x07hello"), 1003, "kind 7"),
            (lambda c: c.ws.send("text, not bytes"), 1003, "binary"),
            (lambda c: c.ws.send(b"\x01" + junk.tobytes()), 1007, "not an Ogg Opus stream"),
            (truncated_then_more, 1007, "not an Ogg Opus stream"),
            (lambda c: c.stream(np.zeros(24000 * 8, np.int16), pace=50.0), 1008, "faster than real time"),
        ]
        for attack, code, words in attacks:
            async with ws_connect(chat_url(app, api_key=KEY)) as ws:
                rogue = ChatClient(ws)
                await until(lambda r=rogue: r.handshake_at is not None, 30, "the rogue's handshake")
                with contextlib.suppress(ConnectionClosed):
                    await attack(rogue)
                await asyncio.wait_for(rogue.closed.wait(), 10)
                assert ws.close_code == code and words in ws.close_reason, (ws.close_code, ws.close_reason)
                assert any(m[:1] == b"\x05" and words in m[1:].decode() for _, m in rogue.messages)
        await talking
        barrage = (barrage_start, time.monotonic())
        calm_rate = talker.audio_seconds(*calm) / (calm[1] - calm[0])
        barrage_rate = talker.audio_seconds(*barrage) / (barrage[1] - barrage[0])
        assert barrage_rate >= min(real_time_share(app), calm_rate - 0.1), (calm_rate, barrage_rate)
        arrivals = [at for at, _ in talker.audio if barrage[0] <= at <= barrage[1]]
        assert max(np.diff(arrivals)) < 1.0, "the talker's audio stalled during the barrage"
        assert not talker.closed.is_set()
    await until(lambda: room_is_empty(app), 3.0, "every slot")
    errors = app.status()["chat"]["errors"]
    assert errors.get("1003", 0) >= 2 and errors.get("1007", 0) >= 2 and errors.get("1008", 0) >= 1


async def truncated_then_more(client: ChatClient) -> None:
    """Half an Ogg page, then a whole one: the stream no longer parses."""
    page = client.opus_out.append_pcm(np.zeros(1920, np.float32))
    page += client.opus_out.append_pcm(np.zeros(1920, np.float32))
    await client.ws.send(b"\x01" + page[:len(page) // 2])
    await client.ws.send(b"\x01" + client.opus_out.append_pcm(np.zeros(1920, np.float32)))
