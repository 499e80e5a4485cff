"""The phone door (docs/phone.md) as a phone network uses it: Twilio's signed voice webhook, its
TwiML, and Media Streams' events in real time (tests/phone_network.py, written from Twilio's
documented messages; the `twilio` package signs), against the app launched as a user starts it,
beside an aiortc caller that drives the page's own Gradio events."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
from websockets.exceptions import InvalidStatus

from .browser_support import LaunchedApp, launched_app
from .callers import PageCaller, PageConfig, until
from .phone_network import PhoneStream, Twiml, caller_voice, linear, place_call

pytestmark = pytest.mark.usefixtures("loopback_ice")

TOKEN = "phone-test-auth-token"
PERSONA = "You work for a bank and help callers with their accounts."


@pytest.fixture(scope="module")
def app(tiny_cache_dir, tmp_path_factory) -> LaunchedApp:
    with launched_app(tmp_path_factory.mktemp("app"), tiny_cache_dir, args=["--slots", "2", "--admission", "slots"],
                      env={"TWILIO_AUTH_TOKEN": TOKEN}) as launched:
        yield launched
        log = launched.log_text()
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


@pytest.fixture(autouse=True)
def empty_room(app) -> None:
    app.wait_empty()


def webhook(app: LaunchedApp, **query: str) -> str:
    return str(httpx.URL(app.base_url + "/telephony/twilio", params=query or None))


def real_time_share(app: LaunchedApp) -> float:
    """0.95 of real time on a host whose engine ticks in real time, less on one that cannot."""
    status = app.status()
    return 0.95 if status["realtime_factor"] < 0.9 and status["resyncs"] == 0 else 0.5


async def call(http: httpx.AsyncClient, app: LaunchedApp, voice: str = "NATM1") -> PhoneStream:
    twiml = await place_call(http, webhook(app, voice=voice, persona=PERSONA), TOKEN)
    assert twiml.status == 200, twiml.text
    stream = PhoneStream(twiml)
    await stream.open()
    return stream


async def test_the_webhook_connects_a_signed_call_and_refuses_the_rest(app):
    async with httpx.AsyncClient(timeout=10) as http:
        twiml = await place_call(http, webhook(app, voice="NATM1", persona=PERSONA), TOKEN)
        assert twiml.status == 200 and "<Connect><Stream" in twiml.text
        assert twiml.stream_url.startswith(app.base_url.replace("http", "ws", 1) + "/telephony/twilio/stream/")
        assert twiml.parameters == {"voice": "NATM1"}  # the persona stays with the ticket, on the server
        # A persona by the name of one of the page's presets.
        preset = await place_call(http, webhook(app, voice="VARF1", preset="Customer service: restaurant"), TOKEN)
        assert preset.status == 200 and preset.parameters == {"voice": "VARF1", "preset": "Customer service: restaurant"}
        # Behind a proxy: Twilio signed the public https URL, and streams to wss on that host.
        public = "https://phone.example.org/telephony/twilio?voice=NATM1"
        proxied = await place_call(http, webhook(app, voice="NATM1"), TOKEN, public_url=public,
                                   headers={"X-Forwarded-Proto": "https", "X-Forwarded-Host": "phone.example.org"})
        assert proxied.status == 200 and proxied.stream_url.startswith("wss://phone.example.org/telephony/twilio/stream/")
        # Signed with a webhook shared key: not the auth token's signature, refused with the reason.
        shared = await place_call(http, url := webhook(app, voice="NATM1"), TOKEN,
                                  headers={"X-Twilio-Webhooks-Signature-Settings": "key=k1,algorithm=HMAC_SHA256"})
        assert shared.status == 403 and "shared-key" in shared.text
        # Signed with another account's token, not signed, or signed for another URL.
        for bad in (await place_call(http, url, "another-token"), await place_call(http, url, None),
                    await place_call(http, url, TOKEN, signature=twiml_signature_for(webhook(app), TOKEN))):
            assert bad.status == 403 and "X-Twilio-Signature" in bad.text and bad.stream_url is None
        # A number set up with a voice or a persona the room cannot take: refused before any slot.
        unknown = await place_call(http, webhook(app, voice="NOBODY"), TOKEN)
        assert unknown.status == 400 and "unknown voice 'NOBODY'" in unknown.text
        no_such = await place_call(http, webhook(app, preset="Nobody's persona"), TOKEN)
        assert no_such.status == 400 and "unknown preset" in no_such.text
        long = await place_call(http, webhook(app, persona="talk " * 1000), TOKEN)  # 5000 characters
        assert long.status == 400 and "persona" in long.text
        # The stream socket: only with the URL a signed webhook answered, and only once.
        made_up = Twiml(200, "", twiml.stream_url.rsplit("/", 1)[0] + "/not-a-ticket")
        for twiml_used in (made_up, twiml):
            if twiml_used is twiml:
                async with PhoneStream(twiml) as first:
                    await until(lambda: "live" in first.mark_names(), 30, "the first use to go live")
            with pytest.raises(InvalidStatus) as info:
                await PhoneStream(twiml_used).open()
            assert info.value.response.status_code == 403
    status = app.status()["twilio"]
    assert status["refused"]["signature"] >= 4 and status["refused"]["bad_request"] >= 3
    assert status["refused"]["ticket"] >= 2 and status["api_key_required"] is False


def twiml_signature_for(url: str, token: str) -> str:
    from twilio.request_validator import RequestValidator

    return RequestValidator(token).compute_signature(url, {"CallSid": "CA0"})


async def test_two_calls_talk_in_real_time_and_a_third_waits_with_a_tone_until_a_slot_frees(app):
    async with httpx.AsyncClient(timeout=10) as http:
        first, second = await call(http, app, "NATM1"), await call(http, app, "VARF2")
        talking = [asyncio.create_task(s.talk(caller_voice(3.0, seed), 60)) for seed, s in enumerate((first, second))]
        try:
            await until(lambda: "live" in first.mark_names() and "live" in second.mark_names(), 60,
                        "both calls to go live")
            # Each hears the agent in real time: 8000 mu-law bytes a second.
            await asyncio.sleep(1.0)
            start = time.monotonic()
            await asyncio.sleep(4.0)
            elapsed = time.monotonic() - start
            for stream in (first, second):
                share = stream.heard_since(start) / 8000 / elapsed
                assert share >= real_time_share(app), f"{share:.2f} s of agent audio a second"
            assert np.abs(linear(bytes(first.heard[-8000:]))).max() > 0

            # A third call waits with a sound and a true place.
            third = await call(http, app, "NATF0")
            await until(lambda: "queue-1" in third.mark_names(), 10, "the third call's place")
            await until(lambda: app.status()["queue_length"] == 1 and app.status()["calls_by_door"] == {"twilio": 3},
                        3, lambda: f"the room's figures ({app.status()['calls_by_door']})")
            waiting_since = time.monotonic()
            await asyncio.sleep(2.5)
            waited = time.monotonic() - waiting_since
            tone = linear(bytes(third.heard))
            assert np.abs(tone).max() > 500, "the waiting caller hears a tone"
            # ...paced as it plays: never more than real time (plus the step it sends at once).
            assert third.heard_since(waiting_since) <= 8000 * (waited + 0.2)
            assert third.heard_since(waiting_since) >= 8000 * waited * 0.5
            metrics = app.metrics()
            assert 'personaplex_calls{door="twilio"} 3.0' in metrics and "personaplex_twilio_sockets 3.0" in metrics

            # The caller at the front hangs up: their slot goes to the one who waited.
            await first.stop()
            await first.wait_closed(3)
            await until(lambda: "live" in third.mark_names(), 30, "the third call to be seated")
            seated = third.mark_time("live")
            await until(lambda: third.heard_since(seated) >= 4000, 10, "the agent's voice on the third call")
            assert first.close_code == 1000
        finally:
            for task in talking:
                task.cancel()
        stopped = time.monotonic()
        await second.stop()
        await third.stop()
        # Both slots free within a second of the stops (the room's figures are half a second old at most).
        await until(lambda: app.status()["slots_free"] == 2, 1.0, "the slots freed")
        assert time.monotonic() - stopped < 1.0
        for stream in (second, third):
            await stream.hang_up()
    assert app.status()["calls_started_by_door"]["twilio"] >= 3


async def test_phone_calls_and_a_page_caller_share_one_queue_in_order(app):
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
        page = PageCaller(http, await PageConfig.fetch(http), "NATF2", "You work for a bank.", seed=3)
        await page.offer(300.0)
        await page.wait_connected()
        await until(lambda: page.status.startswith("Live"), 60, "the page caller live")
        first = await call(http, app)
        await until(lambda: "live" in first.mark_names(), 60, "the first phone call live")
        waiting = [await call(http, app, "VARM0"), await call(http, app, "NATF1")]
        await until(lambda: "queue-1" in waiting[0].mark_names() and "queue-2" in waiting[1].mark_names(), 10,
                    lambda: f"places 1 and 2 ({waiting[0].mark_names()}, {waiting[1].mark_names()})")
        await until(lambda: app.status()["calls_by_door"] == {"page": 1, "twilio": 3}, 3, "the room's figures")
        # The page caller leaves: the first in line is seated, the second moves up.
        await page.hang_up()
        await until(lambda: "live" in waiting[0].mark_names(), 30, "the first in line seated")
        await until(lambda: "queue-1" in waiting[1].mark_names(), 5, "the second in line moved up")
        assert "live" not in waiting[1].mark_names()
        await first.stop()
        await until(lambda: "live" in waiting[1].mark_names(), 30, "the second in line seated")
        for stream in (first, *waiting):
            await stream.hang_up()
    await until(app.room_empty, 3, "an empty room")


BAD_INPUT = [
    ("media before start", lambda s: s.media(b"\xff" * 160), False, 1008),
    ("not JSON", lambda s: s.send_raw("{not json"), True, 1007),
    ("a binary message", lambda s: s.send_raw(b"\x00\x01"), True, 1003),
    ("invalid base64", lambda s: s.send({"event": "media", "media": {"payload": "@@@not base64"}}), True, 1007),
    ("an oversize payload", lambda s: s.media(b"\xff" * 40000), True, 1008),
    ("another media format", lambda s: s.start({"encoding": "audio/l16", "sampleRate": 16000, "channels": 1}),
     False, 1008),
    ("a media format that is not one", lambda s: s.start({"encoding": "audio/x-mulaw", "sampleRate": "fast"}),
     False, 1008),
]


@pytest.mark.parametrize(("what", "send", "started", "code"), BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
async def test_bad_input_ends_that_call_with_a_reason_and_no_other(app, what, send, started, code):
    async with httpx.AsyncClient(timeout=10) as http:
        bystander = await call(http, app)
        talking = asyncio.create_task(bystander.talk(caller_voice(2.0), 30))
        try:
            await until(lambda: "live" in bystander.mark_names(), 60, "the bystander live")
            twiml = await place_call(http, webhook(app, voice="NATF3"), TOKEN)
            bad = PhoneStream(twiml)
            await bad.open(start=started)
            if started:
                await until(lambda: bad.mark_names(), 30, "the call placed")
            await send(bad)
            close_code, reason = await bad.wait_closed(10)
            assert close_code == code, (close_code, reason)
            assert reason
            # The bystander still hears the agent in real time, and its slot is its own.
            at = time.monotonic()
            await asyncio.sleep(1.5)
            assert bystander.heard_since(at) / 8000 / (time.monotonic() - at) >= real_time_share(app) * 0.9
            await until(lambda: app.status()["calls_by_door"] == {"twilio": 1}, 3, "the bad call gone")
        finally:
            talking.cancel()
            await bystander.hang_up()


async def test_unknown_events_are_passed_over_and_a_stop_while_preparing_frees_the_slot(app):
    async with httpx.AsyncClient(timeout=10) as http:
        stream = await call(http, app)
        await stream.send({"event": "transcription", "transcription": {"text": "hi"}})  # not ours: passed over
        await stream.send({"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": "5"}})
        await until(lambda: "live" in stream.mark_names(), 60, "the call live")
        await stream.talk(caller_voice(1.0), 1.0)
        assert stream.close_code is None and len(stream.heard) > 0
        await stream.hang_up()
        # A stop right after the start, while the slot is being prepared.
        for _ in range(3):
            quick = PhoneStream(await place_call(http, webhook(app, voice="VARF0"), TOKEN))
            await quick.open()
            await quick.stop()
            await quick.wait_closed(5)
        await until(app.room_empty, 3, "every slot free")
    assert app.status()["twilio"]["errors"].get("unknown_event", 0) >= 1


async def test_a_phone_stream_that_stops_reading_is_ended_and_its_slot_freed(app):
    import socket

    async with httpx.AsyncClient(timeout=10) as http:
        twiml = await place_call(http, webhook(app), TOKEN)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = app.base_url.removeprefix("http://").split(":")
        sock.connect((host, int(port)))
        stream = PhoneStream(twiml)
        await stream.open(read=False, sock=sock, max_queue=1)
        talking = asyncio.create_task(stream.talk(caller_voice(1.0), 120))
        try:
            await until(lambda: app.status()["slots_live"] == 1, 30, "the call live")
            await until(lambda: app.status()["twilio"]["errors"].get("client_not_reading"), 90,
                        "the server to give up on the stream")
        finally:
            talking.cancel()
            sock.close()
    await until(app.room_empty, 3, "its slot")


async def test_the_rooms_wait_limit_releases_a_waiting_phone_call_with_its_reason(tiny_cache_dir, tmp_path):
    with launched_app(tmp_path, tiny_cache_dir, args=["--slots", "1", "--admission", "slots", "--max-wait", "2"],
                      env={"TWILIO_AUTH_TOKEN": TOKEN}) as small:
        async with httpx.AsyncClient(timeout=10) as http:
            seated = await call(http, small)
            await until(lambda: "live" in seated.mark_names(), 60, "the first call live")
            waiting = await call(http, small, "VARM2")
            await until(lambda: "queue-1" in waiting.mark_names(), 10, "the second call waiting")
            code, reason = await waiting.wait_closed(15)
            assert code == 1013 and reason.startswith("Still no place in the room"), (code, reason)
            assert len(waiting.heard) > 0  # it heard the hold tone until then
            await seated.hang_up()
        await until(small.room_empty, 3, "an empty room")
        ended = small.status()["calls_ended"]
        assert ended.get("queue_timeout") == 1, ended


async def test_a_phone_call_without_media_workers_is_served_by_the_main_process(tiny_cache_dir, tmp_path):
    with launched_app(tmp_path, tiny_cache_dir, args=["--slots", "1", "--admission", "slots", "--media-workers", "0"],
                      env={"TWILIO_AUTH_TOKEN": TOKEN}) as embedded:
        assert embedded.status()["media_workers"] == []
        async with httpx.AsyncClient(timeout=10) as http:
            stream = await call(http, embedded, "VARF3")
            talking = asyncio.create_task(stream.talk(caller_voice(2.0), 30))
            try:
                await until(lambda: "live" in stream.mark_names(), 60, "the call live")
                at = time.monotonic()
                await until(lambda: stream.heard_since(at) >= 8000, 10, "a second of the agent's voice")
                assert embedded.status()["calls_by_door"] == {"twilio": 1}
            finally:
                talking.cancel()
                await stream.hang_up()
        await until(embedded.room_empty, 3, "an empty room")
        assert "phone (voice VARF3) socket" in embedded.log_text()
