"""End to end in a real browser: Debian Chromium with a fake microphone against the launched app."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from urllib.parse import parse_qs, quote, urlencode, urlsplit

import pytest

from .browser_support import (
    ARTIFACTS,
    CALL_TIMING,
    INBOUND_BYTES,
    OUTBOUND_PACKETS,
    RECORD_PCS,
    chromium,
    launched_app,
    make_mic_wav,
    missing_tools,
    require,
    start_call,
    stop_call,
    wait_for,
)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def need_browser():
    require(missing_tools())


@pytest.fixture(scope="module")
def app(need_browser, tiny_cache_dir, tmp_path_factory):
    # The calls' media in the app's own process (the default is a media worker wherever there are
    # two cores): both shapes stay covered.
    with launched_app(tmp_path_factory.mktemp("app"), tiny_cache_dir,
                      args=["--slots", "2", "--media-workers", "0"]) as launched:
        yield launched


@pytest.fixture(scope="module")
def app_with_media_workers(need_browser, tiny_cache_dir, tmp_path_factory):
    with launched_app(tmp_path_factory.mktemp("app"), tiny_cache_dir,
                      args=["--slots", "2", "--media-workers", "2"]) as launched:
        yield launched


@pytest.fixture(scope="module")
def mic_wav(need_browser, tmp_path_factory):
    return make_mic_wav(tmp_path_factory.mktemp("mic"))


# The page is the same whether the calls' media runs in the app's process or in media workers.
@pytest.mark.parametrize("mode", ["embedded", "media-workers"])
def test_a_call_in_chromium(mode, request, mic_wav, tmp_path):
    app = request.getfixturevalue("app" if mode == "embedded" else "app_with_media_workers")
    shot = "" if mode == "embedded" else f"-{mode}"
    ARTIFACTS.mkdir(exist_ok=True)
    with chromium(tmp_path / "udd", mic_wav) as ctx:
        page = ctx.new_page()
        page.add_init_script(RECORD_PCS)
        page.add_init_script(CALL_TIMING)
        page.goto(app.base_url + "/", wait_until="networkidle")
        assert "tiny offline model" in page.locator("#banner").inner_text()
        assert page.locator("#voice input").input_value() == "NATF2"
        assert "appear once a call is live" in page.locator("#stats .room-figures").inner_text()
        start_call(page)
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
        assert len(set(texts)) >= 3, (f"the transcript did not keep changing: {texts[-3:]}; status line "
                                      f"{page.locator('#status-line').inner_text()!r}; the app's log:\n{app.log_tail()}")
        assert texts[-1].startswith(texts[1])  # it streams: each update extends the last one
        assert app.status()["slots_live"] == 1
        assert "Live" in page.locator("#status-line").inner_text()
        # Time to first audio, as the person meets it: from the click to the first agent sound the
        # page plays. A generous bound: the figure itself goes to BENCHMARKS.md (bench/browser_call.py).
        t = page.evaluate("window.__t")
        assert {"click", "offer_sent", "answer", "connected", "first_sound"} <= set(t), t
        assert t["click"] < t["offer_sent"] < t["answer"] <= t["connected"] < t["first_sound"], t
        assert t["first_sound"] - t["click"] < 15_000, t
        # The room's figures, kept fresh by the page's own script (no Gradio event): this call in
        # them, and the tick times once it is live.
        page.wait_for_function("/slots 1\\/2 in use.*latency p50 \\d+ ms/"
                               ".test(document.querySelector('#stats .room-figures').innerText)", timeout=12_000)
        # This call's own figures show beside the room's.
        page.wait_for_function("document.querySelector('#call-figures').innerText.includes('first sound after')",
                               timeout=5_000)
        figures = page.locator("#call-figures").inner_text()
        assert figures.startswith("This call first sound after"), figures
        page.wait_for_function("document.querySelector('#call-figures').innerText.includes('share')",
                               timeout=5_000)  # once the room has answered the caller's audio
        # The round trip as this caller lives it: the server's part plus this browser's own buffer.
        page.wait_for_function("/round trip \\d+ ms \\(browser buffer \\d+ ms\\)/"
                               ".test(document.querySelector('#call-figures').innerText)", timeout=20_000)
        page.screenshot(path=str(ARTIFACTS / f"browser-call{shot}.png"), full_page=True)
        stop_call(page)
        stopped = time.monotonic()
        while app.status()["slots_free"] < 2:
            assert time.monotonic() - stopped < 3.0, "Stop did not free the slot within 3 s"
            time.sleep(0.1)
        # The recording of the call is offered for download once it is written.
        page.locator("#download-wav a.download-link").first.wait_for(timeout=8_000)
        assert page.locator("#download-wav .filename").first.inner_text().strip().endswith(".wav")
        page.locator("#download-json a.download-link").first.wait_for(timeout=2_000)
        assert page.locator("#download-json .filename").first.inner_text().strip().endswith(".json")
        href = page.locator("#download-json a.download-link").first.get_attribute("href")
        meta = json.loads(urllib.request.urlopen(urllib.parse.urljoin(app.base_url, href), timeout=5).read())
        fig = meta["call_figures"]  # the same figures, in the transcript JSON
        assert 0 < fig["first_audio_seconds"] < (t["first_sound"] - t["click"]) / 1e3, (fig, t)
        assert fig["latency_ms"]["answers"] > 0 and fig["packets"]["received"] > 0, fig
        assert "Call ended" in page.locator("#status-line").inner_text()
        page.screenshot(path=str(ARTIFACTS / f"browser-after-call{shot}.png"), full_page=True)


@pytest.fixture(scope="module")
def one_slot_app(need_browser, tiny_cache_dir, tmp_path_factory):
    with launched_app(tmp_path_factory.mktemp("app"), tiny_cache_dir, args=["--slots", "1"]) as launched:
        yield launched


def test_a_waiting_page_sends_no_audio_until_its_slot_is_prepared(one_slot_app, mic_wav, tmp_path):
    """One call fills the room's one slot; a second page waits in the queue with its microphone
    held (no RTP leaves it), and sends again once the hang-up seats it (web/mic_hold.py)."""
    app = one_slot_app
    with chromium(tmp_path / "udd", mic_wav) as ctx:
        first, waiting = ctx.new_page(), ctx.new_page()
        for page in (first, waiting):
            page.add_init_script(RECORD_PCS)
            page.goto(app.base_url + "/", wait_until="networkidle")
        start_call(first)
        wait_for(lambda: app.status()["slots_live"] == 1, 20, "the first call live")
        start_call(waiting)
        waiting.wait_for_function("document.querySelector('#status-line').innerText.includes('in the queue')",
                                  timeout=10_000)
        waiting.wait_for_timeout(500)  # packets sent before the hold reached the page
        before = waiting.evaluate(OUTBOUND_PACKETS)
        waiting.wait_for_timeout(3_000)
        assert waiting.evaluate(OUTBOUND_PACKETS) - before <= 1, "the waiting page kept sending its microphone"
        stop_call(first)
        waiting.wait_for_function("document.querySelector('#status-line').innerText.includes('Live')",
                                  timeout=15_000)
        sent, since = waiting.evaluate(OUTBOUND_PACKETS), time.monotonic()
        waiting.wait_for_timeout(2_000)
        rate = (waiting.evaluate(OUTBOUND_PACKETS) - sent) / (time.monotonic() - since)
        assert 18 < rate < 32, f"{rate:.1f} microphone packets a second once seated"
        stop_call(waiting)
        wait_for(lambda: app.status()["slots_free"] == 1, 5, "the slot free")


def controls(page) -> dict[str, str]:
    """The page's voice, preset, persona and sampling controls, as the page shows them."""
    page.locator("#persona textarea").wait_for()
    values = {"voice": page.locator("#voice input").input_value(), "preset": page.locator("#preset input").input_value(),
              "persona": page.locator("#persona textarea").input_value()}
    labels = {"text_temperature": "Text temperature", "text_top_k": "Text top-k",
              "audio_temperature": "Audio temperature", "audio_top_k": "Audio top-k"}
    for name, label in labels.items():
        values[name] = page.locator(f'input[aria-label="number input for {label}"]').input_value()
    values["seed"] = page.locator('input[aria-label^="Seed"]').input_value()
    return values


PERSONA = "You are Ada, a patient chess coach. Explain one idea at a time & ask what the student thinks?"


def test_a_deep_link_sets_the_controls_and_the_copy_button_gives_it_back(app, mic_wav, tmp_path):
    query = {"voice": "NATM1", "persona": PERSONA, "text_temperature": "0.9", "text_top_k": "40",
             "audio_temperature": "0.65", "audio_top_k": "300", "seed": "1234"}
    long_persona = "Tell long stories about the sea, the wind and the ships that sail far away. " * 60
    # Over the persona's 4,000 characters (a 100 KB one does not even get a page: see test_deeplink.py).
    hostile = {"voice": "../../etc/passwd", "persona": "<script>window.__pwned = 1</script>" + "x" * 5000,
               "text_temperature": "NaN", "audio_top_k": "1e9", "seed": "<img src=x onerror=window.__pwned=1>",
               "callback": "javascript:alert(1)"}
    with chromium(tmp_path / "udd", mic_wav, permissions=("microphone", "clipboard-read", "clipboard-write")) as ctx:
        page = ctx.new_page()
        page.add_init_script(RECORD_PCS)
        page.goto(f"{app.base_url}/?{urlencode(query, quote_via=quote)}", wait_until="networkidle")
        page.wait_for_function("document.querySelector('#voice input').value === 'NATM1'", timeout=10_000)
        shown = controls(page)
        assert shown == {**query, "preset": "Assistant (teacher)", "text_temperature": "0.9", "seed": "1234"}, shown
        assert not page.locator("#link-notice").is_visible()  # nothing was refused
        # The call uses what the link set.
        start_call(page)
        page.wait_for_function("document.querySelector('#status-line').innerText.startsWith('Live')", timeout=15_000)
        stop_call(page)

        # The button gives the same setup back as a link (in the box and on the clipboard).
        page.locator("#copy-link").click()
        page.wait_for_function("document.querySelector('#setup-link textarea').value.startsWith('http')")
        link = page.locator("#setup-link textarea").input_value()
        assert link == page.evaluate("navigator.clipboard.readText()")
        assert parse_qs(urlsplit(link).query) == {k: [v] for k, v in query.items()}
        again = ctx.new_page()
        again.goto(link, wait_until="networkidle")
        again.wait_for_function("document.querySelector('#voice input').value === 'NATM1'", timeout=10_000)
        assert controls(again) == shown

        # A preset travels by name; a persona too long for a link is cut, with a notice.
        again.locator("#persona textarea").fill(long_persona)
        again.locator("#copy-link").click()
        again.wait_for_function("document.querySelector('#copy-notice').innerText.includes('cut')")
        cut = again.locator("#setup-link textarea").input_value()
        assert 1900 < len(cut) <= 2000, len(cut)
        assert long_persona.startswith(parse_qs(urlsplit(cut).query)["persona"][0])

        # A 100 KB link is refused with a one-line answer before any of it reaches the page.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{app.base_url}/?persona={'x' * 100_000}", timeout=10)
        assert refused.value.code == 414 and "too long" in refused.value.read().decode()
        assert app.status()["slots_total"] == 2

        # Hostile parameters: each falls back to its default, the notice says so, and nothing runs.
        bad = ctx.new_page()
        bad.goto(f"{app.base_url}/?{urlencode(hostile, quote_via=quote)}", wait_until="networkidle")
        bad.locator("#link-notice").wait_for(state="visible", timeout=10_000)
        notice = bad.locator("#link-notice").inner_text()
        for name in ("voice", "persona", "text_temperature", "audio_top_k", "seed", "1 unknown parameter"):
            assert name in notice, notice
        assert "script" not in notice and "passwd" not in notice
        fallback = controls(bad)
        assert fallback["voice"] == "NATF2" and fallback["persona"].startswith("You are a wise and friendly teacher")
        assert fallback["text_temperature"] == "0.7" and fallback["audio_top_k"] == "250" and fallback["seed"] == "-1"
        assert bad.evaluate("window.__pwned") is None
        bad.screenshot(path=str(ARTIFACTS / "browser-deep-link-refused.png"), full_page=True)


PHONE = {"width": 390, "height": 844}


def test_on_a_phones_screen_the_call_comes_first_and_on_a_wide_one_the_settings_stay_left(app, mic_wav, tmp_path):
    """Someone opens a shared link on a phone: the call's control and status line are on the first
    screen, without scrolling past the settings the link already set."""
    link = f"{app.base_url}/?{urlencode({'voice': 'NATM1', 'persona': PERSONA}, quote_via=quote)}"
    with chromium(tmp_path / "phone", mic_wav, viewport=PHONE, is_mobile=True, has_touch=True) as ctx:
        page = ctx.new_page()
        page.goto(link, wait_until="networkidle")
        page.wait_for_function("document.querySelector('#voice input').value === 'NATM1'", timeout=10_000)
        grant = page.locator('[title="grant webcam access"]')
        assert on_first_screen(page, grant), "the microphone's button"
        grant.click()
        record = page.locator('button[aria-label="start stream"]').first
        record.wait_for(timeout=10_000)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "browser-phone.png"))
        assert page.evaluate("window.scrollY") == 0
        assert on_first_screen(page, record), "Record"
        assert on_first_screen(page, page.locator("#status-line")), "the status line"
    with chromium(tmp_path / "wide", mic_wav, viewport={"width": 1280, "height": 800}) as ctx:
        page = ctx.new_page()
        page.goto(link, wait_until="networkidle")
        settings, call = (page.locator(f"#{name}-column").bounding_box() for name in ("settings", "call"))
        assert settings["x"] + settings["width"] <= call["x"] and abs(settings["y"] - call["y"]) < 2


def on_first_screen(page, locator) -> bool:
    """The element is wholly inside the viewport as the page first shows it (no scrolling)."""
    box, view = locator.bounding_box(), page.viewport_size
    return box is not None and box["y"] >= 0 and box["y"] + box["height"] <= view["height"] \
        and box["x"] >= 0 and box["x"] + box["width"] <= view["width"]
