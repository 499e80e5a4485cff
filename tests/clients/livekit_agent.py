"""A LiveKit Agents 1.8 voice agent on the app, without a LiveKit room.

`--protocol realtime`: `AgentSession(llm=openai.realtime.RealtimeModel(base_url=...))` started with
`Agent(instructions=PERSONA)` and a chat context holding the developer line "Say hello!", its
microphone a WAV at real-time pace and its speaker an AudioOutput that plays in real time (and
reports what it played when LiveKit clears it on a barge-in, as a room's track does).
`--protocol live`: `openai.realtime.GPTLiveModel(base_url=...)` in `llm.DuplexRealtimeAdapter`, its
session configured as AgentSession configures it.
`--protocol chat`: the PersonaPlex plugin made for NVIDIA's server
(`livekit.plugins.nvidia.experimental.realtime.RealtimeModel(base_url="HOST:PORT", ...)`) on /api/chat.

Runs in LiveKit's own virtual environment (tests/test_agent_frameworks.py). Prints one RESULT line:
the agent audio it got, after the barge-in too, and every ERROR logged (any logger).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import sys
import time

import numpy as np
from common import CHUNK, RATE, AgentAudio, Clock, arguments, read_speech, report
from livekit import rtc
from livekit.agents import Agent, AgentSession, ChatContext, llm
from livekit.agents.voice import io
from livekit.plugins import openai


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}"[:500])


class Microphone(io.AudioInput):
    def __init__(self, pcm: np.ndarray, clock: Clock) -> None:
        super().__init__(label="wav")
        self.pcm, self.clock, self.k = pcm, clock, 0

    async def __anext__(self) -> rtc.AudioFrame:
        if self.clock.t0 is None:
            self.clock.start()
        await asyncio.sleep(self.clock.wait(self.k))
        chunk = self.pcm[self.k * CHUNK:(self.k + 1) * CHUNK]
        chunk = np.concatenate([chunk, np.zeros(CHUNK - chunk.size, np.int16)])  # a microphone never ends
        self.k += 1
        return rtc.AudioFrame(data=chunk.tobytes(), sample_rate=RATE, num_channels=1, samples_per_channel=CHUNK)


class Speaker(io.AudioOutput):
    """Plays in real time; a clear stops it and reports how far it got."""

    def __init__(self, audio: AgentAudio) -> None:
        super().__init__(label="speaker", next_in_chain=None, sample_rate=RATE,
                         capabilities=io.AudioOutputCapabilities(pause=False))
        self.audio = audio
        self._playing, self._pushed, self._ends_at, self._finish = False, 0.0, 0.0, None

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        now = time.time()
        if not self._playing:
            self._playing, self._pushed, self._ends_at = True, 0.0, now
            self.on_playback_started(created_at=now)
        self._ends_at = max(self._ends_at, now) + frame.duration
        self._pushed += frame.duration
        self.audio.add(bytes(frame.data))

    def flush(self) -> None:
        super().flush()
        if self._playing:
            self._finish = asyncio.get_running_loop().call_later(max(0.0, self._ends_at - time.time()),
                                                                 self._done, False)

    def clear_buffer(self) -> None:
        if self._playing:
            if self._finish is not None:
                self._finish.cancel()
            self._done(True)

    def _done(self, interrupted: bool) -> None:
        if self._playing:
            self._playing = False
            played = max(0.0, self._pushed - max(0.0, self._ends_at - time.time()))
            self.on_playback_finished(playback_position=played, interrupted=interrupted)


async def realtime(args, pcm: np.ndarray, audio: AgentAudio) -> dict:
    model = openai.realtime.RealtimeModel(base_url=args.url, api_key=args.key, voice=args.voice)
    session = AgentSession(llm=model)
    session.input.audio = Microphone(pcm, audio.clock)
    session.output.audio = Speaker(audio)
    interruptions = []
    session.on("agent_state_changed", lambda ev: None)
    session.on("user_input_transcribed", lambda ev: None)
    session.on("user_state_changed", lambda ev: interruptions.append(ev.new_state) if ev.new_state == "speaking"
               else None)
    context = ChatContext()
    context.add_message(role="developer", content="Say hello!")
    await session.start(Agent(instructions=args.persona, chat_ctx=context))
    while audio.clock.t0 is None:
        await asyncio.sleep(0.05)
    await asyncio.sleep(max(0.0, len(pcm) / RATE - audio.clock.now()))
    await session.aclose()
    await model.aclose()
    return {"user_turns": len(interruptions)}


async def talk(session, pcm: np.ndarray, clock: Clock) -> None:
    """Push the caller's audio into a realtime session at the pace it plays."""
    clock.start()
    for k in range(0, len(pcm) // CHUNK):
        session.push_audio(rtc.AudioFrame(data=pcm[k * CHUNK:(k + 1) * CHUNK].tobytes(), sample_rate=RATE,
                                          num_channels=1, samples_per_channel=CHUNK))
        await asyncio.sleep(clock.wait(k + 1))


async def live(args, pcm: np.ndarray, audio: AgentAudio) -> dict:
    model = openai.realtime.GPTLiveModel(base_url=args.url, api_key=args.key, voice=args.voice)
    adapter = llm.DuplexRealtimeAdapter(model)
    session = adapter.session()
    bursts: list[asyncio.Task] = []

    async def read(ev: llm.GenerationCreatedEvent) -> None:
        async for message in ev.message_stream:
            async def frames(m=message) -> None:
                async for _ in m.audio_stream:
                    pass

            async def text(m=message) -> None:
                async for _ in m.text_stream:
                    pass

            await asyncio.gather(frames(), text())

    session.on("generation_created", lambda ev: bursts.append(asyncio.create_task(read(ev))))
    session.duplex_session.on("openai_server_event_received", lambda ev: audio.add(base64.b64decode(ev["delta"]))
                              if ev["type"] == "session.output_audio.delta" else None)
    # What AgentSession does with a new realtime session: its instructions, context and tools.
    await session._update_session(instructions=args.persona, chat_ctx=llm.ChatContext.empty(), tools=[])
    await talk(session, pcm, audio.clock)
    await session.aclose()
    await adapter.aclose()
    await asyncio.wait_for(asyncio.gather(*bursts), 5)
    return {"bursts": len(bursts)}


async def chat(args, pcm: np.ndarray, audio: AgentAudio) -> dict:
    """LiveKit's PersonaPlex plugin (livekit-plugins-nvidia), made for NVIDIA's server, as its users
    run it outside a worker."""
    from livekit.agents.utils import http_context
    from livekit.plugins.nvidia.experimental.realtime import RealtimeModel as PersonaPlexModel

    text: list[str] = []
    readers: list[asyncio.Task] = []
    async with http_context.open():
        model = PersonaPlexModel(base_url=args.url, voice=args.voice, text_prompt=args.persona)
        session = model.session()
        await session.update_instructions(args.persona)  # the same text: a different one reconnects

        async def read(ev: llm.GenerationCreatedEvent) -> None:
            async for message in ev.message_stream:
                async def frames(m=message) -> None:
                    async for frame in m.audio_stream:
                        audio.add(bytes(frame.data))

                async def words(m=message) -> None:
                    async for piece in m.text_stream:
                        text.append(str(piece))

                await asyncio.gather(frames(), words())

        session.on("generation_created", lambda ev: readers.append(asyncio.create_task(read(ev))))
        await talk(session, pcm, audio.clock)
        await session.aclose()
        await model.aclose()
        for reader in readers:
            reader.cancel()
    return {"text": "".join(text)[:200], "text_pieces": len(text)}


async def main() -> int:
    args = arguments()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    errors = Errors()
    logging.getLogger().addHandler(errors)
    pcm = read_speech(args.speech, args.tail)
    audio = AgentAudio(Clock(), args.barge_at)
    extra = await {"realtime": realtime, "live": live, "chat": chat}[args.protocol](args, pcm, audio)
    report(agent_seconds=round(audio.seconds, 2), audible_seconds=round(audio.audible, 2),
           after_barge_in=round(audio.after_barge_in, 2), errors=errors.lines, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
