"""Deep links: what a link may set, what it may not, and the page's load event that applies it."""

from __future__ import annotations

import asyncio
from urllib.parse import quote, urlencode

import gradio as gr
import pytest
from starlette.requests import Request as StarletteRequest

from personaplex_demo.errors import CallerError
from personaplex_demo.web.deeplink import MAX_LINK_CHARS, SEED_RANGE, LinkRules, NumberRule, copy_link_js, read_link

PRESETS = {"Teacher": "You are a wise and friendly teacher.", "Chef": "You are a chef."}


def check_persona(text: str) -> None:
    # The real rule (engine.persona_tokens) is used in test_the_load_event_applies_a_link.
    if len(text) > 4000:
        raise CallerError(f"the persona is {len(text)} characters long; the limit is 4000 characters")


RULES = LinkRules(voices=("NATF2", "NATM1"), presets=PRESETS, check_persona=check_persona, numbers={
    "text_temperature": NumberRule(0, 2, False), "text_top_k": NumberRule(1, 500, True),
    "audio_temperature": NumberRule(0, 2, False), "audio_top_k": NumberRule(1, 2048, True),
    "seed": NumberRule(*SEED_RANGE, integer=True)})


def test_a_full_link_sets_every_control():
    setup = read_link([("voice", "NATM1"), ("persona", "Be brief."), ("text_temperature", "0.9"),
                       ("text_top_k", "40"), ("audio_temperature", "0"), ("audio_top_k", "2048"), ("seed", "-1")],
                      RULES)
    assert setup.values == {"voice": "NATM1", "persona": "Be brief.", "text_temperature": 0.9, "text_top_k": 40,
                            "audio_temperature": 0.0, "audio_top_k": 2048, "seed": -1}
    assert setup.ignored == [] and setup.notice() == ""


def test_presets_travel_by_name_and_never_overwrite_a_linked_persona():
    assert read_link([("preset", "Chef")], RULES).values == {"preset": "Chef", "persona": "You are a chef."}
    same = read_link([("preset", "Chef"), ("persona", "You are a chef.")], RULES)
    assert same.values == {"preset": "Chef", "persona": "You are a chef."}
    # Setting the preset would make the page replace the persona with the preset's text.
    own = read_link([("preset", "Chef"), ("persona", "You are a pirate.")], RULES)
    assert own.values == {"persona": "You are a pirate."}


@pytest.mark.parametrize("name, value, reason", [
    ("voice", "NATM9", "not one of the listed voices"),
    ("voice", "../../voices/NATF2.pt", "not one of the listed voices"),
    ("voice", "natm1", "not one of the listed voices"),
    ("preset", "<b>Chef</b>", "not one of the listed presets"),
    ("persona", "x" * 100_000, "the limit is 4000 characters"),
    ("text_temperature", "NaN", "a number from 0 to 2"),
    ("text_temperature", "inf", "a number from 0 to 2"),
    ("text_temperature", "2.5", "a number from 0 to 2"),
    ("text_temperature", "", "a number from 0 to 2"),
    ("text_top_k", "40.5", "a whole number from 1 to 500"),
    ("text_top_k", "0", "a whole number from 1 to 500"),
    ("audio_top_k", "1e9", "a whole number from 1 to 2048"),
    ("seed", "4294967296", "a whole number from -1 to 4294967295"),
    ("seed", "<img src=x onerror=alert(1)>", "a whole number from -1"),
])
def test_a_bad_parameter_is_ignored_with_its_reason_and_never_echoed(name, value, reason):
    setup = read_link([(name, value), ("voice", "NATM1")] if name != "voice" else [(name, value)], RULES)
    assert name not in setup.values
    notice = setup.notice()
    assert f"{name} (" in notice and reason in notice, notice
    if len(value) > 3:
        assert value not in notice


def test_markup_in_a_persona_is_kept_as_text():
    text = "<script>alert(1)</script> You are **bold**."
    assert read_link([("persona", text)], RULES).values == {"persona": text}  # a textbox shows it verbatim


def test_unknown_and_repeated_parameters():
    setup = read_link([("voice", "NATM1"), ("voice", "NATF2"), ("__proto__", "x"), ("callback", "javascript:1"),
                       ("seed", "7")], RULES)
    assert setup.values == {"seed": 7}
    notice = setup.notice()
    assert "voice (given 2 times)" in notice and "2 unknown parameters" in notice
    assert "__proto__" not in notice and "javascript" not in notice


def test_copy_link_script_carries_the_presets_and_the_limit():
    js = copy_link_js({"It's <b>": "a \"quoted\" </script> text"})
    assert js.lstrip().startswith("(voice, preset, persona, text_temperature")
    assert f"limit = {MAX_LINK_CHARS}" in js
    assert '{"It\'s <b>": "a \\"quoted\\" </script> text"}' in js  # JSON: strings stay strings


def test_the_load_event_applies_a_link(tiny_cache_dir, recordings):
    from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
    from personaplex_demo.serving.config import PoolConfig
    from personaplex_demo.serving.pool import SlotPool
    from personaplex_demo.web.page import build_ui

    runtime = build_runtime(RuntimeOptions(model="tiny", slots=1, cache_dir=tiny_cache_dir))
    demo = build_ui(runtime, SlotPool(runtime.engine, PoolConfig()), recordings=recordings)
    # A plain link raises no server event: the page's script presses a hidden button only for a
    # link with a query, and that button's event applies it.
    load = next(fn for fn in demo.fns.values() if any(event == "load" for _, event in fn.targets))
    assert load.fn is None and "window.location.search.length < 2" in load.js
    button = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "apply-link")
    click = next(fn for fn in demo.fns.values() if (button._id, "click") in fn.targets)

    def apply(query: dict) -> tuple:
        scope = {"type": "http", "method": "GET", "path": "/", "headers": [],
                 "query_string": urlencode(query, quote_via=quote).encode()}
        return asyncio.run(click.fn(gr.Request(request=StarletteRequest(scope))))

    voice, preset, persona, tt, tk, at, ak, seed, notice = apply(
        {"voice": "VARM1", "preset": "Astronaut", "text_top_k": "7"})
    assert voice["value"] == "VARM1" and preset["value"] == "Astronaut"
    assert "Mars" in persona["value"] and tk["value"] == 7
    assert "value" not in tt and "value" not in seed and notice["visible"] is False
    # The engine's own persona rule: a persona over the token limit is refused.
    limit = runtime.engine.max_persona_tokens
    *_, notice = apply({"persona": "word " * (limit + 50)})
    assert notice["visible"] and f"the limit is {limit} tokens" in notice["value"]


async def test_an_overlong_query_is_refused_before_the_app():
    from personaplex_demo.web.deeplink import MAX_QUERY_BYTES, RefuseLongQueries

    seen, sent = [], []

    async def page(scope, receive, send):
        seen.append(len(scope["query_string"]))

    async def send(message):
        sent.append(message)

    guard = RefuseLongQueries(page)
    for size in (MAX_QUERY_BYTES, 100_000):  # at the limit; a 100 KB persona
        await guard({"type": "http", "path": "/", "query_string": b"persona=" + b"x" * (size - 8)}, None, send)
    assert seen == [MAX_QUERY_BYTES]
    assert sent[0]["status"] == 414 and sent[1]["body"].startswith(b"This address is too long")
