"""Text side of PersonaPlex: persona prompts in, transcript text out (docs/engine.md § Frame layout).

The real model ships Kyutai's 32000-piece SentencePiece tokenizer (byte fallback, 0 = EPAD/`<unk>`,
1 = BOS, 2 = EOS, 3 = PAD). The tiny model's text head emits any id below 32000, so
`build_tiny_tokenizer` makes one with the same layout and size, deterministically and offline.
"""

from __future__ import annotations

import codecs
import io
import itertools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

from ..engine.tokens import HIDDEN_TEXT_IDS
from ..frame import TEXT_CARD
from ..model.files import atomic_file

logger = logging.getLogger(__name__)

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


# ---------------------------------------------------------------------------------------------
# The tiny offline tokenizer

TINY_VOCAB_SIZE = TEXT_CARD
# A small English corpus (persona-style prompts and everyday conversation) so that persona text
# gets real word pieces; the rest of the 32000 ids are filled with pronounceable synthetic words
# so that whatever the tiny LM babbles reads as words in the transcript.
_TINY_CORPUS = (
    "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way.",
    "You enjoy having a good conversation. Ask about the other person and share your own stories.",
    "You work at the front desk of a medical office. Help callers book, move or cancel appointments.",
    "You are a customer service agent at a bank. Help the caller check a balance or report a lost card.",
    "You are an astronaut on a long mission to Mars. Talk about life on the spaceship and the view.",
    "You are a patient tutor who explains science, history and mathematics with simple examples.",
    "You are a cheerful travel guide who recommends places to visit, food to try and things to do.",
    "You are a calm support assistant. Listen carefully, ask short questions and give clear steps.",
    "Hello, how are you today? I am fine, thank you very much. What would you like to talk about?",
    "Yes, of course. No, I do not think so. Maybe later. That sounds great! Tell me more about it.",
    "Good morning, good afternoon and good evening. Thanks for calling, have a wonderful day.",
    "Could you please repeat that? Sorry, I did not hear you. Let me check that for you right now.",
    "The weather is nice and sunny, but it might rain tomorrow, so take an umbrella with you.",
    "My name is Alex and I live in a small town near the sea with my family and two dogs.",
    "We can meet on Monday, Tuesday, Wednesday, Thursday, Friday, Saturday or Sunday at noon.",
    "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, hundred, thousand.",
    "Information: the office is open from nine to five. Your name is Sam and you speak kindly.",
    "I understand how you feel. It is important to take care of yourself and to rest well.",
    "What is your favourite book, movie, song or game? Why do you like it so much?",
    "People often ask me where I come from, what I do for work and what I enjoy doing for fun.",
)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _synthetic_words() -> Iterator[str]:
    """Pronounceable words of two, then three, consonant-vowel syllables, in a fixed order."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    return ("".join(p) for n in (2, 3) for p in itertools.product(syllables, repeat=n))


def build_tiny_tokenizer(path: Path) -> Path:
    """Write the tiny offline SentencePiece model (32000 pieces, Kyutai's id layout) to `path`.

    Ids 0..3 are `<unk>`, `<s>`, `</s>`, `<pad>`; 4..259 the byte-fallback pieces; then a small BPE
    vocabulary trained on a fixed corpus (one thread, fixed order: the same bytes every time); then
    synthetic "▁word" pieces scored below every trained piece, so they only win for a whole word.
    """
    with atomic_file(path) as f:
        f.write(_fill_with_synthetic_words(_train_tiny_bpe()))
    logger.debug("wrote the tiny tokenizer (%d pieces) to %s", TINY_VOCAB_SIZE, path)
    return path


def _train_tiny_bpe() -> bytes:
    words = list(itertools.islice(_synthetic_words(), 600))
    babble = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    tagged = [wrap_with_system_tags(s) for s in _TINY_CORPUS]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(_TINY_CORPUS) * 4 + tagged * 4 + babble),
        model_writer=buf,
        # BPE rather than unigram: on a corpus this small unigram keeps mostly single letters,
        # while BPE learns whole words, so personas stay short in ticks.
        model_type="bpe",
        vocab_size=3000,
        hard_vocab_limit=False,  # take what the corpus supports; the rest is synthetic
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        normalization_rule_name="identity",
        num_threads=1,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        minloglevel=2,
    )
    return buf.getvalue()


def _fill_with_synthetic_words(trained: bytes) -> bytes:
    """`trained` grown to TINY_VOCAB_SIZE pieces with synthetic whole words, scored below every trained piece."""
    # Imported here: it needs protobuf, which nothing else on the serving path does.
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    proto = model_pb2.ModelProto()
    proto.ParseFromString(trained)
    existing = {p.piece for p in proto.pieces}
    low = min(p.score for p in proto.pieces if p.type == model_pb2.ModelProto.SentencePiece.NORMAL)
    words = (w for w in _synthetic_words() if "\u2581" + w not in existing)
    for i, word in enumerate(itertools.islice(words, TINY_VOCAB_SIZE - len(proto.pieces))):
        piece = proto.pieces.add()
        piece.piece = "\u2581" + word
        piece.score = low - 10.0 - 1e-3 * i
        piece.type = model_pb2.ModelProto.SentencePiece.NORMAL
    if len(proto.pieces) != TINY_VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {len(proto.pieces)} pieces, expected {TINY_VOCAB_SIZE}")
    proto.trainer_spec.vocab_size = TINY_VOCAB_SIZE
    return proto.SerializeToString(deterministic=True)

