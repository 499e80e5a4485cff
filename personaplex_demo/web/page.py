"""The Gradio page (voice, persona, sampling, the call button, transcript, status and downloads), built
around fastrtc's `WebRTC` component rather than the generated `Stream.ui`, `GET /api/status`, and
`GET /api/room`: the room's figures, which the page's script asks for while the tab is visible instead
of a Gradio timer event per tab (docs/serving.md § Visitors and callers)."""

from __future__ import annotations

import asyncio
import html
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr
from fastrtc import WebRTC
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..call_settings import DEFAULT_VOICE, SamplingParams, load_presets
from ..frame import AUDIO_CARD
from ..rtc.ice import server_configuration
from ..rtc.patches import answer_offers, bound_event_log
from ..runtime.facts import RuntimeFacts
from ..serving.metrics import PoolMetrics
from ..serving.room import Room
from .assets import asset_text, page_script
from .call_figures import TRIP_PENDING
from .deeplink import SEED_RANGE, LinkRules, NumberRule, add_deep_links, number_rule
from .handler import CallHandler, PageInputs
from .mic_hold import MIC_HOLD_SCRIPT
from .recording import RecordingFiles, RecordingStore
from .status import SharedFigures, limited_by, queue_reason, room_line

DEFAULT_PRESET = "Assistant (teacher)"
STOP_WAIT_SECONDS = 5.0  # after Stop, how long the page waits for the recording to be written
REFRESH_SECONDS = 5.0  # how often a visible page asks for the room's figures
ANSWER_SECONDS = 1.0  # one answer of /api/room serves every page that asks within this long

CSS = asset_text("page.css")


@dataclass
class PageOptions:
    time_limit: float | None = 300.0  # per call, counted by the pool from the moment it is live
    rtc_configuration: Any = None  # dict, or a (sync or async) callable for fresh TURN credentials
    server_rtc_configuration: Any = None
    notice: str | None = None  # an extra warning for the page, e.g. "no TURN relay configured"
    title: str = "PersonaPlex Live"


def status_payload(runtime: RuntimeFacts, room: Room) -> dict[str, Any]:
    """What `GET /api/status` returns: the model and the room's live figures, the same fields
    whichever back end holds the room."""
    metrics, capacity = room.snapshot(), runtime.capacity_facts()
    return {"model": runtime.model_name, "tiny": bool(runtime.is_tiny), "banner": runtime.banner,
            "weights": runtime.weights, "device": runtime.device_name, "capacity": capacity,
            "admission": room.config.admission, "queue_reason": queue_reason(metrics),
            "limited_by": limited_by(metrics, room.config.media_lag_limit_seconds, (capacity or {}).get("bound")),
            **metrics.as_dict()}


def figure_parts(m: PoolMetrics) -> list[tuple[str, str]]:
    """The room's figures on the page, as (label, text) pairs; an empty label is plain text."""
    if not m.ticks:  # zeros would read as measurements
        return [("Room", room_line(m)), ("", "latency and tick times appear once a call is live")]
    return [("Room", room_line(m)), ("latency", f"p50 {m.latency_p50_ms:.0f} ms, p99 {m.latency_p99_ms:.0f} ms"),
            ("tick", f"p50 {m.tick_p50_ms:.0f} ms, p99 {m.tick_p99_ms:.0f} ms"),
            ("real-time factor", f"{m.realtime_factor:.2f}")]


def figures_html(m: PoolMetrics) -> str:
    """The same parts as the page first shows them (its script replaces the span's text)."""
    text = " · ".join(f"<strong>{html.escape(label)}</strong> {html.escape(part)}" if label else html.escape(part)
                      for label, part in figure_parts(m))
    return f'<span class="room-figures">{text}</span>'


def status_routes(runtime: RuntimeFacts, room: Room, extra: Callable[[], dict[str, Any]] | None = None) -> list[Route]:
    """`/api/status`, and `/api/room` for the pages' figures: the same bytes for every page while the
    shared snapshot (taken at most every ANSWER_SECONDS) is the same one. `extra`: more fields for the
    status payload (per engine and per media worker, when there are several)."""
    async def status(_: Request) -> JSONResponse:
        payload = status_payload(runtime, room)
        if extra is not None:
            payload.update(extra())
        return JSONResponse(payload, headers={"Cache-Control": "no-store"})

    figures = SharedFigures(room, ttl=ANSWER_SECONDS)
    kept: tuple[PoolMetrics, bytes] | None = None  # read and written on the server's loop only

    async def room_figures(_: Request) -> Response:
        nonlocal kept
        metrics = figures.get()
        if kept is None or kept[0] is not metrics:
            kept = (metrics, json.dumps({"parts": figure_parts(metrics), "refresh_seconds": REFRESH_SECONDS}).encode())
        return Response(kept[1], media_type="application/json", headers={"Cache-Control": "no-store"})

    return [Route("/api/status", status, methods=["GET"]), Route("/api/room", room_figures, methods=["GET"])]


def call_events(demo: gr.Blocks) -> frozenset[int]:
    """The fn_index of the page's call events: the WebRTC component's own (start, the inputs, the
    page-update relay, stop) and the downloads after a call. Nothing limits these (visitor_limits.py)."""
    blocks = {block_id for block_id, b in demo.blocks.items()
              if isinstance(b, WebRTC) or getattr(b, "elem_id", None) == "ended-call"}
    return frozenset(i for i, fn in demo.fns.items() if any(target in blocks for target, _ in fn.targets))


# The call's round trip as the caller lives it (docs/serving.md § Figures per call): the server's
# figure is followed by TRIP_PENDING, which this script replaces with the sum including the browser's
# own jitter buffer (getStats, over the last two seconds).
TRIP_SCRIPT = page_script("round_trip.js", PENDING=TRIP_PENDING)
# The room's figures: ask while visible, back off when refused, write text only.
ROOM_SCRIPT = page_script("room_figures.js", REFRESH=REFRESH_SECONDS)


def page_values(transcript: str, status: str, call_id: str, files=None, figures: str = "") -> tuple[str, ...]:
    """A handler update (`AdditionalOutputs(transcript, status, call_id, files, figures)`) as the
    relay's outputs: the call's id goes into `ended_call` once its recording is written."""
    return transcript, status, call_id, call_id if files else "", figures


def build_ui(runtime, room: Room, options: PageOptions | None = None,
             recordings: RecordingStore | None = None) -> gr.Blocks:
    """The page. `runtime` needs `.engine` (voice_names, max_persona_tokens, persona_tokens),
    `.model_name`, `.is_tiny` and `.banner`."""
    return Page(runtime, room, options or PageOptions(),
                recordings if recordings is not None else RecordingStore()).build()


def file_updates(files) -> tuple[dict, ...]:
    """The two download buttons: shown with the (WAV, JSON) paths, or hidden."""
    return tuple(gr.update(value=str(f) if f else None, visible=bool(f)) for f in (files or (None, None)))


# The page's events but the call's stream: Gradio's default limit (1) would update only the first
# caller's page.
EVENT_OPTIONS: dict[str, Any] = {"show_progress": "hidden", "concurrency_limit": None}


class Page:
    """The page's components (made by `build`, in the order the page shows them) and the events
    that wire them to the call handler and the room."""

    def __init__(self, runtime, room: Room, options: PageOptions, recordings: RecordingStore) -> None:
        self.runtime, self.room, self.options, self.recordings = runtime, room, options, recordings
        self.engine = runtime.engine
        self.presets = dict(load_presets())
        self.voices = list(self.engine.voice_names)
        self.figures = SharedFigures(room)
        self.handler = CallHandler(room, recordings, model_name=runtime.model_name, room_figures=self.figures)

    def build(self) -> gr.Blocks:
        options = self.options
        limit_text = f"Calls last up to {int(options.time_limit // 60)} min. " if options.time_limit else ""
        with gr.Blocks(title=options.title) as demo:
            # Gradio 5.50 deprecates Blocks(css=..., head=...) and its launch() takes neither yet; the
            # page config reads these.
            demo.css, demo.head = CSS, TRIP_SCRIPT + MIC_HOLD_SCRIPT + ROOM_SCRIPT
            gr.Markdown(f"# {options.title}\nTalk out loud with NVIDIA PersonaPlex-7B, a full-duplex speech model: "
                        "it listens and speaks at the same time. Pick a voice and a persona, then press **Record**. "
                        f"{limit_text}")
            if self.runtime.banner:
                gr.Markdown(f"**Offline demo model.** {self.runtime.banner}", elem_id="banner")
            if options.notice:
                gr.Markdown(f"**Note.** {options.notice}", elem_id="notice")
            link_notice = gr.Markdown(visible=False, elem_id="link-notice")  # what a deep link could not set
            with gr.Row(equal_height=False):
                with gr.Column(scale=1, min_width=320, elem_id="settings-column"):
                    self.build_settings(demo, link_notice)
                with gr.Column(scale=2, min_width=360, elem_id="call-column"):
                    self.build_call()
            self.wire_events()
        bound_event_log(demo)  # Gradio keeps a record of every event (rtc/patches.py)
        return demo

    def build_settings(self, demo: gr.Blocks, link_notice: gr.Markdown) -> None:
        """Voice, persona and the sampling knobs, each settable by a deep link."""
        defaults, voices, presets = SamplingParams(), self.voices, self.presets
        voice = gr.Dropdown(voices, value=DEFAULT_VOICE if DEFAULT_VOICE in voices else voices[0],
                            label="Voice", elem_id="voice")
        self.preset = gr.Dropdown(list(presets), value=DEFAULT_PRESET, label="Persona preset", elem_id="preset")
        self.persona = gr.Textbox(presets[DEFAULT_PRESET], label="Persona (edit freely)", lines=5,
                                  max_lines=12, elem_id="persona")
        self.tokens = gr.Markdown(self.token_count(presets[DEFAULT_PRESET]), elem_id="token-count")
        with gr.Accordion("Advanced", open=False):
            text_temp = gr.Slider(0.0, 2.0, defaults.text_temperature, step=0.05, label="Text temperature")
            text_topk = gr.Slider(1, 500, defaults.text_top_k, step=1, label="Text top-k")
            audio_temp = gr.Slider(0.0, 2.0, defaults.audio_temperature, step=0.05, label="Audio temperature")
            audio_topk = gr.Slider(1, AUDIO_CARD, defaults.audio_top_k, step=1, label="Audio top-k")
            seed = gr.Number(-1, precision=0, label="Seed (-1: a new random seed per call)")
        self.inputs = PageInputs(voice, self.persona, text_temp, text_topk, audio_temp, audio_topk, seed)
        add_deep_links(demo, dict(preset=self.preset, **self.inputs._asdict()), LinkRules(
            voices=tuple(voices), presets=presets, check_persona=self.engine.persona_tokens, numbers=dict(
                text_temperature=number_rule(text_temp, False), text_top_k=number_rule(text_topk, True),
                audio_temperature=number_rule(audio_temp, False), audio_top_k=number_rule(audio_topk, True),
                seed=NumberRule(*SEED_RANGE, integer=True))), link_notice)

    def build_call(self) -> None:
        """The call itself: the WebRTC component, the status line, the transcript and the downloads."""
        options = self.options
        gr.Markdown("**Use headphones.** The model listens while it talks; through speakers it hears "
                    "itself and answers its own voice.", elem_id="headphones")
        self.rtc = rtc = WebRTC(modality="audio", mode="send-receive", label="Call", full_screen=False,
                                rtc_configuration=options.rtc_configuration,
                                server_rtc_configuration=options.server_rtc_configuration, elem_id="call")
        # Ask the browser for 40 ms packets (half the per-packet work per caller, rtc/audio.py), and take
        # Firefox's ICE candidates too, and those that come before their offer (rtc/candidates.py).
        answer_offers(rtc)
        # fastrtc's own conversion drops iceTransportPolicy; this one keeps a relay-only setting.
        rtc.server_rtc_configuration = server_configuration(options.server_rtc_configuration)
        self.status = gr.Markdown(f"Ready · {room_line(self.room.snapshot())}", elem_id="status-line")
        self.call_figures = gr.Markdown("", elem_id="call-figures")  # this call's own (web/call_figures.py)
        self.handler.peers = rtc.pcs.get  # for each call's packet counts
        self.transcript = gr.Textbox(label="Transcript (the agent's words)", lines=8, max_lines=16,
                                     interactive=False, autoscroll=True, elem_id="transcript-box")
        with gr.Row():
            # Hidden until a call has ended and its recording is written.
            self.wav = gr.File(label="Conversation (stereo WAV: you left, agent right)", interactive=False,
                               visible=False, elem_id="download-wav")
            self.txt = gr.File(label="Transcript (JSON)", interactive=False, visible=False, elem_id="download-json")
        gr.Markdown(f"After a call, its recording and transcript can be downloaded here; the server "
                    f"deletes them after {int(self.recordings.max_age_seconds // 60)} minutes.",
                    elem_id="recording-note")
        # The room's figures: the page's own script keeps them fresh (ROOM_SCRIPT).
        self.stats = gr.HTML(figures_html(self.figures.get()), elem_id="stats", padding=False)
        self.call_id = gr.Textbox(visible=False, elem_id="call-id")
        # Set to the call's id when the server ends a call; its change shows the downloads.
        self.ended_call = gr.Textbox(visible=False, elem_id="ended-call")
        self.page_outputs = [self.transcript, self.status, self.call_id, self.ended_call, self.call_figures]

    def wire_events(self) -> None:
        rtc, presets = self.rtc, self.presets
        # Every visitor raises these: coroutines, answered on the loop at once, with no worker thread and
        # no wait in Gradio's queue.
        async def preset_text(name: str) -> str:
            return presets.get(name, "")

        self.preset.change(preset_text, self.preset, self.persona, **EVENT_OPTIONS)
        self.persona.change(self.count_tokens, self.persona, self.tokens, **EVENT_OPTIONS)
        # The pool's time limit counts from going live, so fastrtc's own (from connecting) stays off. The
        # handler reads the inputs once, when the call starts, so they are not sent on every change
        # (fastrtc would wire a worker-thread change event to each control).
        rtc.stream(self.handler, inputs=[rtc, *self.inputs], outputs=[rtc], time_limit=None,
                   send_input_on="submit",
                   concurrency_limit=self.room.slots_total + (self.room.config.max_queue or 0) + 2)
        rtc.state_change(self.relay, inputs=[rtc], outputs=self.page_outputs, trigger_mode="once",
                         **EVENT_OPTIONS)
        downloads = [self.wav, self.txt]
        rtc.start_recording(self.on_start, None, [self.transcript, self.status, self.ended_call, self.call_figures,
                                                  *downloads], **EVENT_OPTIONS)
        self.ended_call.change(self.show_downloads, self.ended_call, downloads, **EVENT_OPTIONS)
        rtc.stop_recording(self.on_stop, self.call_id, [self.status, *downloads], **EVENT_OPTIONS)

    # ---- event handlers ---------------------------------------------------------------------------

    async def count_tokens(self, text: str) -> str:
        return self.token_count(text)

    def token_count(self, text: str) -> str:
        try:
            n = len(self.engine.persona_tokens(text or ""))
        except Exception as e:  # the counter shows what is wrong instead of a count
            return f"⚠️ {e}"
        return f"{n} / {self.engine.max_persona_tokens} tokens"

    def on_start(self):
        return ("", f"Connecting… · {room_line(self.figures.get())}", "", "", *file_updates(None))

    async def written_files(self, call_id: str) -> RecordingFiles | None:
        """The (WAV, JSON) paths of the call's recording once it is written, or None."""
        rec = self.recordings.get(call_id or "")
        return await rec.wait_finished(STOP_WAIT_SECONDS) if rec is not None else None

    async def show_downloads(self, call_id: str):
        """The downloads of a call the server ended, once its recording is written."""
        files = await self.written_files(call_id)
        return file_updates(files) if files is not None else (gr.skip(), gr.skip())

    async def on_stop(self, call_id: str):
        files = await self.written_files(call_id)
        return (f"Call ended · {room_line(self.figures.get())}", *file_updates(files))

    async def relay(self, value):
        """The handler's page updates for this connection, as fastrtc's `on_additional_outputs` relays
        them, except that updates still queued at the close are delivered, a late trigger returns at
        once, and every output is a plain value: the downloads come from `ended_call`'s change event
        (docs/design-notes.md § The page relays its own updates, and the section on plain values)."""
        rtc = self.rtc
        webrtc_id = getattr(value, "webrtc_id", value)
        outputs = rtc.additional_outputs.get(webrtc_id)
        last = None
        while outputs is not None:
            if outputs.queue.empty() and (outputs.quit.is_set() or webrtc_id not in rtc.connections):
                break
            try:
                update = await asyncio.wait_for(outputs.queue.get(), 0.5)
            except TimeoutError:
                continue
            last = update.args
            yield page_values(*last)
        final = self.handler.final_updates.pop(webrtc_id)
        if final is not None and final != last:
            yield page_values(*final)
        elif last is None:
            yield tuple(gr.skip() for _ in self.page_outputs)
