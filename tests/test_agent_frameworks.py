"""The agent frameworks that people build voice agents with, on the app as their users run them:
pipecat 1.14 and LiveKit Agents 1.8, each in its own virtual environment (tests/framework_clients.py),
on the Realtime door (pipecat's OpenAIRealtimeLLMService with its example context, LiveKit's
RealtimeModel driven by an AgentSession), on the GPT-Live door (pipecat's OpenAILiveLLMService,
LiveKit's GPTLiveModel in its duplex adapter) and on /api/chat, NVIDIA's protocol (LiveKit's
PersonaPlex plugin, made for NVIDIA's server). Each call gets a persona, streams 9 s of espeak-ng
speech in real time with a barge-in in the middle, and must come through with the persona
applied, agent audio for at least 90 % of the streamed time (less only on a host that cannot tick
in real time), audio after the barge-in, and no error: none logged by the framework, no `error`
event from the door, no ERROR in the app's log (docs/realtime.md)."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import subprocess

import httpx
import numpy as np
import pytest
import soundfile
from websockets.asyncio.client import connect as ws_connect

from .browser_support import LaunchedApp, launched_app, missing_tools, require
from .callers import PageCaller, PageConfig, until
from .framework_clients import CLIENTS, client_python, run_client
from .sdk_callers import ChatClient, speech_pcm

pytestmark = [pytest.mark.usefixtures("loopback_ice"), pytest.mark.slow]

KEY = "frameworks-test-key"
RATE = 24000
BARGE_IN_AT = 6.0  # s into the caller's audio: the second sentence, over the agent's speech
SPEECH_SECONDS = 9.0


@pytest.fixture(scope="module")
def app(tiny_cache_dir, tmp_path_factory) -> LaunchedApp:
    # LiveKit's PersonaPlex plugin builds its URL itself and can send no key: /api/chat is opened
    # without one, as its users must.
    args = ["--slots", "4", "--admission", "slots", "--api-key", KEY, "--chat-without-key"]
    with launched_app(tmp_path_factory.mktemp("app"), tiny_cache_dir, args=args) as launched:
        yield launched


@pytest.fixture(autouse=True)
def empty_room(request) -> None:
    """Each test of the shared app starts from an empty room, whatever the one before left."""
    if "app" in request.fixturenames:
        request.getfixturevalue("app").wait_empty()


@pytest.fixture(scope="module")
def speech_wav(tmp_path_factory):
    """A caller who asks something, pauses while the agent talks, and cuts in at BARGE_IN_AT."""
    require([t for t in missing_tools() if t in ("espeak-ng", "sox")], "apt-get install -y espeak-ng sox")
    folder = tmp_path_factory.mktemp("speech")
    first = speech_pcm(folder, "Hello there. Can you tell me about the weather on Mars today?")
    second = speech_pcm(folder, "Wait, sorry to cut in. What about Venus?")
    pcm = np.zeros(int(SPEECH_SECONDS * RATE), np.int16)
    pcm[RATE:RATE + first.size] = first[:int(BARGE_IN_AT * RATE) - RATE]
    cut_in = int(BARGE_IN_AT * RATE)
    pcm[cut_in:cut_in + second.size] = second[:pcm.size - cut_in]
    path = folder / "caller.wav"
    soundfile.write(path, pcm, RATE, subtype="PCM_16")
    return path


def call_settings(app: LaunchedApp) -> list[tuple[str, str]]:
    """The voice and persona of every API call the room placed, as the app logged them."""
    return [(voice, ast.literal_eval(persona)) for voice, persona in re.findall(
        r"call \w+ \(\w+\), voice (\w+), persona ('.*?'|\".*?\")$", app.log_text(), re.MULTILINE)]


CASES = [("pipecat", "realtime"), ("livekit", "realtime"), ("pipecat", "live"), ("livekit", "live"),
         ("livekit", "chat")]


@pytest.mark.timeout(900)  # the first run builds the framework's environment
@pytest.mark.parametrize(("framework", "protocol"), CASES, ids=[f"{f}-{p}" for f, p in CASES])
def test_a_framework_agent_gets_its_persona_and_survives_a_barge_in(app, speech_wav, tmp_path, framework, protocol):
    door = protocol
    errors_before = dict(app.status()[door]["errors"])
    persona = f"You are Ada, a cheerful guide, speaking through {framework} on the {protocol} door."
    base = app.base_url.replace("http", "ws", 1)
    url = {("pipecat", "realtime"): f"{base}/v1/realtime", ("pipecat", "live"): f"{base}/v1/live/sessions",
           ("livekit", "chat"): app.base_url.removeprefix("http://")}.get(  # the plugin's "HOST:PORT"
        (framework, protocol), f"{app.base_url}/v1")  # LiveKit's OpenAI models take the API's base URL
    result = run_client(framework, ["--protocol", protocol, "--url", url, "--key", KEY, "--persona", persona,
                                    "--voice", "NATM1",
                                    "--speech", str(speech_wav), "--barge-at", str(BARGE_IN_AT)],
                        timeout=180, log_path=tmp_path / f"{framework}-{protocol}.log")

    assert result["errors"] == [], f"{framework} logged errors: {result['errors']}"
    assert app.status()[door]["errors"] == errors_before, "the door sent error events"
    # The voice and persona the call got: pipecat's example context ("Say hello!", a developer line) and
    # LiveKit's (the same line in the Agent's chat context) join it on the Realtime door, where
    # they come as items before the call starts; on GPT-Live pipecat sends its line as
    # commentary after the start, which the model cannot hear; /api/chat has no context.
    expected = persona + "\nSay hello!" if protocol == "realtime" else persona
    assert ("NATM1", expected) in call_settings(app)
    status = app.status()
    share = 0.9 if status["realtime_factor"] < 0.9 and status["resyncs"] == 0 else 0.5
    assert result["agent_seconds"] >= share * SPEECH_SECONDS, result
    assert result["after_barge_in"] >= 1.0, f"no agent audio after the barge-in: {result}"
    if (framework, protocol) == ("pipecat", "realtime"):
        assert result["interruptions"] >= 1, "the door's speech events never interrupted pipecat"
    if (framework, protocol) == ("livekit", "realtime"):
        assert result["user_turns"] >= 1, "the door's speech events never reached the AgentSession"
    if protocol == "chat":
        assert result["text"].strip(), "no transcript text reached the plugin"
    assert " ERROR " not in app.log_text()


@pytest.mark.timeout(900)
async def test_two_personaplex_plugin_sessions_fill_two_slots_and_a_page_caller_waits_its_turn(
        tiny_cache_dir, tmp_path, speech_wav):
    """At --slots 2: two sessions of LiveKit's PersonaPlex plugin are live, a page caller waits as
    number 1, and gets in when the shorter session hangs up."""
    python = client_python("livekit")
    args = ["--slots", "2", "--admission", "slots"]
    with launched_app(tmp_path / "app", tiny_cache_dir, args=args) as app:
        host = app.base_url.removeprefix("http://")
        plugins = [subprocess.Popen([str(python), str(CLIENTS / "livekit_agent.py"), "--protocol", "chat", "--url",
                                     host, "--key", "none", "--persona", f"You are guide number {n}.",
                                     "--speech", str(speech_wav), "--barge-at", str(BARGE_IN_AT),
                                     "--tail", str(tail)], cwd=CLIENTS, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
                   for n, tail in ((1, 0.0), (2, 12.0))]
        try:
            await until(lambda: app.status()["slots_live"] == 2, 60, "both plugin sessions live")
            async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
                page = await PageConfig.fetch(http)
                caller = PageCaller(http, page, "NATF1", "You enjoy a good conversation.", seed=1)
                await caller.offer(330.0)
                await caller.wait_connected()
                await until(lambda: "you are number 1 in the queue" in caller.status, 20, "the page's place")
                # A client of the reference's byte protocol behind them: its place as kind-4 news (it
                # asked), and no handshake while it waits.
                raw_url = app.base_url.replace("http", "ws", 1) + "/api/chat?voice_prompt=NATM3.pt&room_events=1"
                async with ws_connect(raw_url) as raw_ws:
                    raw = ChatClient(raw_ws)
                    await until(lambda: any(e.get("position") == 2 for e in raw.events()), 10, "its place, 2")
                    await until(lambda: app.status()["calls_by_door"] == {"chat": 3, "page": 1}, 3,
                                lambda: f"every caller in the room's figures ({app.status()['calls_by_door']})")
                    # The shorter session ends (waited for off the loop, where the page's peer lives):
                    # its slot goes to the head of the queue, the page caller.
                    assert await asyncio.to_thread(plugins[0].wait, 60) == 0
                    await until(lambda: caller.status.startswith("Live"), 30,
                                   lambda: f"the page caller seated ({app.status()['calls_by_door']}, "
                                           f"{caller.status!r})")
                    await until(lambda: any(e.get("position") == 1 for e in raw.events()), 10, "its place, 1")
                    assert raw.handshake_at is None
                await caller.hang_up()
            assert await asyncio.to_thread(plugins[1].wait, 60) == 0
            for plugin in plugins:
                result = json.loads(plugin.stdout.read().strip().splitlines()[-1].removeprefix("RESULT "))
                assert result["errors"] == [] and result["agent_seconds"] > 0
        finally:
            for plugin in plugins:
                plugin.kill()
        await asyncio.sleep(0)
