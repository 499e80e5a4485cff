"""The Gradio page: voice, persona, sampling, the call button, transcript, status and downloads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from fastrtc import WebRTC

from .engine import SamplingParams
from .handler import CallHandler, stats_line, status_line
from .pool import SlotPool
from .recording import RecordingStore
from .voices import DEFAULT_VOICE

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_PRESET = "Assistant (teacher)"

CSS = """
#banner {background: #fff4d6; border: 1px solid #e8c36a; border-radius: 8px; padding: 8px 12px;}
#status-line {font-weight: 600;}
"""


@dataclass
class PageOptions:
    time_limit: float | None = 300.0
    max_queue: int = 32
    rtc_configuration: object = None
    server_rtc_configuration: object = None
    title: str = "PersonaPlex Live"


def load_presets() -> dict[str, str]:
    return json.loads((ASSETS / "personas.json").read_text())


def build_ui(runtime, pool: SlotPool, options: PageOptions, recordings: RecordingStore | None = None) -> gr.Blocks:
    engine = runtime.engine
    recordings = recordings or RecordingStore()
    presets = load_presets()
    defaults = SamplingParams()

    def count_tokens(text: str) -> str:
        try:
            n = len(engine.persona_tokens(text or ""))
        except Exception as e:  # the counter shows the problem instead of the count
            return f"⚠️ {e}"
        return f"{n} / {engine.max_persona_tokens} tokens"

    def downloads(call_id: str):
        files = recordings.get(call_id or "")
        if files is None:
            return gr.update(value=None), gr.update(value=None)
        return str(files[0]), str(files[1])

    with gr.Blocks(title=options.title, css=CSS) as demo:
        gr.Markdown(f"# {options.title}\nTalk out loud with NVIDIA PersonaPlex-7B, a full-duplex speech model: it "
                    "listens and speaks at the same time. Pick a voice and a persona, then press **Record**.")
        if runtime.banner:
            gr.Markdown(f"**Offline demo model.** {runtime.banner}", elem_id="banner")
        with gr.Row():
            with gr.Column(scale=1):
                voice = gr.Dropdown(engine.voice_names, value=DEFAULT_VOICE if DEFAULT_VOICE in engine.voice_names
                                    else engine.voice_names[0], label="Voice", elem_id="voice")
                preset = gr.Dropdown(list(presets), value=DEFAULT_PRESET, label="Persona preset")
                persona = gr.Textbox(presets[DEFAULT_PRESET], label="Persona", lines=4, elem_id="persona")
                tokens = gr.Markdown(count_tokens(presets[DEFAULT_PRESET]), elem_id="token-count")
                with gr.Accordion("Advanced", open=False):
                    text_temp = gr.Slider(0.0, 2.0, defaults.text_temperature, step=0.05, label="Text temperature")
                    text_topk = gr.Slider(1, 500, defaults.text_top_k, step=1, label="Text top-k")
                    audio_temp = gr.Slider(0.0, 2.0, defaults.audio_temperature, step=0.05, label="Audio temperature")
                    audio_topk = gr.Slider(1, 2048, defaults.audio_top_k, step=1, label="Audio top-k")
                    seed = gr.Number(-1, precision=0, label="Seed (-1: random)")
            with gr.Column(scale=2):
                gr.Markdown("🎧 **Use headphones.** The model listens while it talks; through speakers it hears "
                            "itself.")
                rtc = WebRTC(modality="audio", mode="send-receive", label="Call", full_screen=False,
                             rtc_configuration=options.rtc_configuration,
                             server_rtc_configuration=options.server_rtc_configuration, elem_id="call")
                status = gr.Markdown(status_line(None, pool).replace("Connecting…", "Ready"), elem_id="status-line")
                transcript = gr.Textbox(label="Transcript", lines=8, interactive=False, elem_id="transcript-box")
                stats = gr.Markdown("", elem_id="stats")
                call_id = gr.Textbox(visible=False, elem_id="call-id")
                with gr.Row():
                    fetch = gr.Button("Get the recording of the last call")
                    wav = gr.File(label="Conversation (stereo WAV: you left, agent right)")
                    txt = gr.File(label="Transcript (JSON)")

        preset.change(lambda name: presets.get(name, ""), preset, persona)
        persona.change(count_tokens, persona, tokens)
        rtc.stream(CallHandler(pool, recordings), inputs=[rtc, voice, persona, text_temp, text_topk, audio_temp,
                                                          audio_topk, seed],
                   outputs=[rtc], time_limit=options.time_limit,
                   concurrency_limit=pool.slots_total + options.max_queue)
        rtc.on_additional_outputs(lambda *a: a[-4:], outputs=[transcript, status, stats, call_id],
                                  concurrency_limit=None, queue=False, show_progress="hidden")
        fetch.click(downloads, call_id, [wav, txt])
        timer = gr.Timer(2.0)
        timer.tick(lambda: stats_line(pool), None, stats, show_progress="hidden")
    return demo
