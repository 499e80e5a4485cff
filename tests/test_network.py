"""The hosted path: a call through a TURN relay only, and a call over a lossy, jittery link.

Two network namespaces joined by a veth pair (tests/netns.py): the server side runs the app and
Debian's coturn on a private address; the caller side runs Chromium. The app is configured with
that TURN server and relay-only ICE (PERSONAPLEX_ICE_SERVERS, PERSONAPLEX_ICE_RELAY_ONLY), so the
page and the server both offer relay candidates only: the one route a call can take is through
coturn, which must show the allocations and the audio bytes it carried.

The lossy link is `tc netem` on the veth where the kernel has netem. Where it does not (minimal VM
kernels), the caller's TURN traffic passes a forwarder that drops and delays it the same way
(tests/lossy_udp.py); the report says which one ran.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from . import netns
from .browser_support import (
    ARTIFACTS,
    CALL_TIMING,
    CHROMIUM,
    CLICK_ROUND_TRIP,
    INBOUND_BYTES,
    RECORD_PCS,
    SELECTED_ROUTE,
    chromium,
    click_trips,
    launched_app,
    make_mic_wav,
    missing_tools,
    require,
    start_call,
    stop_call,
    wait_for,
)
from .lossy_udp import LossyUdpForwarder

pytestmark = pytest.mark.browser

TURN_USER, TURN_PASSWORD, REALM = "personaplex", "relay-test-secret", "personaplex.test"
CALL_SECONDS = 30  # the lossy call
NETEM = "loss 5% delay 40ms 20ms"
FORWARDER_PORT = 3479

# Every 100 ms: (ms, packets received, packets lost, samples played, samples concealed, connection state).
SAMPLE_AUDIO = """
() => {
  window.__audio = [];
  window.__sampler = setInterval(async () => {
    const pc = window.__pcs.at(-1);
    if (!pc) return;
    (await pc.getStats()).forEach(r => {
      if (r.type === "inbound-rtp" && r.kind === "audio")
        window.__audio.push([performance.now(), r.packetsReceived, r.packetsLost, r.totalSamplesReceived,
                             r.concealedSamples, pc.connectionState]);
    });
  }, 100);
}
"""


class Coturn:
    """Debian's coturn on `ip`:3478 (UDP, long-term credentials), logging every session's usage."""

    def __init__(self, link: netns.Link, work: Path) -> None:
        self.log = work / "turnserver.log"
        cmd = [*link.exec_prefix(link.server_ns), "turnserver", "-n", "--listening-ip", link.server_ip,
               "--relay-ip", link.server_ip, "--listening-port", "3478", "--min-port", "49152",
               "--max-port", "49999", "--lt-cred-mech", "--user", f"{TURN_USER}:{TURN_PASSWORD}", "--realm", REALM,
               "--fingerprint", "--no-tls", "--no-dtls", "--no-tcp", "--no-cli", "--verbose",
               "--log-file", str(self.log), "--simple-log", "--no-stdout-log",
               "--pidfile", str(work / "turnserver.pid"), "--userdb", str(work / "turndb")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for(lambda: self.log.exists() and "UDP listener opened on" in self.text(), 10,
                 "coturn did not start")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def allocations(self) -> int:
        return self.text().count("ALLOCATE processed, success")

    def sessions(self) -> dict[str, dict]:
        """Closed sessions: remote address and the bytes relayed to and from their peers."""
        found: dict[str, dict] = {}
        for sid, rb, sb in re.findall(r"session (\d+): peer usage: .*?rb=(\d+), sp=\d+, sb=(\d+)", self.text()):
            found.setdefault(sid, {})["peer_bytes"] = (int(rb), int(sb))
        for sid, remote in re.findall(r"session (\d+): closed \(2nd stage\).*?remote ([\d.]+):\d+", self.text()):
            found.setdefault(sid, {})["remote"] = remote
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def turn_side(tmp_path_factory):
    """The veth link, coturn on its server side and the fake microphone: (link, coturn, mic, work)."""
    require(missing_tools(("turnserver",)) + netns.missing(),
            "apt-get install -y chromium espeak-ng sox coturn iproute2; run as root")
    work = tmp_path_factory.mktemp("hosted")
    mic = make_mic_wav(work)
    with netns.veth_link(f"pp{os.getpid()}") as link:
        turn = Coturn(link, work)
        try:
            yield link, turn, mic, work
        finally:
            turn.stop()


def hosted_app(link: netns.Link, work: Path, cache_dir: Path, turn_port: int = 3478, entry: str = "app.py"):
    """The app on the server side, with that TURN server and relay-only ICE on both ends."""
    ice_servers = [{"urls": f"turn:{link.server_ip}:{turn_port}?transport=udp", "username": TURN_USER,
                    "credential": TURN_PASSWORD}]
    env = {"PERSONAPLEX_ICE_SERVERS": json.dumps(ice_servers), "PERSONAPLEX_ICE_RELAY_ONLY": "1"}
    return launched_app(work, cache_dir, args=["--slots", "1"], env=env, host=link.server_ip,
                        prefix=link.exec_prefix(link.server_ns), call=link.in_server_ns, loopback=False,
                        entry=entry)


def caller_browser(link: netns.Link, app, mic: Path, user_dir: Path):
    """Chromium on the caller side. The page is plain http on a private address, which Chromium
    treats as insecure (no microphone) unless told that this origin is trusted."""
    wrapper = user_dir.parent / f"{user_dir.name}-chromium.sh"
    wrapper.write_text(f'#!/bin/sh\nexec {" ".join(link.exec_prefix(link.caller_ns))} {CHROMIUM} "$@"\n')
    wrapper.chmod(0o755)
    return chromium(user_dir, mic, executable=str(wrapper),
                    extra_args=(f"--unsafely-treat-insecure-origin-as-secure={app.base_url}",))


def test_a_call_through_the_turn_relay_only(turn_side, tiny_cache_dir, tmp_path):
    link, turn, mic, _ = turn_side
    allocations_before = turn.allocations()
    with hosted_app(link, tmp_path / "app", tiny_cache_dir) as app, \
            caller_browser(link, app, mic, tmp_path / "udd") as ctx:
        page = ctx.new_page()
        page.add_init_script(RECORD_PCS)
        page.goto(app.base_url + "/", wait_until="networkidle")
        start_call(page, timeout_ms=30_000)
        route = page.evaluate(SELECTED_ROUTE)
        assert route["policy"] == "relay", route  # the page was told to use the relay only
        assert route["local"] == "relay" and route["remote"] == "relay", route  # both ends relayed
        assert route["remoteAddress"] == link.server_ip, route  # ...by coturn
        # A relayed allocation for the browser and one for the server.
        assert turn.allocations() - allocations_before >= 2, turn.text()[-2000:]

        transcript = page.locator("#transcript-box textarea")
        first, texts = page.evaluate(INBOUND_BYTES), [""]

        def relayed_enough() -> bool:
            # Comfortably more than coturn must report below, so that the call's length does not
            # decide whether it does: the microphone's packets are small.
            route = page.evaluate(SELECTED_ROUTE)
            return route["bytesSent"] > 12_000 and route["bytesReceived"] > 24_000

        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and not (len(set(texts)) >= 3 and page.evaluate(INBOUND_BYTES) > first + 5000
                                                   and relayed_enough()):
            page.wait_for_timeout(300)
            texts.append(transcript.input_value())
        assert len(set(texts)) >= 3, f"the transcript did not keep changing: {texts[-3:]}"
        assert page.evaluate(INBOUND_BYTES) > first + 5000
        assert relayed_enough(), page.evaluate(SELECTED_ROUTE)
        assert app.status()["slots_live"] == 1
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "browser-turn-relay.png"), full_page=True)
        stop_call(page)
        wait_for(lambda: app.status()["slots_free"] == 1, 5, "the slot was not freed after hang-up")
    # Hanging up releases the allocations; coturn then logs what each one relayed. The browser's
    # (from the caller side) carried the agent's audio to it and its microphone to the server.
    def browser_relayed() -> list[tuple[int, int]]:
        return [s["peer_bytes"] for s in turn.sessions().values()
                if s.get("remote") == link.caller_ip and "peer_bytes" in s]

    wait_for(lambda: any(to > 20_000 and back > 10_000 for to, back in browser_relayed()), 10,
             f"coturn did not report the call's audio through the browser's relay: {browser_relayed()}")


def test_a_call_over_a_lossy_jittery_link(turn_side, tiny_cache_dir, tmp_path):
    link, turn, mic, work = turn_side
    kernel_netem = link.netem(NETEM)
    forwarder = LossyUdpForwarder((link.server_ip, FORWARDER_PORT), (link.server_ip, 3478), loss=0.05, delay=0.04,
                                  jitter=0.02, impair=lambda client: not kernel_netem and client[0] == link.caller_ip,
                                  enter=lambda: netns.enter_namespace(link.server_ns))
    forwarder.start()
    try:
        # The loopback engine (each caller hears their own microphone one step later) and a
        # microphone of clicks, so that the round trip can be followed through the losses.
        with hosted_app(link, tmp_path / "app", tiny_cache_dir, FORWARDER_PORT, entry="bench/loopback_app.py") as app, \
                caller_browser(link, app, mic, tmp_path / "udd") as ctx:
            page = ctx.new_page()
            for script in (RECORD_PCS, CALL_TIMING, CLICK_ROUND_TRIP):
                page.add_init_script(script)
            page.goto(app.base_url + "/", wait_until="networkidle")
            start_call(page, timeout_ms=30_000)
            page.wait_for_function("document.querySelector('#status-line').innerText.startsWith('Live')",
                                   timeout=15_000)
            page.evaluate(SAMPLE_AUDIO)
            began = time.monotonic()
            live, scraped = [], ""
            while time.monotonic() - began < CALL_SECONDS:
                page.wait_for_timeout(1000)
                live.append(app.status()["slots_live"])
                if not scraped and time.monotonic() - began > CALL_SECONDS / 2:
                    scraped = app.metrics()  # scraped during the call
            samples = page.evaluate("clearInterval(window.__sampler), window.__audio")
            trips = click_trips(page.evaluate("window.__clickSent()"), page.evaluate("window.__clickBack"))
            assert page.evaluate("window.__pcs.at(-1).connectionState") == "connected"
            status = app.status()
            stop_call(page)
            # On a lossy link the hang-up itself may be lost; then the idle release frees the slot.
            wait_for(lambda: app.status()["slots_free"] == 1, 5, "the slot was not freed after hang-up")
    finally:
        shaping = link.qdisc_stats() if kernel_netem else f"forwarder: {forwarder.counters}"
        link.clear_netem()
        forwarder.stop()
    assert all(n == 1 for n in live), live  # live for the whole call
    # An input stall as long as the idle release (2 s) would have ended the call as "idle".
    assert status["calls_ended"].get("idle", 0) == 0, status["calls_ended"]

    coverage, lost, concealed = audio_coverage(samples)
    windows = trip_windows(trips)
    report = (f"{NETEM} ({'tc netem' if kernel_netem else 'UDP forwarder'}): agent audio in {coverage:.1%} of "
              f"200 ms windows, {lost:.1%} packets lost, {concealed:.1%} of playout concealed; pool underruns "
              f"{status['underruns']}, input drops {status['input_drops']}; tick mean "
              f"{status['realtime_factor']:.2f} of the budget, resyncs {status['resyncs']}; round trip p50 by "
              f"5 s of the call (ms): {', '.join(f'{w:.0f}' for w in windows)} ({len(trips)} clicks back)")
    (work / "netem-report.txt").write_text(report + "\n" + shaping)
    (work / "netem-samples.json").write_text(json.dumps(samples))
    print(report)
    if kernel_netem:  # the link really was lossy
        assert "loss 5%" in shaping and re.search(r"dropped [1-9]", shaping), shaping
    else:
        assert forwarder.counters.dropped > 0 and forwarder.counters.forwarded > 1000, shaping
    assert lost > 0.01, report  # and the browser saw it
    if status["realtime_factor"] < 0.9 and status["resyncs"] == 0:
        # The host ticks this call in real time: what the browser misses is the link's doing.
        assert coverage >= 0.95, report
        assert concealed < 0.15, report
    else:
        # A host that cannot tick even one call in real time (several times slower than these
        # machines, or busy): the call still holds and the agent's audio keeps coming.
        assert coverage >= 0.5, report
    # The round trip through the losses: it does not settle further behind as losses add up (a
    # receiver stuck behind a lost packet added 560 ms). The browser's own jitter buffer moves it
    # by a hundred milliseconds or so on such a link, both ways.
    assert len(trips) >= CALL_SECONDS // 2 and len(windows) >= 4, report
    half = len(windows) // 2
    assert sorted(windows[half:])[len(windows[half:]) // 2] <= max(windows[:half]) + 100, report
    assert re.search(r"^personaplex_slots_live 1\.0$", scraped, re.M), scraped[:2000]
    assert re.search(r"^personaplex_frame_latency_seconds_count [1-9]", scraped, re.M)


def trip_windows(trips: list[tuple[float, float]], seconds: float = 5.0) -> list[float]:
    """The median round trip (ms) of the clicks in each `seconds` of the call, in order."""
    if not trips:
        return []
    start = trips[0][0]
    windows: dict[int, list[float]] = {}
    for sent, trip in trips:
        windows.setdefault(int((sent - start) / 1000 / seconds), []).append(trip)
    return [sorted(w)[len(w) // 2] for _, w in sorted(windows.items())]


def audio_coverage(samples: list) -> tuple[float, float, float]:
    """(share of 200 ms windows in which agent audio packets arrived, share of packets lost, share of
    played samples that the browser had to conceal) over the sampled span."""
    assert len(samples) > 100, f"only {len(samples)} stats samples"
    t0, t1 = samples[0][0], samples[-1][0]
    windows = max(1, int((t1 - t0) // 200))
    arrived = set()
    for (_, before, *_), (t, after, *_) in zip(samples, samples[1:]):
        if after > before:
            arrived.add(min(windows - 1, int((t - t0) // 200)))
    received = samples[-1][1] - samples[0][1]
    lost = samples[-1][2] - samples[0][2]
    played = samples[-1][3] - samples[0][3]
    concealed = samples[-1][4] - samples[0][4]
    return len(arrived) / windows, lost / max(1, received + lost), concealed / max(1, played)
