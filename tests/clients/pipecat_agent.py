"""A pipecat 1.14 voice agent on the app, as pipecat's examples build one: a transport's microphone
(here a WAV at real-time pace) -> the user aggregator -> the LLM service -> a speaker that plays
in real time -> the assistant aggregator, started with LLMRunFrame, with pipecat's example context
(`{"role": "developer", "content": "Say hello!"}`). `--protocol realtime` uses
OpenAIRealtimeLLMService on /v1/realtime, `live` OpenAILiveLLMService on /v1/live/sessions.

Runs in pipecat's own virtual environment (tests/test_agent_frameworks.py). Prints one RESULT
line: the agent audio it got (in all, after the barge-in), the interruptions, every ERROR that
pipecat logged.
"""

from __future__ import annotations

import asyncio
import sys

from common import CHUNK, RATE, AgentAudio, Clock, arguments, read_speech, report
from loguru import logger
from pipecat.frames.frames import (
    EndFrame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMRunFrame,
    OutputAudioRawFrame,
    StartFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.transports.base_input import BaseInputTransport
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams
from pipecat.workers.runner import WorkerRunner

errors: list[str] = []
logger.remove()
logger.add(sys.stderr, level="INFO")
logger.add(lambda message: errors.append(str(message)), level="ERROR")


class Microphone(BaseInputTransport):
    def __init__(self, params: TransportParams, pcm, clock: Clock) -> None:
        super().__init__(params)
        self.pcm, self.clock, self.done = pcm, clock, asyncio.Event()
        self._task = None

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)
        self._task = self._task or self.create_task(self._talk())

    async def _talk(self) -> None:
        self.clock.start()
        for k, i in enumerate(range(0, len(self.pcm), CHUNK)):
            await self.push_audio_frame(InputAudioRawFrame(audio=self.pcm[i:i + CHUNK].tobytes(), sample_rate=RATE,
                                                           num_channels=1))
            await asyncio.sleep(self.clock.wait(k + 1))
        self.done.set()


class Speaker(BaseOutputTransport):
    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        await asyncio.sleep(len(frame.audio) / (2 * frame.sample_rate))  # a sound card plays in real time
        return True


class Tap(FrameProcessor):
    """The agent's audio and text as the service pushes them, and the interruptions."""

    def __init__(self, audio: AgentAudio) -> None:
        super().__init__()
        self.audio, self.text, self.interruptions = audio, "", 0

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            if isinstance(frame, OutputAudioRawFrame):
                self.audio.add(frame.audio)
            elif isinstance(frame, TTSTextFrame):
                self.text += frame.text
            elif isinstance(frame, InterruptionFrame):
                self.interruptions += 1
        await self.push_frame(frame, direction)


def service(args):
    if args.protocol == "realtime":
        from pipecat.services.openai.realtime import events
        from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

        voice = events.SessionProperties(audio=events.AudioConfiguration(output=events.AudioOutput(voice=args.voice)))
        return OpenAIRealtimeLLMService(api_key=args.key, base_url=args.url, settings=OpenAIRealtimeLLMService.Settings(
            system_instruction=args.persona, session_properties=voice))
    from pipecat.services.openai.live.llm import OpenAILiveLLMService

    return OpenAILiveLLMService(api_key=args.key, base_url=args.url, settings=OpenAILiveLLMService.Settings(
        system_instruction=args.persona, voice=args.voice))


async def main() -> int:
    args = arguments()
    clock = Clock()
    params = TransportParams(audio_in_enabled=True, audio_out_enabled=True, audio_in_sample_rate=RATE,
                             audio_out_sample_rate=RATE)
    microphone = Microphone(params, read_speech(args.speech, args.tail), clock)
    tap = Tap(AgentAudio(clock, args.barge_at))
    user, assistant = LLMContextAggregatorPair(LLMContext([{"role": "developer", "content": "Say hello!"}]))
    worker = PipelineWorker(Pipeline([microphone, user, service(args), tap, Speaker(params), assistant]),
                            params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
                            enable_rtvi=False, idle_timeout_secs=None)

    @worker.event_handler("on_pipeline_started")
    async def started(worker, frame) -> None:
        await worker.queue_frames([LLMRunFrame()])

    async def hang_up() -> None:
        await microphone.done.wait()
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    stopper = asyncio.create_task(hang_up())
    await asyncio.wait_for(runner.run(), timeout=len(microphone.pcm) / RATE + 60)
    stopper.cancel()
    report(agent_seconds=round(tap.audio.seconds, 2), audible_seconds=round(tap.audio.audible, 2),
           after_barge_in=round(tap.audio.after_barge_in, 2), interruptions=tap.interruptions, text=tap.text[:200],
           errors=[line.strip()[:500] for line in errors])
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
