"""The page's static answers, kept in memory: a burst of visitors costs a dictionary lookup each instead of
Gradio's page rendering (docs/serving.md § Visitors and callers; why it is hand-written: docs/design-notes.md,
on visitors' work). The page names its own address from the Host and X-Forwarded-* headers, so they are part
of its key; text answers are kept brotli-compressed, which Gradio's own compression passes as they are.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import re
import time
from dataclasses import dataclass
from urllib.parse import parse_qsl

import brotli

CACHED_PATHS = re.compile(r"^/(config/?|assets/.+|static/.+|theme\.css|favicon\.ico|gradio_api/custom_component/.+)?$")
PAGE_PATHS = ("/", "/config", "/config/")
HASHED_NAME = re.compile(r"^/assets/.+-[A-Za-z0-9_-]{8}\.(js|css)$")  # Vite's content-hashed build files
KEY_HEADERS = (b"host", b"x-forwarded-host", b"x-forwarded-proto")
PAGE_QUERY = ("page", "deep_link")
IMMUTABLE = b"public, max-age=31536000, immutable"
MAX_BODY = 8 << 20  # larger answers pass through uncached
MAX_ENTRIES = 512  # hosts are the client's to write: the cache stays bounded whatever they send
PAGE_TTL_SECONDS = 300.0  # the page's own answer; the built files are kept as long as the app runs
TEXT_TYPES = (b"text/", b"application/javascript", b"application/json", b"image/svg+xml")
MIN_COMPRESSED = 400  # smaller answers go as they are (as Gradio's compression decides too)
BROTLI_QUALITY = 6  # once per answer: denser than Gradio's per-request 4, still milliseconds


@dataclass(frozen=True)
class Answer:
    headers: tuple[tuple[bytes, bytes], ...]  # without content-length and content-encoding
    body: bytes
    compressed: bytes | None  # brotli, for text answers
    etag: bytes
    stored: float


class PageCache:
    """ASGI middleware: GET of the page, its configuration and its built files, from memory."""

    def __init__(self, app) -> None:
        self.app = app
        self._answers: collections.OrderedDict[tuple, Answer] = collections.OrderedDict()
        self._pending: dict[tuple, asyncio.Future] = {}

    async def __call__(self, scope, receive, send) -> None:
        key = self.key(scope)
        if key is None:
            await self.app(scope, receive, send)
            return
        answer = self.fresh(key)
        if answer is None and key in self._pending:
            await asyncio.shield(self._pending[key])  # the first request's answer, rendered once
            answer = self.fresh(key)
        if answer is not None:
            await self.reply(answer, scope, send)
            return
        waiting = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, waiting)
        try:
            await self.app(scope, receive, self.keeper(key, send))
        finally:
            if self._pending.get(key) is waiting:
                del self._pending[key]
            waiting.set_result(None)

    def key(self, scope) -> tuple | None:
        if scope["type"] != "http" or scope["method"] != "GET" or not CACHED_PATHS.match(scope["path"]):
            return None
        if scope["path"] not in PAGE_PATHS:
            # A file's answer is the file's, whatever the query or the host: one entry per real
            # file, however many names a client makes up (a missing file is never kept).
            return (scope["path"],)
        headers = dict(scope["headers"])
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"))
        return (scope["path"], tuple(sorted((k, v) for k, v in query if k in PAGE_QUERY)), scope.get("scheme"),
                scope.get("root_path", ""), tuple(headers.get(h, b"") for h in KEY_HEADERS))

    def fresh(self, key: tuple) -> Answer | None:
        answer = self._answers.get(key)
        if answer is None:
            return None
        if key[0] in PAGE_PATHS and time.monotonic() - answer.stored > PAGE_TTL_SECONDS:
            del self._answers[key]
            return None
        self._answers.move_to_end(key)
        return answer

    def keeper(self, key: tuple, send):
        """`send`, passing the answer on as it comes and keeping it if it may be shared."""
        start: dict | None = None
        chunks: list[bytes] = []
        size = 0

        async def keep(message) -> None:
            nonlocal start, size
            if message["type"] == "http.response.start":
                # A copy: the compression outside changes the message's headers in place.
                start = {"status": message["status"], "headers": list(message.get("headers", ()))}
            elif message["type"] == "http.response.body" and start is not None:
                body = message.get("body", b"")
                size += len(body)
                if size <= MAX_BODY:
                    chunks.append(body)
                if not message.get("more_body", False):
                    self.store(key, start, b"".join(chunks), size)
            await send(message)

        return keep

    def store(self, key: tuple, start: dict, body: bytes, size: int) -> None:
        headers = tuple((k.lower(), v) for k, v in start["headers"])
        named = dict(headers)
        if (start["status"] != 200 or size != len(body) or b"set-cookie" in named
                or b"content-encoding" in named):
            return
        etag = named.get(b"etag") or b'"' + hashlib.sha1(body).hexdigest().encode() + b'"'
        kept = tuple((k, v) for k, v in headers
                     if k not in (b"etag", b"cache-control", b"content-length", b"vary"))
        cache = IMMUTABLE if HASHED_NAME.match(key[0]) else named.get(b"cache-control", b"no-cache")
        kept += ((b"etag", etag), (b"cache-control", cache), (b"vary", b"Accept-Encoding"))
        text = named.get(b"content-type", b"").startswith(TEXT_TYPES) and len(body) >= MIN_COMPRESSED
        compressed = brotli.compress(body, quality=BROTLI_QUALITY) if text else None
        self._answers[key] = Answer(kept, body, compressed, etag, time.monotonic())
        while len(self._answers) > MAX_ENTRIES:
            self._answers.popitem(last=False)

    @staticmethod
    async def reply(answer: Answer, scope, send) -> None:
        asked = dict(scope["headers"])
        if asked.get(b"if-none-match") == answer.etag:
            await send({"type": "http.response.start", "status": 304,
                        "headers": [(k, v) for k, v in answer.headers if k in (b"etag", b"cache-control", b"vary")]})
            await send({"type": "http.response.body", "body": b""})
            return
        headers, body = list(answer.headers), answer.body
        if answer.compressed is not None and b"br" in asked.get(b"accept-encoding", b""):
            headers.append((b"content-encoding", b"br"))
            body = answer.compressed
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
