"""The Gradio page: voice, persona, sampling, the call button, transcript, status and downloads.

`build_ui` returns a `gr.Blocks` built around fastrtc's `WebRTC` component (not the generated
`Stream.ui`). `status_routes` gives the JSON status endpoint (`GET /api/status`) to mount on
the same server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
from fastrtc import WebRTC
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..frame import AUDIO_CARD
from ..rtc.audio import answering_with_packet_time
from ..rtc.ice import server_configuration
from ..rtc.patches import bound_event_log
from ..runtime.voices import DEFAULT_VOICE
from ..sampling_params import SamplingParams
from ..serving.room import Room
from .deeplink import SEED_RANGE, LinkRules, NumberRule, add_deep_links, number_rule
from .handler import CallHandler, FinalUpdates, RoomMetrics, room_line
from .page_inputs import PageInputs
from .recording import RecordingStore

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_PRESET = "Assistant (teacher)"
STOP_WAIT_SECONDS = 5.0  # after Stop, how long the page waits for the recording to be written
STATS_SECONDS = 5.0  # the room's figures on each open page refresh this often (one Gradio event each)

CSS = """
#banner {background: #fff4d6; border: 1px solid #e8c36a; border-radius: 8px; padding: 8px 12px; color: #4a3b00;}
#status-line {font-weight: 600; min-height: 1.6em;}
#headphones {opacity: 0.85;}
#stats, #recording-note {font-size: 0.85em; opacity: 0.85;}
"""


@dataclass
class PageOptions:
    time_limit: float | None = 300.0  # per call, counted by the pool from the moment it is live
    max_queue: int = 32  # callers that may wait for a slot (the pool's own limit)
    max_wait_seconds: float | None = 600.0  # a caller queued this long is told to come back later
    rtc_configuration: Any = None  # dict, or a (sync or async) callable for fresh TURN credentials
    server_rtc_configuration: Any = None
    notice: str | None = None  # an extra warning for the page, e.g. "no TURN relay configured"
    title: str = "PersonaPlex Live"


def load_presets() -> dict[str, str]:
    """Persona presets (label -> text): the examples from NVIDIA's PersonaPlex README."""
    return json.loads((ASSETS / "personas.json").read_text(encoding="utf-8"))


def status_payload(runtime, pool: Room) -> dict[str, Any]:
    """What `GET /api/status` returns: the model and the pool's live metrics."""
    capacity = getattr(runtime, "capacity", None)
    return {"model": runtime.model_name, "tiny": bool(runtime.is_tiny), "banner": runtime.banner,
            "capacity": capacity.as_dict() if capacity else None, **pool.snapshot().as_dict()}


def status_routes(runtime, pool: Room, extra: Callable[[], dict[str, Any]] | None = None) -> list[Route]:
    """`extra`: more fields for the payload (per engine and per media worker, when there are several)."""
    async def status(_: Request) -> JSONResponse:
        payload = status_payload(runtime, pool)
        if extra is not None:
            payload.update(extra())
        return JSONResponse(payload, headers={"Cache-Control": "no-store"})

    return [Route("/api/status", status, methods=["GET"])]


def stats_markdown(pool: Room) -> str:
    m = RoomMetrics.get(pool)
    if not m.ticks:  # zeros would read as measurements
        return f"**Room** {room_line(m)} · latency and tick times appear once a call is live"
    return (f"**Room** {room_line(m)} · **latency** p50 {m.latency_p50_ms:.0f} ms, p99 {m.latency_p99_ms:.0f} ms"
            f" · **tick** p50 {m.tick_p50_ms:.0f} ms, p99 {m.tick_p99_ms:.0f} ms"
            f" · **real-time factor** {m.realtime_factor:.2f}")


def page_values(transcript: str, status: str, call_id: str, files=None) -> tuple[str, str, str, str]:
    """A handler update (`AdditionalOutputs(transcript, status, call_id, files)`) as the relay's
    outputs: the call's id goes into `ended_call` once its recording is written."""
    return transcript, status, call_id, call_id if files else ""


def build_ui(runtime, pool: Room, options: PageOptions | None = None,
             recordings: RecordingStore | None = None) -> gr.Blocks:
    """The page. `runtime` needs `.engine` (voice_names, max_persona_tokens, persona_tokens),
    `.model_name`, `.is_tiny` and `.banner`."""
    options = options or PageOptions()
    engine = runtime.engine
    recordings = recordings if recordings is not None else RecordingStore()
    presets = load_presets()
    defaults = SamplingParams()
    voices = list(engine.voice_names)
    handler = CallHandler(pool, recordings, max_wait_seconds=options.max_wait_seconds,
                          model_name=runtime.model_name)

    def count_tokens(text: str) -> str:
        try:
            n = len(engine.persona_tokens(text or ""))
        except Exception as e:  # the counter shows what is wrong instead of a count
            return f"⚠️ {e}"
        return f"{n} / {engine.max_persona_tokens} tokens"

    def file_updates(files) -> tuple[dict, dict]:
        if not files:
            return gr.update(value=None, visible=False), gr.update(value=None, visible=False)
        return gr.update(value=str(files[0]), visible=True), gr.update(value=str(files[1]), visible=True)

    def on_start():
        return ("", f"Connecting… · {room_line(RoomMetrics.get(pool))}", "", *file_updates(None))

    async def show_downloads(call_id: str):
        """The downloads of a call the server ended, once its recording is written."""
        rec = recordings.get(call_id or "")
        files = await rec.wait_finished(STOP_WAIT_SECONDS) if rec is not None else None
        if files is None:
            return gr.skip(), gr.skip()
        return file_updates((files.wav, files.transcript))

    async def on_stop(call_id: str):
        rec = recordings.get(call_id or "")
        files = await rec.wait_finished(STOP_WAIT_SECONDS) if rec is not None else None
        status = f"Call ended · {room_line(RoomMetrics.get(pool))}"
        return (status, *file_updates((files.wav, files.transcript) if files is not None else None))

    limit_text = f"Calls last up to {int(options.time_limit // 60)} min. " if options.time_limit else ""
    with gr.Blocks(title=options.title) as demo:
        # Gradio 5.50 deprecates Blocks(css=...) and its launch() takes no css yet; the page config reads this.
        demo.css = CSS
        gr.Markdown(f"# {options.title}\nTalk out loud with NVIDIA PersonaPlex-7B, a full-duplex speech model: it "
                    "listens and speaks at the same time. Pick a voice and a persona, then press **Record**. "
                    f"{limit_text}")
        if runtime.banner:
            gr.Markdown(f"**Offline demo model.** {runtime.banner}", elem_id="banner")
        if options.notice:
            gr.Markdown(f"**Note.** {options.notice}", elem_id="notice")
        link_notice = gr.Markdown(visible=False, elem_id="link-notice")  # what a deep link could not set
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=320):
                voice = gr.Dropdown(voices, value=DEFAULT_VOICE if DEFAULT_VOICE in voices else voices[0],
                                    label="Voice", elem_id="voice")
                preset = gr.Dropdown(list(presets), value=DEFAULT_PRESET, label="Persona preset",
                                     elem_id="preset")
                persona = gr.Textbox(presets[DEFAULT_PRESET], label="Persona (edit freely)", lines=5,
                                     max_lines=12, elem_id="persona")
                tokens = gr.Markdown(count_tokens(presets[DEFAULT_PRESET]), elem_id="token-count")
                with gr.Accordion("Advanced", open=False):
                    text_temp = gr.Slider(0.0, 2.0, defaults.text_temperature, step=0.05, label="Text temperature")
                    text_topk = gr.Slider(1, 500, defaults.text_top_k, step=1, label="Text top-k")
                    audio_temp = gr.Slider(0.0, 2.0, defaults.audio_temperature, step=0.05, label="Audio temperature")
                    audio_topk = gr.Slider(1, AUDIO_CARD, defaults.audio_top_k, step=1, label="Audio top-k")
                    seed = gr.Number(-1, precision=0, label="Seed (-1: a new random seed per call)")
                page = PageInputs(voice, persona, text_temp, text_topk, audio_temp, audio_topk, seed)
                add_deep_links(demo, dict(preset=preset, **page._asdict()), LinkRules(
                    voices=tuple(voices), presets=presets, check_persona=engine.persona_tokens, numbers=dict(
                        text_temperature=number_rule(text_temp, False), text_top_k=number_rule(text_topk, True),
                        audio_temperature=number_rule(audio_temp, False), audio_top_k=number_rule(audio_topk, True),
                        seed=NumberRule(*SEED_RANGE, integer=True))), link_notice)
            with gr.Column(scale=2, min_width=360):
                gr.Markdown("🎧 **Use headphones.** The model listens while it talks; through speakers it hears "
                            "itself and answers its own voice.", elem_id="headphones")
                rtc = WebRTC(modality="audio", mode="send-receive", label="Call", full_screen=False,
                             rtc_configuration=options.rtc_configuration,
                             server_rtc_configuration=options.server_rtc_configuration, elem_id="call")
                # Ask the browser for 40 ms packets: half the per-packet work per caller (rtc/audio.py).
                rtc.handle_offer = answering_with_packet_time(rtc.handle_offer)
                # fastrtc's own conversion drops iceTransportPolicy; this one keeps a relay-only setting.
                rtc.server_rtc_configuration = server_configuration(options.server_rtc_configuration)
                status = gr.Markdown(f"Ready · {room_line(pool.snapshot())}", elem_id="status-line")
                transcript = gr.Textbox(label="Transcript (the agent's words)", lines=8, max_lines=16,
                                        interactive=False, autoscroll=True, elem_id="transcript-box")
                with gr.Row():
                    # Hidden until a call has ended and its recording is written.
                    wav = gr.File(label="Conversation (stereo WAV: you left, agent right)", interactive=False,
                                  visible=False, elem_id="download-wav")
                    txt = gr.File(label="Transcript (JSON)", interactive=False, visible=False,
                                  elem_id="download-json")
                gr.Markdown(f"After a call, its recording and transcript can be downloaded here; the server "
                            f"deletes them after {int(recordings.max_age_seconds // 60)} minutes.",
                            elem_id="recording-note")
                stats = gr.Markdown(stats_markdown(pool), elem_id="stats")
                call_id = gr.Textbox(visible=False, elem_id="call-id")
                # Set to the call's id when the server ends a call; its change shows the downloads.
                ended_call = gr.Textbox(visible=False, elem_id="ended-call")

        preset.change(lambda name: presets.get(name, ""), preset, persona, show_progress="hidden")
        persona.change(count_tokens, persona, tokens, show_progress="hidden", concurrency_limit=None)
        # The pool enforces the time limit from the moment a call is live (queue time does not
        # count), so fastrtc's own limit, which counts from connecting, stays off.
        rtc.stream(handler, inputs=[rtc, *page],
                   outputs=[rtc], time_limit=None, concurrency_limit=pool.slots_total + options.max_queue + 2)
        page_outputs = [transcript, status, call_id, ended_call]

        async def relay(value):
            """The handler's page updates for this connection, as fastrtc's `on_additional_outputs`
            relays them, with three differences: updates still queued when the call closes are
            delivered; a late trigger for a call that is already over returns at once (fastrtc's
            relay would wait forever on a fresh queue, and its restart blanks the page); and every
            output is a plain value. Gradio rebuilds a component for each `gr.update()` or
            `gr.skip()` it is given, so the downloads are not outputs here: the final update puts
            the call's id into `ended_call`, whose change event fills them in once."""
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
            final = FinalUpdates.pop(webrtc_id)
            if final is not None and final != last:
                yield page_values(*final)
            elif last is None:
                yield tuple(gr.skip() for _ in page_outputs)

        # concurrency_limit=None: the default (1) would update only the first caller's page.
        rtc.state_change(relay, inputs=[rtc], outputs=page_outputs, concurrency_limit=None, show_progress="hidden",
                         trigger_mode="once")
        rtc.start_recording(on_start, None, [transcript, status, ended_call, wav, txt], show_progress="hidden",
                            concurrency_limit=None)
        ended_call.change(show_downloads, ended_call, [wav, txt], show_progress="hidden", concurrency_limit=None)
        rtc.stop_recording(on_stop, call_id, [status, wav, txt], show_progress="hidden", concurrency_limit=None)
        gr.Timer(STATS_SECONDS).tick(lambda: stats_markdown(pool), None, stats, show_progress="hidden",
                           concurrency_limit=None)
    bound_event_log(demo)  # every open page raises an event every few seconds (rtc/patches.py)
    return demo
