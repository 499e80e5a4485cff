"""The offline CLI on the tiny model: formats and rates in, exact-length WAV and JSON out, errors."""

from __future__ import annotations

import json
import logging

import av
import numpy as np
import pytest
import soundfile as sf

from personaplex_demo.call_settings import VOICE_NAMES
from personaplex_demo.cli.offline import main
from personaplex_demo.runtime.tiny import ensure_tiny_repo

PERSONA = "You enjoy having a good conversation."
OFFLINE_LOGGER = "personaplex_demo.cli.offline"


def offline_errors(caplog) -> list:
    """The CLI's own error records: another test's leftovers (an asyncio task collected now) may log too."""
    return [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == OFFLINE_LOGGER]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The tiny model, built once for this module."""
    directory = tmp_path_factory.mktemp("offline-cache")
    ensure_tiny_repo(directory)
    return directory


@pytest.fixture(scope="module")
def stereo_44k(tmp_path_factory):
    """~2 s of 44.1 kHz stereo: a different tone in each channel."""
    rate, n = 44100, 88_211
    t = np.arange(n) / rate
    x = np.stack([0.3 * np.sin(2 * np.pi * 220 * t), 0.2 * np.sin(2 * np.pi * 330 * t)], axis=1)
    path = tmp_path_factory.mktemp("inputs") / "caller.wav"
    sf.write(path, x.astype(np.float32), rate, subtype="PCM_16")
    return path, n / rate


def run_cli(cache_dir, inp, out, *extra, transcript=None):
    argv = ["--input", str(inp), "--output", str(out), "--voice", "NATF2", "--persona", PERSONA,
            "--model", "tiny", "--cache-dir", str(cache_dir), "--quiet", *extra]
    if transcript is not None:
        argv += ["--transcript", str(transcript)]
    return main(argv)


def test_stereo_44k_in_gives_mono_24k_out_of_the_same_length(cache_dir, stereo_44k, tmp_path):
    inp, duration = stereo_44k
    out, js = tmp_path / "agent.wav", tmp_path / "agent.json"
    assert run_cli(cache_dir, inp, out, "--seed", "42424242", transcript=js) == 0

    info = sf.info(out)
    assert (info.samplerate, info.channels, info.format, info.subtype) == (24000, 1, "WAV", "PCM_16")
    assert info.frames == round(duration * 24000)
    audio, _ = sf.read(out, dtype="float32")
    assert np.isfinite(audio).all() and np.abs(audio).max() > 0

    data = json.loads(js.read_text(encoding="utf-8"))
    assert data["model"] == "tiny" and data["voice"] == "NATF2" and data["persona"] == PERSONA
    assert data["seed"] == 42424242 and data["sample_rate"] == 24000 and data["frame_ms"] == 80
    n_frames = -(-info.frames // 1920)
    frames = data["frames"]
    assert frames, "the tiny model babbles, so some frames carry text"
    assert all(f["text"] for f in frames)
    indices = [f["frame"] for f in frames]
    assert indices == sorted(set(indices)) and 0 <= indices[0] and indices[-1] < n_frames
    for f in frames:
        assert f["start_s"] == pytest.approx(f["frame"] * 0.08)
        assert f["end_s"] == pytest.approx(min((f["frame"] + 1) * 0.08, info.frames / 24000))
        assert f["start_s"] < f["end_s"]
    assert data["text"] == "".join(f["text"] for f in frames).strip()


def test_same_seed_same_audio_and_greedy_is_deterministic(cache_dir, stereo_44k, tmp_path):
    inp, _ = stereo_44k
    runs = {}
    for name, extra in [("s1", ["--seed", "7"]), ("s2", ["--seed", "7"]), ("s3", ["--seed", "8"]),
                        ("g1", ["--greedy"]), ("g2", ["--greedy"])]:
        out = tmp_path / f"{name}.wav"
        assert run_cli(cache_dir, inp, out, *extra, transcript=tmp_path / f"{name}.json") == 0
        runs[name] = (out.read_bytes(), json.loads((tmp_path / f"{name}.json").read_text())["text"])
    assert runs["s1"] == runs["s2"]
    assert runs["s1"][0] != runs["s3"][0]
    assert runs["g1"] == runs["g2"]


def test_int8_weights_give_audio_of_the_same_length(cache_dir, stereo_44k, tmp_path):
    inp, _ = stereo_44k
    runs = {}
    for weights in ("dense", "int8"):
        out = tmp_path / f"{weights}.wav"
        assert run_cli(cache_dir, inp, out, "--greedy", "--weights", weights) == 0
        runs[weights] = sf.read(out)[0]
    assert runs["int8"].shape == runs["dense"].shape and np.abs(runs["int8"]).max() > 0
    assert not np.array_equal(runs["int8"], runs["dense"])  # the int8 weights did run


def test_8khz_mono_input(cache_dir, tmp_path):
    rate, n = 8000, 12_345
    x = 0.25 * np.sin(2 * np.pi * 300 * np.arange(n) / rate)
    inp, out = tmp_path / "phone.wav", tmp_path / "out.wav"
    sf.write(inp, x, rate, subtype="PCM_16")
    assert run_cli(cache_dir, inp, out, "--greedy") == 0
    info = sf.info(out)
    assert (info.samplerate, info.channels) == (24000, 1)
    assert info.frames == round(n / rate * 24000)


def test_m4a_goes_through_ffmpeg(cache_dir, tmp_path):
    rate, n = 48000, 48000
    x = (0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / rate)).astype(np.float32)
    inp, out = tmp_path / "caller.m4a", tmp_path / "out.wav"
    with av.open(str(inp), "w") as container:
        stream = container.add_stream("aac", rate=rate)
        for start in range(0, n, 1024):
            frame = av.AudioFrame.from_ndarray(x[None, start:start + 1024], format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    assert run_cli(cache_dir, inp, out, "--greedy") == 0
    info = sf.info(out)
    assert (info.samplerate, info.channels) == (24000, 1)
    assert abs(info.frames - 24000) <= 2048  # AAC pads to whole 1024-sample packets


def test_unknown_voice_lists_the_voices(cache_dir, stereo_44k, tmp_path, caplog):
    inp, _ = stereo_44k
    out = tmp_path / "out.wav"
    argv = ["-i", str(inp), "-o", str(out), "--voice", "NOBODY", "--model", "tiny", "--cache-dir", str(cache_dir),
            "--quiet"]
    with caplog.at_level(logging.ERROR, logger=OFFLINE_LOGGER):
        assert main(argv) == 2
    errors = offline_errors(caplog)
    assert len(errors) == 1 and errors[0].exc_info is None
    message = errors[0].getMessage()
    assert "\n" not in message and "NOBODY" in message
    assert all(name in message for name in VOICE_NAMES)
    assert not out.exists()


def test_persona_over_the_limit(cache_dir, stereo_44k, tmp_path, caplog):
    inp, _ = stereo_44k
    argv = ["-i", str(inp), "-o", str(tmp_path / "out.wav"), "--persona", "word " * 1000, "--model", "tiny",
            "--cache-dir", str(cache_dir), "--quiet"]
    with caplog.at_level(logging.ERROR, logger=OFFLINE_LOGGER):
        assert main(argv) == 2
    assert "limit" in caplog.text


@pytest.mark.parametrize("case", ["garbage", "missing", "empty"])
def test_unreadable_input(cache_dir, tmp_path, caplog, case):
    inp = tmp_path / "caller.wav"
    if case == "garbage":
        inp.write_bytes(b"this is not audio\n" * 200)
    elif case == "empty":
        sf.write(inp, np.zeros(0, dtype=np.float32), 16000)
    out = tmp_path / "out.wav"
    with caplog.at_level(logging.ERROR, logger=OFFLINE_LOGGER):
        assert run_cli(cache_dir, inp, out) == 2
    errors = [r.getMessage() for r in offline_errors(caplog)]
    assert len(errors) == 1 and str(inp) in errors[0] and "\n" not in errors[0]
    expected = {"garbage": "cannot read", "missing": "not found", "empty": "no audio"}[case]
    assert expected in errors[0]
    assert not out.exists()


def test_unwritable_output_fails_before_the_model_runs(cache_dir, stereo_44k, tmp_path, caplog):
    inp, _ = stereo_44k
    with caplog.at_level(logging.ERROR, logger=OFFLINE_LOGGER):
        assert run_cli(cache_dir, inp, tmp_path / "no-such-folder" / "out.wav") == 2
        assert run_cli(cache_dir, inp, tmp_path / "out.wav", transcript=tmp_path) == 2
    errors = [r.getMessage() for r in offline_errors(caplog)]
    assert "does not exist" in errors[0] and "folder" in errors[1]


def test_bad_sampling_knob_is_a_usage_error(cache_dir, stereo_44k, tmp_path, caplog):
    inp, _ = stereo_44k
    with caplog.at_level(logging.ERROR, logger=OFFLINE_LOGGER):
        assert run_cli(cache_dir, inp, tmp_path / "out.wav", "--topk-audio", "5000") == 2
    assert "audio_top_k" in caplog.text
