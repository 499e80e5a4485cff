"""Checks before any model is loaded: each failure is one line and exit status 2, within seconds."""

from __future__ import annotations

import http.server
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest

from bench.common import free_port
from personaplex_demo.cli import preflight
from personaplex_demo.cli.offline import main as offline_main
from personaplex_demo.cli.preflight import PreflightError, check_cache_folder, check_port
from personaplex_demo.errors import UnknownVoiceError
from personaplex_demo.model.config import ModelFiles
from personaplex_demo.runtime import build
from personaplex_demo.runtime.hub import FILE_BYTES, resolve_model

ROOT = Path(__file__).resolve().parent.parent
REPO = "nvidia/personaplex-7b-v1"


def app_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PERSONAPLEX_") and k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    return dict(env, GRADIO_ANALYTICS_ENABLED="False", **extra)


def run_app(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, list[str], float]:
    """`python app.py ARGS` as a user runs it: (exit status, output lines, seconds)."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "app.py", *args], cwd=ROOT, env=env or app_env(), capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines, time.monotonic() - t0


# ---- the port ------------------------------------------------------------------------------------


def test_a_second_app_on_a_busy_port_exits_within_5_s_naming_port(tmp_path):
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        rc, lines, took = run_app("--model", "tiny", "--port", str(port), "--cache-dir", str(tmp_path / "cache"))
    assert rc == 2, lines
    assert len(lines) == 1, lines
    assert f"port {port}" in lines[0] and "--port" in lines[0] and "already in use" in lines[0]
    assert took < 5.0, f"took {took:.1f} s"
    assert not (tmp_path / "cache").exists()  # nothing was built, let alone loaded


def test_check_port():
    port = free_port()
    check_port("127.0.0.1", port)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        with pytest.raises(PreflightError, match=f"port {port} on 127.0.0.1 is already in use.*--port"):
            check_port("127.0.0.1", port)
        with pytest.raises(PreflightError, match="--port"):
            check_port("0.0.0.0", port)  # all interfaces include the busy one
    for bad in (0, 70000):
        with pytest.raises(PreflightError, match=f"--port {bad} is not a TCP port"):
            check_port("127.0.0.1", bad)
    with pytest.raises(PreflightError, match="--host no-such-host.invalid"):
        check_port("no-such-host.invalid", port)


# ---- the cache folder ----------------------------------------------------------------------------


def test_unwritable_cache_folder_fails_before_the_model(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    rc, lines, _ = run_app("--model", "tiny", "--port", str(free_port()), "--cache-dir", str(blocker / "cache"))
    assert rc == 2 and len(lines) == 1, lines
    assert f"the cache folder {blocker / 'cache'} is not writable" in lines[0] and "--cache-dir" in lines[0]
    rc, lines, _ = run_app("--model", "tiny", "--port", str(free_port()), "--cache-dir", str(blocker))
    assert rc == 2 and len(lines) == 1 and f"the cache folder {blocker} is a file" in lines[0], lines


def test_too_little_room_for_the_download_gives_the_figures(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100e9, 95e9, 5e9))
    with pytest.raises(PreflightError) as err:
        check_cache_folder(tmp_path / "hub", sum(FILE_BYTES.values()))
    msg = str(err.value)
    assert "has 5.0 GB free, but the model download needs 17.1 GB" in msg and "--cache-dir" in msg
    assert "\n" not in msg
    check_cache_folder(tmp_path / "hub", 4e9)  # enough room: no error


# ---- the Hub -------------------------------------------------------------------------------------


class FakeHub(http.server.ThreadingHTTPServer):
    """Answers the Hub's HEAD requests for file metadata with a chosen status, or with sizes."""

    def __init__(self, status: int, error_code: str | None = None, lm_size: int = 16_700_000_000):
        self.status, self.error_code, self.lm_size, self.paths = status, error_code, lm_size, []
        super().__init__(("127.0.0.1", 0), _FakeHubHandler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FakeHubHandler(http.server.BaseHTTPRequestHandler):
    server: FakeHub

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.paths.append(self.path)
        if self.server.status != 200:
            self.send_response(self.server.status)
            if self.server.error_code:
                self.send_header("X-Error-Code", self.server.error_code)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = self.server.lm_size if self.path.endswith(ModelFiles().lm) else 1000
        self.send_response(200)
        self.send_header("X-Repo-Commit", "0123456789abcdef0123456789abcdef01234567")
        self.send_header("ETag", '"abc"')
        self.send_header("Content-Length", str(size))
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def fake_hub(request):
    hub = FakeHub(*request.param)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    yield hub
    hub.shutdown()
    hub.server_close()


@pytest.mark.parametrize("fake_hub", [(401, "GatedRepo"), (403, "GatedRepo"), (401, None), (403, None)],
                         indirect=True, ids=["401-gated", "403-gated", "401", "403"])
def test_gated_401_403_says_accept_the_licence_and_set_hf_token(fake_hub, tmp_path):
    rc, lines, _ = run_app("--model", "personaplex-7b-v1", "--device", "cpu", "--port", str(free_port()),
                           "--cache-dir", str(tmp_path / "hub"),
                           env=app_env(HF_ENDPOINT=fake_hub.endpoint, HF_HOME=str(tmp_path / "hf-home")))
    assert rc == 2 and len(lines) == 1, lines
    line = lines[0]
    assert f"cannot download {REPO}: access denied" in line and f"({fake_hub.status};" in line
    assert f"accept the model licence at https://huggingface.co/{REPO}" in line and "set HF_TOKEN" in line
    assert "HF_TOKEN is not set" in line and "--model tiny" in line
    assert fake_hub.paths and all("/resolve/" in p for p in fake_hub.paths)  # HEAD requests, no download
    assert not any((tmp_path / "hub").rglob("*.safetensors"))


@pytest.mark.parametrize("fake_hub", [(200, None, 10**14)], indirect=True)
def test_no_room_for_the_download_fails_before_it_starts(fake_hub, tmp_path):
    rc, lines, _ = run_app("--model", "personaplex-7b-v1", "--device", "cpu", "--port", str(free_port()),
                           "--cache-dir", str(tmp_path / "hub"),
                           env=app_env(HF_ENDPOINT=fake_hub.endpoint, HF_HOME=str(tmp_path / "hf-home")))
    assert rc == 2 and len(lines) == 1, lines
    assert f"the cache folder {tmp_path / 'hub'} has" in lines[0]
    assert "the model download needs 100000.0 GB" in lines[0]
    assert len(fake_hub.paths) == 4 and not any((tmp_path / "hub").rglob("*.safetensors"))


# ---- the offline CLI -----------------------------------------------------------------------------


@pytest.fixture()
def no_model_loading(monkeypatch):
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the request was checked")

    monkeypatch.setattr(build, "load_lm", refuse)
    monkeypatch.setattr(build, "load_mimi", refuse)


@pytest.mark.parametrize("extra, expected", [
    (["--voice", "NATF9"], "unknown voice 'NATF9'"),
    (["--persona", "x" * 5000], "the persona is 5000 characters long"),
    (["--persona", "bad \x07 bell"], "control characters (U+0007)"),
    (["--persona", "word " * 800], "tokens long with its <system> tags; the limit is 512 tokens"),
], ids=["voice", "persona-chars", "persona-control", "persona-tokens"])
def test_offline_cli_checks_voice_and_persona_before_loading(extra, expected, tiny_cache_dir, tmp_path, caplog,
                                                              no_model_loading):
    inp = tmp_path / "in.wav"
    import numpy as np
    import soundfile as sf

    sf.write(inp, np.zeros(2400, dtype=np.float32), 24000)
    with caplog.at_level(logging.INFO):
        rc = offline_main(["--input", str(inp), "--output", str(tmp_path / "out.wav"), "--model", "tiny",
                           "--cache-dir", str(tiny_cache_dir), "--quiet", *extra])
    assert rc == 2
    errors = [r.getMessage() for r in caplog.records  # the CLI's own: not another test's leftovers
              if r.levelno >= logging.ERROR and r.name.startswith("personaplex_demo")]
    assert len(errors) == 1 and expected in errors[0] and "\n" not in errors[0], errors
    assert not (tmp_path / "out.wav").exists()


def test_the_request_check_runs_before_the_weights_are_fetched(monkeypatch, tiny_repo, tmp_path):
    from personaplex_demo.runtime import hub

    fetched: list[str] = []
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)

    def download(repo_id: str, filename: str, **kwargs: object) -> str:
        fetched.append(filename)
        shutil.copy(tiny_repo / filename, snapshot / filename)
        return str(snapshot / filename)

    def check(directory: Path) -> None:
        assert (directory / ModelFiles().voices).exists()
        raise UnknownVoiceError("unknown voice 'X'")

    monkeypatch.setattr(hub, "hf_hub_download", download)
    for model in ("auto", "personaplex-7b-v1"):  # "auto" must not fall back to the tiny model on it
        fetched.clear()
        with pytest.raises(UnknownVoiceError):
            resolve_model(model, cache_dir=tmp_path, check=check)
        assert fetched == [ModelFiles().tokenizer, ModelFiles().voices]


def test_preflight_is_quiet_and_fast_to_import():
    """The port check must not wait for torch or Gradio to import."""
    code = ("import sys, app, personaplex_demo.cli.preflight, personaplex_demo.runtime.tiny; "
            "sys.exit(any(m in sys.modules for m in ('torch', 'gradio')))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=app_env()).returncode == 0
    assert preflight.EXIT_PREFLIGHT == 2
