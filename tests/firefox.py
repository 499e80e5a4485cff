"""Debian's firefox-esr, driven through its own remote agent over WebDriver BiDi.

Firefox speaks the W3C WebDriver BiDi protocol itself (`--remote-debugging-port`), so no driver
binary and no download is needed: this small client sends the protocol's JSON commands over one
WebSocket (`websockets`, already a dependency). What the tests use:

- `session.new`, `browsingContext.getTree`, `browsingContext.navigate`, `browser.close`;
- `script.addPreloadScript` (the page's peer connections and timings, as Playwright's
  `add_init_script` gives the Chromium tests) and `script.evaluate`, whose results come back as
  JSON text so that any value the page computes reads as Python.

The microphone is Firefox's fake device (a tone), without a permission prompt, set by preferences
in a fresh profile, as are autoplay (the agent's audio plays at once) and ICE candidates on
loopback (the app's, with PERSONAPLEX_LOOPBACK_ICE=1).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

FIREFOX = "/usr/bin/firefox-esr"
PREFS: dict[str, Any] = {
    "media.navigator.streams.fake": True,  # a fake microphone...
    "media.navigator.permission.disabled": True,  # ...granted without a prompt
    "media.autoplay.default": 0,  # the agent's audio plays without a click on it
    "media.autoplay.blocking_policy": 0,
    "media.autoplay.block-webaudio": False,  # the page's timing script listens through Web Audio...
    "media.cubeb.force_null_context": True,  # ...which needs an audio output, and a test machine has none
    "media.peerconnection.ice.loopback": True,  # host candidates on 127.0.0.1, as the app's
    "media.peerconnection.ice.obfuscate_host_addresses": False,
    "browser.shell.checkDefaultBrowser": False,
    "browser.startup.homepage_override.mstone": "ignore",
    "datareporting.policy.dataSubmissionEnabled": False,
    "toolkit.telemetry.reportingpolicy.firstRun": False,
    "app.update.disabledForTesting": True,
    "network.captive-portal-service.enabled": False,
    "network.connectivity-service.enabled": False,
}
GRANT = "document.querySelector('[title=\"grant webcam access\"] button')"  # the page's microphone button
RECORD = "document.querySelector('button[aria-label=\"start stream\"]')"  # Record, then Stop
LISTENING = re.compile(r"WebDriver BiDi listening on (ws://\S+)")


class BidiError(RuntimeError):
    pass


class Firefox:
    """One headless firefox-esr and its BiDi session, on one browsing context (the first tab)."""

    def __init__(self, profile: Path, start_timeout: float = 60.0) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "user.js").write_text("".join(f"user_pref({json.dumps(k)}, {json.dumps(v)});\n"
                                                 for k, v in PREFS.items()))
        self.log = profile.parent / f"{profile.name}.log"
        with open(self.log, "w") as out:  # a session of its own: `_kill` ends its content processes too
            self.proc = subprocess.Popen([FIREFOX, "--headless", "--no-remote", "--profile", str(profile),
                                          "--remote-debugging-port", "0"], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self._ids = itertools.count(1)
        try:
            self.ws: ClientConnection = connect(f"{self._address(start_timeout)}/session", max_size=None,
                                                open_timeout=start_timeout)
            self.command("session.new", {"capabilities": {}})
            self.context = self.command("browsingContext.getTree", {})["contexts"][0]["context"]
        except BaseException:
            self._kill()
            raise

    def _address(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = LISTENING.search(self.log.read_text(errors="replace"))
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise BidiError(f"firefox-esr did not start its remote agent:\n{self.log.read_text(errors='replace')[-2000:]}")

    def command(self, method: str, params: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """Send one command and return its result (events that arrive meanwhile are skipped)."""
        rid = next(self._ids)
        self.ws.send(json.dumps({"id": rid, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") != rid:
                continue
            if message.get("type") == "error":
                raise BidiError(f"{method}: {message.get('error')}: {message.get('message')}")
            return message["result"]

    def preload(self, script: str) -> None:
        """Run `script` (a self-contained statement) before the page's own scripts, in every page."""
        self.command("script.addPreloadScript", {"functionDeclaration": f"() => {{ {script} }}"})

    def navigate(self, url: str) -> None:
        self.command("browsingContext.navigate", {"context": self.context, "url": url, "wait": "complete"})

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if it is a promise), via JSON."""
        result = self.command("script.evaluate", {
            "expression": f"(async () => JSON.stringify(await ({expression})))()",
            "target": {"context": self.context}, "awaitPromise": True})
        if result.get("type") == "exception":
            raise BidiError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        value = result["result"]
        return json.loads(value["value"]) if value.get("type") == "string" else None

    def call(self, function: str) -> Any:
        """The value of calling a JavaScript function (its source, as Playwright's `evaluate` takes it)."""
        return self.evaluate(f"({function.strip()})()")

    def screenshot(self, path: Path) -> None:
        data = self.command("browsingContext.captureScreenshot", {"context": self.context})["data"]
        path.write_bytes(base64.b64decode(data))

    def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Until the expression is truthy in the page; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} within {timeout:g} s in Firefox")
            time.sleep(0.2)

    def start_call(self, timeout: float = 30.0) -> None:
        """The page's own buttons, as a person presses them: the microphone, then Record."""
        self.wait_for(f"{GRANT} !== null", timeout, "the microphone's button")
        self.evaluate(f"{GRANT}.click()")
        self.wait_for(f"{RECORD} !== null", timeout, "Record")
        self.evaluate(f"{RECORD}.click()")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.command("browser.close", {}, timeout=5.0)
        with contextlib.suppress(Exception):
            self.ws.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._kill()

    def _kill(self) -> None:
        """Whatever of the browser's processes is still there."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@contextlib.contextmanager
def firefox(profile: Path) -> Iterator[Firefox]:
    browser = Firefox(profile)
    try:
        yield browser
    finally:
        browser.close()
