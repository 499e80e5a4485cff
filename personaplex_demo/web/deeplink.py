"""Deep links: `/?voice=NATM1&persona=...&text_temperature=0.9&seed=7` sets the page's controls
(docs/operations.md § Deep links). A parameter that fails a call's own rules leaves its control at the
default and is named in a notice, which never echoes a value from the link.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gradio as gr
from starlette.responses import PlainTextResponse

from ..errors import CallerError
from .assets import asset_text

MAX_LINK_CHARS = 2000
MAX_QUERY_BYTES = 8192  # longer query strings are refused before they reach Gradio (RefuseLongQueries)
PARAMS = ("voice", "preset", "persona", "text_temperature", "text_top_k", "audio_temperature", "audio_top_k", "seed")
SEED_RANGE = (-1, 2**32 - 1)  # -1: a new random seed per call, as in the page's seed box


@dataclass(frozen=True)
class NumberRule:
    minimum: float
    maximum: float
    integer: bool

    def parse(self, text: str) -> int | float | None:
        """The value, or None when it is not a finite number in range (or not whole when it must be)."""
        try:
            value = float(text.strip())
        except ValueError:
            return None
        if not math.isfinite(value) or not self.minimum <= value <= self.maximum:
            return None
        if self.integer:
            return int(value) if value == int(value) else None
        return value

    def describe(self) -> str:
        if self.integer:
            return f"a whole number from {int(self.minimum)} to {int(self.maximum)}"
        return f"a number from {self.minimum:g} to {self.maximum:g}"


@dataclass(frozen=True)
class LinkRules:
    voices: tuple[str, ...]
    presets: Mapping[str, str]  # label -> persona text
    numbers: Mapping[str, NumberRule]  # the sampling sliders and the seed
    check_persona: Callable[[str], object]  # raises CallerError for a persona a call would refuse


@dataclass
class LinkSetup:
    values: dict[str, Any] = field(default_factory=dict)  # control -> value, only what the link set
    ignored: list[str] = field(default_factory=list)  # one reason per ignored parameter

    def notice(self) -> str:
        if not self.ignored:
            return ""
        return "**Some settings in this link were not used** (the defaults stand instead): " + "; ".join(
            self.ignored) + "."


def read_link(items: Iterable[tuple[str, str]], rules: LinkRules) -> LinkSetup:
    """The controls a link sets, from its query parameters (name, value) in order."""
    setup = LinkSetup()
    seen: dict[str, list[str]] = {}
    for name, value in items:
        seen.setdefault(name, []).append(value)
    unknown = sum(len(values) for name, values in seen.items() if name not in PARAMS)
    for name in PARAMS:
        values = seen.get(name)
        if not values:
            continue
        if len(values) > 1:
            setup.ignored.append(f"{name} (given {len(values)} times)")
            continue
        value = values[0]
        if name == "voice":
            if value in rules.voices:
                setup.values["voice"] = value
            else:
                setup.ignored.append("voice (not one of the listed voices)")
        elif name == "preset":
            if value not in rules.presets:
                setup.ignored.append("preset (not one of the listed presets)")
            elif "persona" not in seen:
                setup.values["preset"] = value
                setup.values["persona"] = rules.presets[value]
            elif seen["persona"] == [rules.presets[value]]:
                setup.values["preset"] = value
            # else: the link's own persona text wins, and the preset would overwrite it.
        elif name == "persona":
            try:
                rules.check_persona(value)
            except CallerError as e:
                setup.ignored.append(f"persona ({_short(str(e))})")
            else:
                setup.values["persona"] = value
        else:
            rule = rules.numbers[name]
            number = rule.parse(value)
            if number is None:
                setup.ignored.append(f"{name} (must be {rule.describe()})")
            else:
                setup.values[name] = number
    if unknown:
        setup.ignored.append(f"{unknown} unknown parameter{'s' if unknown > 1 else ''}")
    return setup


class RefuseLongQueries:
    """ASGI middleware: a request whose query string is over `MAX_QUERY_BYTES` gets a one-line 414
    (Gradio's page handler fails on a very long URL with a 500 and a traceback in the log)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        app = self.app
        if scope["type"] == "http" and len(scope.get("query_string", b"")) > MAX_QUERY_BYTES:
            app = PlainTextResponse(f"This address is too long: its query part is limited to {MAX_QUERY_BYTES} bytes.\n",
                                    status_code=414)
        await app(scope, receive, send)


def _short(message: str, limit: int = 160) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "…"


def number_rule(component: gr.components.Component, integer: bool) -> NumberRule:
    """The rule of a slider, read from the slider itself so the two never disagree."""
    return NumberRule(float(component.minimum), float(component.maximum), integer)


# In the browser, as the page loads: press the hidden button once it is there, only for a link
# with a query.
APPLY_LINK_JS = asset_text("apply_link.js")


def copy_link_js(presets: Mapping[str, str]) -> str:
    """In the browser: the current controls -> [link, notice]. Gradio runs it as the click's `js`."""
    return asset_text("copy_link.js", PRESETS=dict(presets), LIMIT=MAX_LINK_CHARS)


def add_deep_links(demo: gr.Blocks, controls: Mapping[str, gr.components.Component], rules: LinkRules,
                   load_notice: gr.Markdown) -> None:
    """Inside `demo`'s context: the copy button, the link box and its notice, and the load event that
    applies a link (what it could not set goes to `load_notice`). `controls` maps each of PARAMS to
    its component."""
    with gr.Group():
        button = gr.Button("Copy link to this setup", size="sm", elem_id="copy-link")
        link = gr.Textbox(label="Link to this setup", interactive=False, max_lines=3,
                          placeholder="Press the button for a link that opens this page with these settings",
                          elem_id="setup-link")
        copy_notice = gr.Markdown(elem_id="copy-notice")
    targets = [controls[name] for name in PARAMS]
    # Only a link with a query raises a server event: the page's script presses this hidden button, whose
    # event reads the query Gradio's client sends with it (docs/serving.md § Visitors and callers).
    trigger = gr.Button("Apply the link", elem_id="apply-link")  # in the page, never shown (assets/page.css)

    async def apply(request: gr.Request):
        setup = read_link(request.query_params.multi_items() if request is not None else [], rules)
        notice = setup.notice()
        updates = [gr.update(value=setup.values[name]) if name in setup.values else gr.update() for name in PARAMS]
        return (*updates, gr.update(value=notice, visible=bool(notice)))

    demo.load(None, None, None, js=APPLY_LINK_JS)
    trigger.click(apply, None, [*targets, load_notice], show_progress="hidden", concurrency_limit=None)
    button.click(None, targets, [link, copy_notice], js=copy_link_js(rules.presets))
