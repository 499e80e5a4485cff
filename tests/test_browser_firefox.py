"""End to end in Firefox: Debian's firefox-esr, its fake microphone and the page's own buttons,
driven over WebDriver BiDi (tests/firefox.py), against the launched app."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from .browser_support import (
    ARTIFACTS,
    CALL_TIMING,
    FIRST_AUDIBLE,
    INBOUND_BYTES,
    RECORD_PCS,
    launched_app,
    require,
    wait_for,
)
from .firefox import FIREFOX, RECORD, firefox

pytestmark = pytest.mark.browser
log = logging.getLogger(__name__)

CONNECTED = "window.__pcs.length > 0 && window.__pcs.at(-1).connectionState === 'connected'"
STATUS = "document.querySelector('#status-line').innerText"
TRANSCRIPT = "document.querySelector('#transcript-box textarea').value"


def test_a_call_in_firefox(tiny_cache_dir, tmp_path):
    require([] if Path(FIREFOX).exists() else [FIREFOX], "apt-get install -y firefox-esr")
    with launched_app(tmp_path / "app", tiny_cache_dir, args=["--slots", "2"]) as app, \
            firefox(tmp_path / "profile") as ff:
        ff.preload(RECORD_PCS)
        ff.preload(CALL_TIMING)
        ff.preload(FIRST_AUDIBLE)
        ff.navigate(app.base_url + "/")
        ff.start_call()
        ff.wait_for(CONNECTED, 30, "a connected peer")
        ff.wait_for(f"{STATUS}.startsWith('Live')", 20, "the call live")
        first = ff.call(INBOUND_BYTES)
        texts = [ff.evaluate(TRANSCRIPT)]
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and not (len(set(texts)) >= 3 and ff.call(INBOUND_BYTES) > first + 5000):
            time.sleep(0.3)
            texts.append(ff.evaluate(TRANSCRIPT))
        assert ff.call(INBOUND_BYTES) > first + 5000  # the agent's audio keeps arriving
        assert len(set(texts)) >= 3 and texts[-1].startswith(texts[1]), texts[-3:]  # the transcript streams
        assert app.status()["slots_live"] == 1
        t = ff.evaluate("window.__t")
        assert {"click", "offer_sent", "answer", "connected", "first_audible"} <= set(t), t
        assert t["click"] < t["offer_sent"] < t["answer"] <= t["connected"] < t["first_audible"], t
        log.info("Firefox: first audible agent packet %.0f ms after Record", t["first_audible"] - t["click"])
        ARTIFACTS.mkdir(exist_ok=True)
        ff.screenshot(ARTIFACTS / "browser-firefox.png")
        ff.evaluate(f"{RECORD}.click()")  # the same button hangs up
        wait_for(lambda: app.status()["slots_free"] == 2, 10, "the slot freed after hang-up")
        ff.wait_for(f"{STATUS}.startsWith('Call ended')", 10, "the page saying the call ended")
