"""The fastrtc call handler, one per call: it moves numpy arrays between the browser and a `CallHandle` of
the room (serving/room.py), never touching torch nor blocking the event loop. Everything but a plain hang-up
ends the call with a message (`CloseStream`). Its phases: docs/serving.md, on the handler's phases."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
from fastrtc import AdditionalOutputs, AsyncStreamHandler, CloseStream, get_current_context

from ..call_settings import DEFAULT_VOICE, SamplingParams
from ..errors import CallerError
from ..frame import SAMPLE_RATE
from ..rtc.audio import InputResampler, output_frame_samples
from ..serving.door import DoorCall, Ended, Frame, Live, Preparing, Queued, Refusal, RefusalKind
from ..serving.headroom import WaitReason
from ..serving.loop_lag import ensure_probe
from ..serving.room import DOOR_PAGE, CallHandle, CallState, EndReason, Room, SlotOutput
from ..serving.room import end_message as room_end_message
from .call_figures import CallFigures
from .echo import WARNING as ECHO_WARNING
from .echo import EchoDetector
from .mic_hold import MicHold
from .recording import CallRecording, RecordingStore
from .status import STATUS_SECONDS, PageThrottle, SharedFigures, room_line, status_line

log = logging.getLogger(__name__)

CLOSE_GRACE_SECONDS = 0.3  # between the final page update and CloseStream
ARGS_TIMEOUT = 5.0  # seconds to wait for the page's inputs before using the defaults

# Endings whose words already say what to do; the others add the page's own way back in.
_SAYS_WHAT_TO_DO = (EndReason.SHUTDOWN, EndReason.QUEUE_TIMEOUT, EndReason.OVERLOADED)


def end_message(reason: str) -> str:
    """The page's words for a call the room ended (serving/room.py `end_message`), with what to press."""
    words = room_end_message(reason)
    return words if reason in _SAYS_WHAT_TO_DO else f"{words} Please press Record to call again."


class PageInputs(NamedTuple):
    """The page's call settings (web/page.py), which fastrtc passes in the page's order; read by name."""

    voice: Any
    persona: Any
    text_temperature: Any
    text_top_k: Any
    audio_temperature: Any
    audio_top_k: Any
    seed: Any  # -1, None or "": a new random seed per call


@dataclass(frozen=True)
class CallRequest:
    voice: str
    persona: str
    sampling: SamplingParams

    @classmethod
    def from_args(cls, args: list) -> CallRequest:
        """The request the page's inputs make (the defaults, with a new seed, before it sent any). The
        inputs are at the END of fastrtc's `latest_args`, whose head differs between the Gradio page
        (`__webrtc_value__`, connection id, inputs...) and `Stream.set_input` (`__webrtc_value__`,
        inputs...). A random seed is drawn here, so that the transcript JSON keeps it."""
        n = len(PageInputs._fields)
        if len(args) < n + 1:
            return cls(DEFAULT_VOICE, "", SamplingParams(seed=secrets.randbits(32)))
        page = PageInputs(*args[-n:])
        seed = secrets.randbits(32) if page.seed in (None, "", -1) else page.seed
        try:
            sampling = SamplingParams(
                text_temperature=float(page.text_temperature), text_top_k=int(page.text_top_k),
                audio_temperature=float(page.audio_temperature), audio_top_k=int(page.audio_top_k),
                seed=int(seed))
        except (TypeError, ValueError) as e:
            raise CallerError(f"the sampling settings must be numbers: {e}") from e
        return cls(str(page.voice or DEFAULT_VOICE), str(page.persona or ""), sampling)

    def recording_meta(self, call_id: str, model: str) -> dict[str, Any]:
        """The call's settings, as they head its transcript JSON (documented in docs/transcripts.md)."""
        return {"call_id": call_id, "model": model, "voice": self.voice, "persona": self.persona,
                "sampling": asdict(self.sampling)}


class FinalUpdates:
    """The last page update of each call that ended with a message, by fastrtc connection id: fastrtc
    drops a connection's pending updates when it closes, so the page's relay picks the final one up
    here (docs/design-notes.md § The page relays its own updates). Shared by a page's handlers."""

    limit = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._updates: collections.OrderedDict[str, tuple] = collections.OrderedDict()

    def put(self, webrtc_id: str, args: tuple) -> None:
        with self._lock:
            self._updates[webrtc_id] = args
            while len(self._updates) > self.limit:
                self._updates.popitem(last=False)

    def pop(self, webrtc_id: str) -> tuple | None:
        with self._lock:
            return self._updates.pop(webrtc_id, None)


class Phase(enum.Enum):
    """Where a handler is in its call; fastrtc runs `start_up`, `receive` and `emit` concurrently."""

    STARTING = "starting"  # start_up is reading the page's inputs and asking for a slot
    ACTIVE = "active"  # queued, preparing or live: the call says which
    FAILING = "failing"  # cannot go on (refused, unusable audio): the next emit ends it with `close_message`
    CLOSING = "closing"  # the final page update went out; the next emit closes the stream
    CLOSED = "closed"  # ended, and the page was shown why (FinalUpdates holds it when the connection is known)
    ENDED = "ended"  # ended without a final update: a plain hang-up, or no page listening


class CallHandler(AsyncStreamHandler):
    """One call. The instance given to fastrtc is a template; `copy()` makes one per connection.

    Page updates are `AdditionalOutputs(transcript, status, call_id, files, figures)`: `files`, None or
    the recording's (WAV, JSON) paths. `peers`: the fastrtc connection id's aiortc peer (`pcs.get`)."""

    def __init__(self, room: Room, recordings: RecordingStore, *, model_name: str | None = None,
                 peers: Callable[[str], Any] | None = None, room_figures: SharedFigures | None = None,
                 final_updates: FinalUpdates | None = None):
        super().__init__(expected_layout="mono", output_sample_rate=SAMPLE_RATE, input_sample_rate=SAMPLE_RATE)
        # fastrtc paces agent audio in frames of this length; one frame makes one Opus packet (rtc/audio.py).
        self.output_frame_size = output_frame_samples(SAMPLE_RATE)
        self.room = room
        self.recordings = recordings
        self.model_name = model_name
        self.peers = peers
        self.room_figures = room_figures if room_figures is not None else SharedFigures(room)
        self.final_updates = final_updates if final_updates is not None else FinalUpdates()
        self.phase = Phase.STARTING
        self.door_call = DoorCall(room, DOOR_PAGE)
        self.call_id = uuid.uuid4().hex[:12]
        self.webrtc_id: str | None = None
        self.close_message: str | None = None  # FAILING: why; CLOSING: what CloseStream says
        self.recording: CallRecording | None = None
        self.transcript = ""
        self.packets_in = 0
        self.mic = MicHold()
        self._input = InputResampler(SAMPLE_RATE)
        self._started = asyncio.Event()  # set when STARTING is over
        self._throttle = PageThrottle()
        self.echo = EchoDetector()
        self.figures = CallFigures(time.monotonic())  # fastrtc copies the template as the offer comes

    def copy(self) -> CallHandler:
        return CallHandler(self.room, self.recordings, model_name=self.model_name, peers=self.peers,
                           room_figures=self.room_figures, final_updates=self.final_updates)

    @property
    def call(self) -> CallHandle | None:
        return self.door_call.call

    # ---- start-up ---------------------------------------------------------------------------

    async def start_up(self) -> None:
        self.figures.mark("connected", time.monotonic())
        ensure_probe(self.room)
        self.webrtc_id = get_current_context().webrtc_id
        try:
            await asyncio.wait_for(self.wait_for_args(), ARGS_TIMEOUT)
        except TimeoutError:
            log.info("call %s: no page inputs within %.0f s, using the defaults", self.call_id, ARGS_TIMEOUT)
        self.figures.mark("inputs", time.monotonic())
        try:
            req = CallRequest.from_args(list(self.latest_args or []))
            refusal = await self.door_call.start(req.voice, req.persona, req.sampling)
        except CallerError as e:  # the page's inputs themselves (sampling settings that are not numbers)
            refusal = Refusal(RefusalKind.CALLER, e)
        if refusal is None:
            self.phase = Phase.ACTIVE
            call = self.door_call.call
            self.figures.queued = call.state == CallState.QUEUED
            self.mic.set(call.state == CallState.QUEUED, self.channel, self.peers, self.webrtc_id)
            self.recording = self.recordings.start(self.call_id, req.recording_meta(self.call_id, self.model_name))
            log.info("call %s: %s, voice %s (room call %s)", self.call_id, call.state, req.voice, call.id)
        else:
            self.phase, self.close_message = Phase.FAILING, self._refused(refusal)
            log.info("call %s refused: %s", self.call_id, refusal.error)
        self._started.set()

    def _refused(self, refusal: Refusal) -> str:
        """The page's words for a call the room did not take."""
        if refusal.kind == RefusalKind.CALLER:
            return f"This call cannot start: {refusal.error}"
        if refusal.kind == RefusalKind.CLOSED:
            return room_end_message(EndReason.SHUTDOWN)
        busy = (f"All {self.room.slots_total} conversation slots are busy" if refusal.cause == WaitReason.SLOTS
                else "The room is at capacity on this machine: every call must keep real time")
        return (f"{busy}. Please try again in a minute." if not self.room.config.max_queue else
                f"{busy} and the waiting line is full. Please try again in a minute.")

    # ---- microphone -------------------------------------------------------------------------

    def resample(self, frame):  # fastrtc's hook for each decoded frame (rtc/audio.py)
        self.mic.decoded()
        return self._input.resample(frame)

    async def receive(self, frame: tuple[int, np.ndarray]) -> None:
        now = time.monotonic()
        if self.call is None or self.phase != Phase.ACTIVE:
            return  # before admission there is nowhere to send it; after the end, nobody to send it to
        audio = np.asarray(frame[1]).reshape(-1)  # 24 kHz 16-bit mono: `resample` made it so
        if not audio.size or self.call.state != CallState.LIVE:
            return  # queue or prefill: not heard yet (played late it would only add delay)
        self.door_call.push(audio)
        self.echo.caller.add(audio, now)
        self.packets_in += 1
        if self.recording is not None:
            self.recording.add_caller(audio)

    # ---- agent audio and page updates -------------------------------------------------------

    async def emit(self):
        phase = self.phase
        if phase == Phase.STARTING:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._started.wait(), 0.1)
            return None
        if phase == Phase.CLOSING:
            # The final page update went out with the previous item: a moment for the page to fetch it.
            self.phase = Phase.CLOSED
            await asyncio.sleep(CLOSE_GRACE_SECONDS)
            return CloseStream(self.close_message)
        if phase == Phase.FAILING:
            return await self._close(self.close_message, EndReason.ERROR)
        call = self.call
        if phase != Phase.ACTIVE or call is None:
            await asyncio.sleep(0.1)  # emit is polled in a loop: never return at once
            return None
        waiting = call.state.waiting
        match await self.door_call.next_event(STATUS_SECONDS if waiting else 0.1):
            case Frame(out=out):
                return self._output(out)
            case Ended(reason=EndReason.HANGUP):
                self.phase = Phase.ENDED
                self._finish_recording(EndReason.HANGUP)
                return None
            case Ended(reason=reason):
                return await self._close(end_message(reason), reason)
            case Queued() | Preparing() | Live() as news:
                # In the queue the caller's microphone is held; from its prefill on it is heard.
                self.mic.set(isinstance(news, Queued), self.channel, self.peers, self.webrtc_id)
                if isinstance(news, Live):
                    self.figures.mark("live", time.monotonic())
                return self._update(status_due=True)
            case None:  # while waiting, the room's figures on the status line may have changed
                return self._update(status_due=True) if waiting else None

    def _output(self, out: SlotOutput):
        """One agent frame for fastrtc, with a page update when one is due."""
        now = time.monotonic()
        if self.figures.output(out, now):
            log.info("call %s: first sound %s", self.call_id, self.figures.first_sound_text())
        self.figures.read_packets_soon(self.peers, self.webrtc_id, now)
        self.echo.agent.add(out.pcm, now)
        warned = self.echo.detected
        if self.echo.check(now) and not warned:
            log.info("call %s: the agent comes back through the microphone (correlation %.2f at %.0f ms)",
                     self.call_id, self.echo.score, 1e3 * (self.echo.delay_seconds or 0.0))
        if self.recording is not None:
            self.recording.add_agent(out.pcm, out.text)
        self.transcript += out.text
        audio = (SAMPLE_RATE, out.pcm)
        update = self._update(text_changed=bool(out.text), status_due=self.echo.detected and not warned)
        return (audio, update) if update is not None else audio

    def _update(self, text_changed: bool = False, status_due: bool = False) -> AdditionalOutputs | None:
        """The page update, or None (PageThrottle; the call's figures at most every FIGURES_SECONDS)."""
        status = self._throttle.take(text_changed, status_due, self._status)
        figures = self.figures.due(time.monotonic())
        if status is None and figures is None:
            return None
        status = status if status is not None else (self._throttle.last_status or self._status())
        return AdditionalOutputs(self.transcript, status, self.call_id, None, self.figures.shown)

    def _status(self) -> str:
        line = status_line(self.call, self.room_figures)
        return f"{ECHO_WARNING} · {line}" if self.echo.detected else line

    async def _close(self, message: str, reason: str):
        """End the call with `message`: finish the recording, then (when the page is listening on
        the data channel) send the final status and the downloads, then CloseStream."""
        self.phase = Phase.ENDED  # until the final update below is on its way
        self.door_call.hang_up(reason)
        if (writing := self._finish_recording(reason)) is not None:
            await writing
        files = None if self.recording is None else self.recording.files
        log.info("call %s ended: %s", self.call_id, message)
        if self.channel is None:
            return CloseStream(message)  # nobody to show a final update to
        paths = tuple(map(str, files)) if files is not None else None
        final = self._final_update(f"Call ended: {message}", paths)
        self.phase, self.close_message = Phase.CLOSING, message
        return AdditionalOutputs(*final)

    def _final_update(self, status: str, paths: tuple[str, str] | None = None) -> tuple:
        """The call's last page update, kept for the page's relay (FinalUpdates) where the connection
        is known."""
        final = (self.transcript, status, self.call_id, paths, self.figures.line())
        if self.webrtc_id is not None:
            self.final_updates.put(self.webrtc_id, final)
        return final

    # ---- hang-up ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """fastrtc calls this when the connection closes (Stop, lost network, closed tab)."""
        if self.call is not None:
            self.door_call.hang_up()
            log.info("call %s: closed after %d packets in, %d frames out, %d decoded while waiting", self.call_id,
                     self.packets_in, self.figures.outputs, self.mic.decoded_held)
        if self.phase not in (Phase.CLOSING, Phase.CLOSED):  # no final update went to the page yet
            self.phase = Phase.ENDED
            if self.webrtc_id is not None:
                # The page's relay delivers the updates still queued at the close; this one comes
                # last, so a late "Live" status cannot overwrite the end of the call.
                self._final_update(f"Call ended · {room_line(self.room_figures.get())}")
        self._finish_recording(EndReason.HANGUP)

    def _finish_recording(self, reason: str) -> asyncio.Future | None:
        """Write the recording with what its transcript JSON learns only at the end (`finish_soon`)."""
        if self.recording is None:
            return None
        return self.recording.finish_soon(reason, {"speaker_echo": self.echo.summary(),
                                                   "call_figures": self.figures.as_dict()})
