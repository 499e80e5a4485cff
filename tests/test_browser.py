"""End to end in a real browser: Debian Chromium with a fake microphone against the launched app."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = "/usr/bin/chromium"
IN_CI = os.environ.get("CI") == "true"

RECORD_PCS = """
(() => {
  const O = window.RTCPeerConnection;
  window.__pcs = [];
  window.RTCPeerConnection = function (...args) { const pc = new O(...args); window.__pcs.push(pc); return pc; };
  window.RTCPeerConnection.prototype = O.prototype;
  Object.setPrototypeOf(window.RTCPeerConnection, O);
})();
"""

INBOUND_BYTES = """
async () => {
  const pc = window.__pcs.at(-1);
  if (!pc) return -1;
  let n = 0;
  (await pc.getStats()).forEach(r => { if (r.type === "inbound-rtp" && r.kind === "audio") n += r.bytesReceived; });
  return n;
}
"""

OUTBOUND_PACKETS = """
async () => {
  let n = 0;
  (await window.__pcs.at(-1).getStats()).forEach(r => {
    if (r.type === "outbound-rtp" && r.kind === "audio") n += r.packetsSent;
  });
  return n;
}
"""


def _missing() -> list[str]:
    missing = [p for p in (CHROMIUM,) if not Path(p).exists()]
    missing += [t for t in ("espeak-ng", "sox") if shutil.which(t) is None]
    try:
        import playwright  # noqa: F401
    except ImportError:
        missing.append("playwright")
    return missing


@pytest.fixture(scope="module")
def need_browser():
    missing = _missing()
    if missing:
        msg = f"browser test needs {', '.join(missing)} (apt-get install -y chromium espeak-ng sox)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def app_server(need_browser, tiny_cache_dir, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("app") / "app.log"
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", PERSONAPLEX_LOOPBACK_ICE="1")
    env.pop("HF_TOKEN", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py", "--model", "tiny", "--slots", "2", "--host", "127.0.0.1",
                                 "--port", str(port), "--cache-dir", str(tiny_cache_dir)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                _status(port)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the app did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def mic_wav(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mic")
    raw, wav = d / "speech_raw.wav", d / "mic.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), "Hello there. Can you tell me about the weather on Mars today?"],
                   check=True)
    subprocess.run(["sox", str(raw), "-r", "48000", "-c", "1", "-b", "16", str(wav), "pad", "0.5", "1.0"], check=True)
    return wav


def test_a_call_in_chromium(app_server, mic_wav, tmp_path):
    from playwright.sync_api import sync_playwright

    port = app_server
    ARTIFACTS.mkdir(exist_ok=True)
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
             f"--use-file-for-fake-audio-capture={mic_wav}", "--autoplay-policy=no-user-gesture-required",
             "--allow-loopback-in-peer-connection"]
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "udd"), executable_path=CHROMIUM, headless=True,
                                                   args=flags, ignore_default_args=["--mute-audio"],
                                                   permissions=["microphone"])
        try:
            page = ctx.new_page()
            page.add_init_script(RECORD_PCS)
            page.goto(f"http://127.0.0.1:{port}/", wait_until="networkidle")
            assert "tiny offline model" in page.locator("#banner").inner_text()
            assert page.locator("#voice input").input_value() == "NATF2"
            page.locator('[title="grant webcam access"]').click()
            page.locator('button[aria-label="start stream"]').first.click()
            page.wait_for_function("window.__pcs.length && window.__pcs.at(-1).connectionState === 'connected'",
                                   timeout=20_000)
            first, sent_before, since = page.evaluate(INBOUND_BYTES), page.evaluate(OUTBOUND_PACKETS), time.monotonic()
            transcript = page.locator("#transcript-box textarea")
            deadline = time.monotonic() + 25
            texts, later = [""], first
            while time.monotonic() < deadline and not (len(set(texts)) >= 3 and later > first + 5000):
                page.wait_for_timeout(300)
                texts.append(transcript.input_value())
                later = page.evaluate(INBOUND_BYTES)
            assert later > first + 5000, (first, later)  # agent audio keeps arriving
            # The answer asks for 40 ms packets (a=ptime:40), and Chromium sends them: 25 a second, not 50.
            rate = (page.evaluate(OUTBOUND_PACKETS) - sent_before) / (time.monotonic() - since)
            assert 18 < rate < 32, f"{rate:.1f} microphone packets a second"
            assert len(set(texts)) >= 3, f"the transcript did not keep changing: {texts[-3:]}"
            assert texts[-1].startswith(texts[1])  # it streams: each update extends the last one
            assert _status(port)["slots_live"] == 1
            assert "Live" in page.locator("#status-line").inner_text()
            page.screenshot(path=str(ARTIFACTS / "browser-call.png"), full_page=True)
            page.locator('button[aria-label="start stream"]').first.click()  # the same button stops the call
            stopped = time.monotonic()
            while _status(port)["slots_free"] < 2:
                assert time.monotonic() - stopped < 3.0, "Stop did not free the slot within 3 s"
                time.sleep(0.1)
            # The recording of the call is offered for download once it is written.
            page.locator("#download-wav a.download-link").first.wait_for(timeout=8_000)
            assert page.locator("#download-wav .filename").first.inner_text().strip().endswith(".wav")
            page.locator("#download-json a.download-link").first.wait_for(timeout=2_000)
            assert page.locator("#download-json .filename").first.inner_text().strip().endswith(".json")
            assert "Call ended" in page.locator("#status-line").inner_text()
            page.screenshot(path=str(ARTIFACTS / "browser-after-call.png"), full_page=True)
        finally:
            ctx.close()
