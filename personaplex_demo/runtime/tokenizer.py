"""Text side of PersonaPlex: persona prompts in, transcript text out (docs/engine.md § Frame layout).
The real model ships Kyutai's 32000-piece SentencePiece tokenizer (byte fallback, 0 = EPAD/`<unk>`,
1 = BOS, 2 = EOS, 3 = PAD); the tiny model's has the same layout and size (runtime/tiny.py)."""

from __future__ import annotations

import codecs
import os
from pathlib import Path

import sentencepiece as spm

from ..engine.tokens import HIDDEN_TEXT_IDS
from ..frame import TEXT_CARD

SYSTEM_TAG = "<system>"


def wrap_with_system_tags(text: str) -> str:
    """The reference's rule: strip, keep as is only if it starts *and* ends with `<system>`."""
    cleaned = text.strip()
    if cleaned.startswith(SYSTEM_TAG) and cleaned.endswith(SYSTEM_TAG):
        return cleaned
    return f"{SYSTEM_TAG} {cleaned} {SYSTEM_TAG}"


class TextTokenizer:
    """A SentencePiece model plus the persona encoding rule of the reference server."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {self.path}")
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        # (kind, surface) per id, filled on first use: the transcript decoder looks pieces up
        # one id at a time on the engine thread, so this keeps that lookup O(1).
        self._surfaces: list[tuple[int, bytes] | None] = [None] * self.sp.get_piece_size()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Plain SentencePiece ids, no BOS or EOS."""
        return list(self.sp.encode(text, out_type=int))

    def encode_persona(self, persona: str) -> list[int]:
        """Persona ids as the model is prompted with them: `<system> ... <system>`, no BOS/EOS.
        An all-whitespace persona gives no tokens (the reference server crashes there; vLLM-Omni
        plays zero persona ticks, and so do we)."""
        if not persona.strip():
            return []
        return self.encode(wrap_with_system_tags(persona))

    def surface(self, token_id: int) -> tuple[int, bytes]:
        """(kind, bytes) of one id as SentencePiece's decoder renders it; see `_KIND_*`."""
        cached = self._surfaces[token_id]
        if cached is not None:
            return cached
        sp = self.sp
        if sp.is_byte(token_id):
            # Byte-fallback pieces are spelled "<0xAB>".
            entry = (_KIND_BYTE, bytes([int(sp.id_to_piece(token_id)[3:5], 16)]))
        elif sp.is_control(token_id) or sp.is_unused(token_id):
            entry = (_KIND_EMPTY, b"")
        elif sp.is_unknown(token_id):
            entry = (_KIND_TEXT, " \u2047 ".encode())
        else:
            entry = (_KIND_TEXT, sp.id_to_piece(token_id).replace("\u2581", " ").encode("utf-8"))
        self._surfaces[token_id] = entry
        return entry

    def transcript_decoder(self, text_card: int = TEXT_CARD) -> TranscriptDecoder:
        return TranscriptDecoder(self, text_card=text_card)


_KIND_TEXT = 0  # a normal piece: its text with "▁" as a space
_KIND_BYTE = 1  # a byte-fallback piece: one raw byte of UTF-8
_KIND_EMPTY = 2  # control or unused piece: renders as nothing


def _replace_one_byte(exc: UnicodeDecodeError) -> tuple[str, int]:
    # SentencePiece replaces every undecodable byte with its own U+FFFD, where Python's
    # "replace" handler would use one for a whole truncated sequence; resuming one byte after
    # the error start reproduces SentencePiece exactly.
    return "\ufffd", exc.start + 1


codecs.register_error("personaplex_sp_replace", _replace_one_byte)


class TranscriptDecoder:
    """Incremental transcript of one call: the pushes add up to `sp.decode` of all shown ids, each part
    once final (an incomplete UTF-8 sequence waits for its last byte, or `flush`); EPAD, PAD and ids
    past the text card or vocabulary are hidden. A push costs O(one piece), not O(history)."""

    def __init__(self, tokenizer: TextTokenizer, text_card: int = TEXT_CARD) -> None:
        self.tokenizer = tokenizer
        self.limit = min(int(text_card), tokenizer.vocab_size)
        self.reset()

    def reset(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="personaplex_sp_replace")
        # SentencePiece drops the leading "▁" of normal pieces until some text has appeared
        # (the dummy prefix); byte pieces end that phase even when they are spaces.
        self._at_start = True

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in HIDDEN_TEXT_IDS or not 0 <= token_id < self.limit:
            return ""
        kind, data = self.tokenizer.surface(token_id)
        if kind == _KIND_EMPTY:
            # SentencePiece decodes each run of byte pieces on its own, so a control piece
            # between two bytes keeps them apart: finish any pending sequence here.
            return self._utf8.decode(b"", final=True)
        if kind == _KIND_TEXT and self._at_start:
            data = data.lstrip(b" ")
            if not data:
                return ""
        self._at_start = False
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        """Finalise the call: any pending incomplete byte sequence becomes U+FFFD characters."""
        return self._utf8.decode(b"", final=True)
