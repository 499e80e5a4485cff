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
from typing import Any

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

# When each step of starting a call happens in the page (performance.now(), ms), in window.__t:
# the click on Record, the offer sent and its answer back (fastrtc sends it through Gradio's
# component server), the peer connection connected, and the first agent sound played (the first
# 5 ms block of the received audio above -40 dBFS). window.__onsets gets the AudioContext time of
# each sharp onset in the received audio (for the click round trip); the page's own audio element
# still plays the call. Goes after RECORD_PCS.
CALL_TIMING = """
(() => {
  window.__t = {};
  window.__onsets = [];
  const mark = (name) => { if (window.__t[name] === undefined) window.__t[name] = performance.now(); };
  document.addEventListener("click", (e) => {
    if (e.target.closest && e.target.closest('button[aria-label="start stream"]')) mark("click");
  }, true);
  const fetch0 = window.fetch;
  window.fetch = async (url, init) => {
    const offer = init && typeof init.body === "string" && init.body.includes('"fn_name":"offer"');
    if (offer) mark("offer_sent");
    const r = await fetch0(url, init);
    if (offer) mark("answer");
    return r;
  };
  window.__audioCtx = () => window.__actx || (window.__actx = new AudioContext({latencyHint: "interactive"}));
  window.__listen = (stream, onsets, first) => {
    const ctx = window.__audioCtx();
    const src = ctx.createMediaStreamSource(stream);
    const proc = ctx.createScriptProcessor(256, 1, 1);
    let quietUntil = 0;
    proc.onaudioprocess = (e) => {
      const x = e.inputBuffer.getChannelData(0);
      let sum = 0, onset = -1;
      for (let i = 0; i < x.length; i++) { sum += x[i] * x[i]; if (onset < 0 && Math.abs(x[i]) > 0.1) onset = i; }
      if (first && 10 * Math.log10(sum / x.length + 1e-20) > -40) mark("first_sound");
      const t = ctx.currentTime - (x.length - Math.max(onset, 0)) / ctx.sampleRate;
      if (onset >= 0 && t > quietUntil) { onsets.push(t); quietUntil = t + 0.3; }
    };
    src.connect(proc);
    proc.connect(ctx.destination);  // a ScriptProcessor only runs connected; its output is silence
  };
  const O = window.RTCPeerConnection;
  window.RTCPeerConnection = function (...args) {
    const pc = new O(...args);
    pc.addEventListener("connectionstatechange", () => { if (pc.connectionState === "connected") mark("connected"); });
    pc.addEventListener("track", (e) => window.__listen(e.streams[0] || new MediaStream([e.track]), window.__onsets, true));
    return pc;
  };
  window.RTCPeerConnection.prototype = O.prototype;
  Object.setPrototypeOf(window.RTCPeerConnection, O);
})();
"""

# The first agent packet the browser received that is audible (above -40 dBov), by the audio level
# the server sends with every packet (RFC 6464; rtc/audio.py `audio_level_dbov`), as the browser
# reports it per source (getSynchronizationSources): window.__t.first_audible (performance.now(),
# ms). It needs no audio output, so it reads the same in Chromium and in a headless Firefox, which
# has no sound device to run Web Audio on (CALL_TIMING's first_sound). Goes after CALL_TIMING.
FIRST_AUDIBLE = """
(() => {
  const poll = () => {
    const pc = window.__pcs && window.__pcs.at(-1);
    for (const r of pc ? pc.getReceivers() : [])
      for (const s of r.getSynchronizationSources())
        if (s.audioLevel > 0.01 && window.__t.first_audible === undefined) window.__t.first_audible = performance.now();
    if (window.__t.first_audible === undefined) setTimeout(poll, 10);
  };
  poll();
})();
"""

# The round trip of a click, read without Web Audio: each sharp onset in the microphone's stream
# and in the received track, as MediaStreamTrackProcessor hands their audio to the page
# (performance.now(), ms, less the samples after the onset). A ScriptProcessor's FIFO against the
# audio element's clock only ratchets up, so it measured part of its own delay; here both ends
# are read the same way, and what the reading adds cancels out. window.__clickSent() gives the
# clicks of the microphone the call sends, window.__clickBack what came back (window.__trackProcessor false: the
# browser has no MediaStreamTrackProcessor). The microphone is a 10 ms 1 kHz burst every second
# from half a second after the call asks for it, in place of the fake device. Goes after
# RECORD_PCS and CALL_TIMING (its AudioContext).
CLICK_ROUND_TRIP = """
(() => {
  window.__clickSentBy = {};  // by microphone track: the page may ask for a microphone more than once
  window.__clickBack = [];
  window.__trackProcessor = typeof MediaStreamTrackProcessor !== "undefined";
  // The clicks of the microphone the call sends (its peer connection's audio sender).
  window.__clickSent = () => {
    const pc = window.__pcs.at(-1);
    const sender = pc && pc.getSenders().find((s) => s.track && s.track.kind === "audio");
    return sender ? (window.__clickSentBy[sender.track.id] || []) : [];
  };
  const watch = async (track, out) => {
    if (!window.__trackProcessor) return;
    const reader = new MediaStreamTrackProcessor({track}).readable.getReader();
    let quietUntil = 0;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      const now = performance.now(), n = value.numberOfFrames, rate = value.sampleRate;
      const x = new Float32Array(n);
      try { value.copyTo(x, {planeIndex: 0, format: "f32-planar"}); } finally { value.close(); }
      let onset = -1;
      for (let i = 0; i < n; i++) if (Math.abs(x[i]) > 0.1) { onset = i; break; }
      if (onset < 0) continue;
      const t = now - 1000 * (n - onset) / rate;
      if (t > quietUntil) { out.push(t); quietUntil = t + 300; }
    }
  };
  navigator.mediaDevices.getUserMedia = async () => {
    const ctx = window.__audioCtx();
    const dest = ctx.createMediaStreamDestination();
    const n = Math.round(0.01 * ctx.sampleRate), buf = ctx.createBuffer(1, n, ctx.sampleRate), x = buf.getChannelData(0);
    for (let i = 0; i < n; i++) x[i] = 0.6 * Math.sin(2 * Math.PI * 1000 * i / ctx.sampleRate) * Math.sin(Math.PI * i / n);
    const t0 = ctx.currentTime + 0.5;
    for (let k = 0; k < 600; k++) {
      const s = ctx.createBufferSource();
      s.buffer = buf;
      s.connect(dest);
      s.start(t0 + k);
    }
    const track = dest.stream.getAudioTracks()[0];
    watch(track, window.__clickSentBy[track.id] = []);
    return dest.stream;
  };
  const O = window.RTCPeerConnection;
  window.RTCPeerConnection = function (...args) {
    const pc = new O(...args);
    pc.addEventListener("track", (e) => { if (e.track.kind === "audio") watch(e.track, window.__clickBack); });
    return pc;
  };
  window.RTCPeerConnection.prototype = O.prototype;
  Object.setPrototypeOf(window.RTCPeerConnection, O);
})();
"""


def click_trips(sent: Sequence[float], back: Sequence[float], longest_ms: float = 900.0) -> list[tuple[float, float]]:
    """(when each click went out, its round trip), in ms, for the clicks that came back: the first
    onset within `longest_ms` after it."""
    out = []
    for click in sent:
        came = [t - click for t in back if 0.0 < t - click < longest_ms]
        if came:
            out.append((click, min(came)))
    return out


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

    def log_tail(self, lines: int = 60) -> str:
        """The end of the app's log, for a failure's message (a module's app outlives its tests)."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> str:
        return self.call(get_text, f"{self.base_url}/metrics")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def recordings_folders(self) -> list[Path]:
        """This app's own recordings folders in its temp folder."""
        return sorted(self.tmpdir.glob(f"personaplex-calls-{self.proc.pid}-*"))

    def room_empty(self) -> bool:
        status = self.status()
        return status["slots_free"] == status["slots_total"] and not any(status["calls_by_door"].values()) \
            and not status.get("queue_length")

    def wait_empty(self, timeout: float = 15.0) -> None:
        """Until no call holds a slot or waits: a test of a shared app starts from an empty room,
        whatever the test before it left behind (its sockets may still be closing)."""
        wait_for(self.room_empty, timeout, "an empty room before the test")

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

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0, group: bool = False) -> float:
        """Send `sig` (to the app's whole process group with `group`, as a terminal's Ctrl-C or a
        container's stop does: `launched_app(own_group=True)`) and wait for the exit; the seconds
        it took (the process is killed after `timeout`)."""
        began = time.monotonic()
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
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
                 loopback: bool = True, entry: str = "app.py", own_group: bool = False) -> Iterator[LaunchedApp]:
    """The tiny-model app on `host`, run under `prefix` (e.g. `ip netns exec NS`) from `entry` (a
    script that runs the app's main). On exit it gets SIGTERM, and the test fails if it left its
    recordings folder behind."""
    port = free_port()
    tmpdir = tmp / "tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    log = tmp / "app.log"
    full_env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", TMPDIR=str(tmpdir))
    full_env.pop("HF_TOKEN", None)
    if loopback:
        full_env["PERSONAPLEX_LOOPBACK_ICE"] = "1"
    full_env.update(env or {})
    cmd = [*prefix, sys.executable, entry, "--model", "tiny", "--host", host, "--port", str(port),
           "--cache-dir", str(cache_dir), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=own_group)
    app = LaunchedApp(proc, f"http://{host}:{port}", log, tmpdir, call or (lambda fn, *a: fn(*a)))
    try:
        app.wait_ready()
        yield app
    except BaseException:
        # The app's own account of what happened (who was seated, queued or released, and why) is in
        # its log; show its end beside the failure, as CI keeps nothing else of a clean clone's run.
        print("---- the app's log, its end ----", app.log_tail(200), sep="\n", file=sys.stderr)
        raise
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
             executable: str = CHROMIUM, permissions: Sequence[str] = ("microphone",), **screen: Any):
    """A persistent Chromium context with the fake microphone playing `mic_wav`; `screen`: more of
    Playwright's context options (a phone's `viewport`, `is_mobile`, `has_touch`)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(user_dir), executable_path=executable, headless=True,
            args=[*CHROMIUM_FLAGS, f"--use-file-for-fake-audio-capture={mic_wav}", *extra_args],
            ignore_default_args=["--mute-audio"], permissions=list(permissions), **screen)
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
