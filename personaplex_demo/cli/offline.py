"""One conversation from an audio file: the caller's audio goes in, the agent's audio and the
transcript come out, as long as the input (docs/transcripts.md § Offline CLI).

Exit status: 0 on success, 2 for a bad input, voice, persona, sampling knob or output path,
1 when the model cannot be loaded, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import av
import numpy as np
import soundfile as sf
from tqdm import tqdm

from ..call_settings import DEFAULT_VOICE, persona_token_ids
from ..engine.pcm import LockstepEngine, SamplingParams
from ..errors import CallerError, CheckpointError
from ..logs import configure_logging
from ..runtime.build import RuntimeOptions, build_runtime, check_placement
from ..runtime.tokenizer import TextTokenizer
from ..runtime.voices import VoiceCatalog
from .config import AppConfig, add_options

log = logging.getLogger(__name__)

SAMPLE_RATE = LockstepEngine.sample_rate  # 24 kHz
FRAME_SIZE = LockstepEngine.frame_size  # 1920 samples = 80 ms
FRAME_MS = FRAME_SIZE * 1000 // SAMPLE_RATE
DEFAULT_PERSONA = ("You are a wise and friendly teacher. Answer questions or provide advice in a clear "
                   "and engaging way.")  # NVIDIA cli/offline.py's default text prompt
_CHUNK_SECONDS = 10  # resample in pieces of this length, so long files never need two full copies

EXIT_OK, EXIT_MODEL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class OfflineError(Exception):
    """A problem the user can fix (bad file, path or option): one line, exit status 2."""


# ---- reading ------------------------------------------------------------------------------------


def _decode(path: Path) -> tuple[np.ndarray, int]:
    """Decode the first audio stream with FFmpeg; returns float32 [channels, n] and the rate."""
    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise OfflineError(f"{path}: the file has no audio stream")
        stream = container.streams.audio[0]
        normalise = None  # to planar float at the first frame's layout and rate
        chunks: list[np.ndarray] = []
        for frame in container.decode(stream):
            if normalise is None:
                normalise = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=frame.sample_rate)
                rate = frame.sample_rate
            chunks.extend(f.to_ndarray() for f in normalise.resample(frame))
        if normalise is None:
            return np.zeros((1, 0), dtype=np.float32), stream.rate or SAMPLE_RATE
        chunks.extend(f.to_ndarray() for f in normalise.resample(None))
    return np.concatenate(chunks, axis=1).astype(np.float32, copy=False), rate


def _resample(mono: np.ndarray, rate: int) -> np.ndarray:
    """Mono float32 at `rate` to 24 kHz with FFmpeg's libswresample (PyAV), fed in chunks; the
    resampler is stateful, so the chunk joins are seamless, and its flush returns the tail."""
    if rate == SAMPLE_RATE:
        return mono
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    out: list[np.ndarray] = []
    step = rate * _CHUNK_SECONDS
    for start in range(0, len(mono), step):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(mono[None, start:start + step]), format="flt",
                                           layout="mono")
        frame.sample_rate = rate
        out.extend(f.to_ndarray()[0] for f in resampler.resample(frame))
    out.extend(f.to_ndarray()[0] for f in resampler.resample(None))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def read_input(path: Path) -> np.ndarray:
    """Read any common audio file as mono 24 kHz float32, exactly round(duration * 24 kHz) long."""
    if not path.exists():
        raise OfflineError(f"input file not found: {path}")
    if path.is_dir():
        raise OfflineError(f"the input {path} is a folder, not an audio file")
    if not os.access(path, os.R_OK):
        raise OfflineError(f"cannot read the input file {path}: permission denied")
    try:
        channels, rate = _decode(path)
    except (av.FFmpegError, OSError, ValueError) as exc:
        reason = (getattr(exc, "strerror", None) or str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise OfflineError(f"cannot read {path} as audio: not a recognised or readable audio file "
                           f"({reason})") from None
    if channels.shape[1] == 0:
        raise OfflineError(f"{path} holds no audio samples")
    if rate <= 0:
        raise OfflineError(f"{path}: invalid sample rate {rate}")
    mono = channels.mean(axis=0, dtype=np.float32) if channels.shape[0] > 1 else channels[0]
    target = round(channels.shape[1] * SAMPLE_RATE / rate)
    pcm = _fit(_resample(np.ascontiguousarray(mono, dtype=np.float32), rate), target)
    log.info("input %s: %.2f s, %d Hz, %d channel%s", path, channels.shape[1] / rate, rate, channels.shape[0],
             "" if channels.shape[0] == 1 else "s")
    return pcm


def _fit(x: np.ndarray, length: int) -> np.ndarray:
    """Trim `x`, or pad it with zeros, to exactly `length` samples."""
    return np.pad(x[:length], (0, max(0, length - len(x))))


# ---- writing ------------------------------------------------------------------------------------


def check_writable(path: Path, what: str) -> None:
    """Fail before the model runs if `path` cannot be written."""
    if path.is_dir():
        raise OfflineError(f"the {what} path {path} is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise OfflineError(f"cannot write the {what} {path}: the folder {parent} does not exist")
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK):
        raise OfflineError(f"cannot write the {what} {path}: permission denied")


def write_wav(path: Path, pcm: np.ndarray) -> None:
    """Mono 24 kHz 16-bit PCM; the float audio is clipped to [-1, 1] first."""
    pcm16 = np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
    try:
        sf.write(str(path), pcm16, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    except (sf.SoundFileError, RuntimeError, OSError) as exc:
        raise OfflineError(f"cannot write the output audio {path}: {exc}") from None


def write_json(path: Path, data: dict) -> None:
    try:
        path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise OfflineError(f"cannot write the transcript {path}: {exc.strerror or exc}") from None


# ---- the conversation ---------------------------------------------------------------------------


@dataclass
class Conversation:
    pcm: np.ndarray  # float32 [N] agent audio, as long as the input
    pieces: list[str]  # transcript text per frame ("" for most)

    @property
    def text(self) -> str:
        return "".join(self.pieces).strip()


def converse(engine: LockstepEngine, pcm: np.ndarray, voice: str, persona: str, sampling: SamplingParams,
             progress: bool = False) -> Conversation:
    """Run one session in slot 0 of `engine`, frame by frame (the last one padded with zeros)."""
    n_frames = -(-len(pcm) // FRAME_SIZE)
    engine.start_session(0, voice, persona, sampling)
    out = np.zeros(n_frames * FRAME_SIZE, dtype=np.float32)
    pieces: list[str] = []
    bar = tqdm(total=n_frames, unit="s", unit_scale=FRAME_SIZE / SAMPLE_RATE, desc="conversation",
               file=sys.stderr, disable=not progress, leave=False, dynamic_ncols=True,
               bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s audio [{elapsed}<{remaining}, {rate_fmt}]")
    try:
        for i, frame in enumerate(_fit(pcm, n_frames * FRAME_SIZE).reshape(n_frames, 1, FRAME_SIZE)):
            tick = engine.step(frame)
            out[i * FRAME_SIZE:(i + 1) * FRAME_SIZE] = tick.pcm[0]
            pieces.append(tick.text[0])
            bar.update(1)
    finally:
        bar.close()
        rest = engine.end_session(0)
    if rest and pieces:
        pieces[-1] += rest  # text the decoder held back (an unfinished UTF-8 sequence)
    return Conversation(_fit(out, len(pcm)), pieces)


def transcript_json(conv: Conversation, model: str, voice: str, persona: str, seed: int,
                    sampling: SamplingParams, duration: float) -> dict:
    frame_s = FRAME_SIZE / SAMPLE_RATE
    frames = [{"frame": i, "start_s": round(i * frame_s, 6), "end_s": round(min((i + 1) * frame_s, duration), 6),
               "text": piece}
              for i, piece in enumerate(conv.pieces) if piece]
    knobs = {k: v for k, v in asdict(sampling).items() if k != "seed"}
    return {"model": model, "voice": voice, "persona": persona, "seed": seed, "sample_rate": SAMPLE_RATE,
            "frame_ms": FRAME_MS, "duration_s": round(duration, 6), "sampling": knobs, "text": conv.text,
            "frames": frames}


# ---- command line -------------------------------------------------------------------------------


def _prog() -> str:
    """`personaplex-offline` when run as the installed command; the module form under `python -m`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("personaplex-") else "python -m personaplex_demo.cli.offline"


def build_parser() -> argparse.ArgumentParser:
    """The offline CLI's flags: its own (input, output, persona, sampling), with the NVIDIA CLI's
    names for the sampling knobs, and the app's model flags."""
    knobs = SamplingParams()
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="Run one PersonaPlex conversation from an audio file: the file is the caller, and the "
                    "agent's audio (mono 24 kHz WAV, as long as the input) and transcript (JSON) come out.")
    p.add_argument("--input", "-i", type=Path, required=True,
                   help="caller audio: WAV, FLAC, OGG, MP3, M4A, ... at any sample rate and channel count")
    p.add_argument("--output", "-o", type=Path, required=True, help="agent audio to write (WAV)")
    p.add_argument("--transcript", "-t", type=Path, help="transcript to write (JSON); none if omitted")
    p.add_argument("--voice", default=DEFAULT_VOICE, help="voice prompt name (default: %(default)s)")
    p.add_argument("--persona", default=DEFAULT_PERSONA, help="persona / system prompt text (default: %(default)r)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed, 0..4294967295; -1 or none picks one at random (recorded in the JSON; "
                        "default: random)")
    p.add_argument("--greedy", action="store_true", help="pick the most likely token instead of sampling (default: off)")
    p.add_argument("--temp-text", type=float, default=knobs.text_temperature,
                   help="text temperature (default: %(default)s)")
    p.add_argument("--topk-text", type=int, default=knobs.text_top_k, help="text top-k (default: %(default)s)")
    p.add_argument("--temp-audio", type=float, default=knobs.audio_temperature,
                   help="audio temperature (default: %(default)s)")
    p.add_argument("--topk-audio", type=int, default=knobs.audio_top_k, help="audio top-k (default: %(default)s)")
    # The model's flags and variables are the app's own (cli/config.py).
    add_options(p, AppConfig, os.environ, names=("model", "device", "dtype", "weights", "cache_dir", "hf_repo"))
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar; warnings and errors only (default: off)")
    return p


def _configure_logging(quiet: bool) -> None:
    """Terse lines on stderr when the process has no handler yet, plus token redaction."""
    if not logging.getLogger().handlers:
        # The library's own chatter (loading, voices) stays at WARNING unless asked for.
        logging.getLogger("personaplex_demo").setLevel(logging.WARNING)
        log.setLevel(logging.WARNING if quiet else logging.INFO)
    configure_logging(logging.WARNING if quiet else logging.INFO, fmt="%(levelname)s %(message)s")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    outputs = [(args.output, "output audio")] + ([(args.transcript, "transcript")] if args.transcript else [])
    for path, what in outputs:
        if path.resolve() == args.input.resolve():
            raise OfflineError(f"the {what} {path} is the input file; choose another name")
    if args.transcript and args.output.resolve() == args.transcript.resolve():
        raise OfflineError("--output and --transcript name the same file")
    for path, what in outputs:
        check_writable(path, what)
    pcm = read_input(args.input)
    duration = len(pcm) / SAMPLE_RATE

    try:
        check_placement(args.device, args.dtype, args.weights)
    except ValueError as exc:
        raise OfflineError(str(exc)) from None
    seed = args.seed if args.seed is not None and args.seed != -1 else secrets.randbelow(2**32)
    sampling = SamplingParams(text_temperature=args.temp_text, text_top_k=args.topk_text,
                              audio_temperature=args.temp_audio, audio_top_k=args.topk_audio,
                              seed=seed, greedy=args.greedy)
    sampling.validate()  # before loading a 17 GB model

    def check_request(tokenizer: TextTokenizer, voices: VoiceCatalog) -> None:
        voices.check_name(args.voice)
        persona_token_ids(tokenizer, args.persona)

    # The voice and the persona are checked before the weights are fetched or loaded.
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    runtime = build_runtime(RuntimeOptions(model=args.model, device=args.device, dtype=args.dtype, weights=args.weights,
                                           slots=1, hf_repo=args.hf_repo, cache_dir=cache_dir), check=check_request)
    if runtime.banner:  # a warning when "auto" fell back to the tiny model, a note when it was asked for
        log.log(logging.INFO if args.model == "tiny" else logging.WARNING, "%s", runtime.banner)
    if (args.seed is None or args.seed == -1) and not args.greedy:
        log.info("seed %d (pass --seed %d to repeat this run)", seed, seed)

    t0 = time.monotonic()
    progress = not args.quiet and sys.stderr.isatty()
    conv = converse(runtime.engine, pcm, args.voice, args.persona, sampling, progress=progress)
    took = time.monotonic() - t0

    write_wav(args.output, conv.pcm)
    if args.transcript:
        write_json(args.transcript, transcript_json(conv, runtime.model_name, args.voice, args.persona, seed,
                                                    sampling, duration))
    written = f"{args.output}" + (f" and {args.transcript}" if args.transcript else "")
    log.info("wrote %s: %.2f s of audio, %d words, in %.1f s (%.2fx real time, %.1f s in all)", written,
             duration, len(conv.text.split()), took, duration / max(took, 1e-9), time.monotonic() - started)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.quiet)
    try:
        return run(args)
    except (OfflineError, CallerError) as exc:  # what the user can fix: one line
        log.error("%s", exc)
        return EXIT_USAGE
    except CheckpointError as exc:
        log.error("cannot load the model: %s", exc)
        return EXIT_MODEL
    except KeyboardInterrupt:
        log.error("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
