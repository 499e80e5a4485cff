"""What the end-to-end tests share: the launched app, Chromium with a fake microphone, page probes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.common import free_port, get_json

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = "/usr/bin/chromium"
IN_CI = os.environ.get("CI") == "true"

# Records every RTCPeerConnection the page makes in window.__pcs (fastrtc does not expose its own).
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

# The route the call took: the types of the selected candidate pair's two ends, and the bytes it
# carried each way (media, RTCP and consent checks, as a relay counts them).
SELECTED_ROUTE = """
async () => {
  const pc = window.__pcs.at(-1);
  const stats = await pc.getStats();
  let pair = null;
  stats.forEach(r => {
    if (r.type === "transport" && r.selectedCandidatePairId) pair = stats.get(r.selectedCandidatePairId);
  });
  if (!pair) stats.forEach(r => { if (r.type === "candidate-pair" && r.nominated && r.state === "succeeded") pair = r; });
  if (!pair) return null;
  const local = stats.get(pair.localCandidateId), remote = stats.get(pair.remoteCandidateId);
  return {local: local.candidateType, remote: remote.candidateType, remoteAddress: remote.address,
          policy: pc.getConfiguration().iceTransportPolicy, bytesSent: pair.bytesSent,
          bytesReceived: pair.bytesReceived};
}
"""


def missing_tools(extra: Sequence[str] = ()) -> list[str]:
    missing = [p for p in (CHROMIUM,) if not Path(p).exists()]
    missing += [t for t in ("espeak-ng", "sox", *extra) if shutil.which(t) is None]
    try:
        import playwright  # noqa: F401
    except ImportError:
        missing.append("playwright")
    return missing


def require(missing: list[str], hint: str = "apt-get install -y chromium espeak-ng sox") -> None:
    """Skip a test that lacks its tools locally; fail it under CI=true, where they must be there."""
    if missing:
        msg = f"this test needs {', '.join(missing)} ({hint})"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def get_text(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@dataclass
class LaunchedApp:
    """`python app.py` in a subprocess with its own temp folder (TMPDIR), so what it leaves there
    can be checked. `call` runs a function where the app can be reached (the test's network
    namespace, if any)."""

    proc: subprocess.Popen
    base_url: str
    log: Path
    tmpdir: Path
    call: Callable = field(default=lambda fn, *a: fn(*a))

    def status(self) -> dict:
        return self.call(get_json, f"{self.base_url}/api/status", 2.0)

    def metrics(self) -> str:
        return self.call(get_text, f"{self.base_url}/metrics")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def recordings_folders(self) -> list[Path]:
        """This app's own recordings folders in its temp folder."""
        return sorted(self.tmpdir.glob(f"personaplex-calls-{self.proc.pid}-*"))

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until the page is served and `launch` has returned (its log line)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.status()
                if "serving on http" in self.log_text():
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the app did not start:\n{self.log_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> float:
        """Send `sig` and wait for the exit; the seconds it took (the process is killed after `timeout`)."""
        began = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return time.monotonic() - began


@contextlib.contextmanager
def launched_app(tmp: Path, cache_dir: Path, *, args: Sequence[str] = (), env: dict | None = None,
                 host: str = "127.0.0.1", prefix: Sequence[str] = (), call: Callable | None = None,
                 loopback: bool = True) -> Iterator[LaunchedApp]:
    """The tiny-model app on `host`, run under `prefix` (e.g. `ip netns exec NS`). On exit it gets
    SIGTERM, and the test fails if it left its recordings folder behind."""
    port = free_port()
    tmpdir = tmp / "tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    log = tmp / "app.log"
    full_env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", TMPDIR=str(tmpdir))
    full_env.pop("HF_TOKEN", None)
    if loopback:
        full_env["PERSONAPLEX_LOOPBACK_ICE"] = "1"
    full_env.update(env or {})
    cmd = [*prefix, sys.executable, "app.py", "--model", "tiny", "--host", host, "--port", str(port),
           "--cache-dir", str(cache_dir), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT)
    app = LaunchedApp(proc, f"http://{host}:{port}", log, tmpdir, call or (lambda fn, *a: fn(*a)))
    try:
        app.wait_ready()
        yield app
    finally:
        app.stop()
    left = app.recordings_folders()
    assert not left, f"the app left its recordings behind: {left}"


def make_mic_wav(directory: Path, text: str = "Hello there. Can you tell me about the weather on Mars today?") -> Path:
    """Speech for Chromium's fake microphone (it loops the file)."""
    raw, wav = directory / "speech_raw.wav", directory / "mic.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), text], check=True)
    subprocess.run(["sox", str(raw), "-r", "48000", "-c", "1", "-b", "16", str(wav), "pad", "0.5", "1.0"], check=True)
    return wav


CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                  "--autoplay-policy=no-user-gesture-required")


@contextlib.contextmanager
def chromium(user_dir: Path, mic_wav: Path, *, extra_args: Sequence[str] = ("--allow-loopback-in-peer-connection",),
             executable: str = CHROMIUM, permissions: Sequence[str] = ("microphone",)):
    """A persistent Chromium context with the fake microphone playing `mic_wav`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(user_dir), executable_path=executable, headless=True,
            args=[*CHROMIUM_FLAGS, f"--use-file-for-fake-audio-capture={mic_wav}", *extra_args],
            ignore_default_args=["--mute-audio"], permissions=list(permissions))
        try:
            yield ctx
        finally:
            ctx.close()


def start_call(page, timeout_ms: int = 20_000) -> None:
    """Press Record on a loaded page and wait until WebRTC is connected."""
    page.locator('[title="grant webcam access"]').click()
    page.locator('button[aria-label="start stream"]').first.click()
    page.wait_for_function("window.__pcs.length && window.__pcs.at(-1).connectionState === 'connected'",
                           timeout=timeout_ms)


def stop_call(page) -> None:
    page.locator('button[aria-label="start stream"]').first.click()  # the same button stops the call


def wait_for(predicate: Callable[[], bool], seconds: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {seconds:g} s"
        time.sleep(interval)


def temp_recordings(pid: int) -> list[Path]:
    """Recordings folders of process `pid` in this process's temp folder."""
    return sorted(Path(tempfile.gettempdir()).glob(f"personaplex-calls-{pid}-*"))
