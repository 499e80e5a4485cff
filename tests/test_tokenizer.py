"""Persona encoding, the tiny tokenizer, and incremental transcript decoding (docs/engine.md)."""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path

import pytest

from personaplex_demo.runtime.tiny import TINY_VOCAB_SIZE, build_tiny_tokenizer
from personaplex_demo.runtime.tokenizer import TextTokenizer, TranscriptDecoder, wrap_with_system_tags


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny.model")


@pytest.fixture(scope="module")
def tok(tiny_path: Path) -> TextTokenizer:
    return TextTokenizer(tiny_path)


def byte_id(tok: TextTokenizer, value: int) -> int:
    return tok.sp.piece_to_id(f"<0x{value:02X}>")


# -- persona wrapping -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "wrapped"),
    [
        ("You are a teacher.", "<system> You are a teacher. <system>"),
        ("  You are a teacher.\n", "<system> You are a teacher. <system>"),
        ("<system> Be kind. <system>", "<system> Be kind. <system>"),
        ("   <system> Be kind. <system>  ", "<system> Be kind. <system>"),
        ("<system>Be kind.<system>", "<system>Be kind.<system>"),
        # NVIDIA's rule needs both ends; vLLM-Omni's startswith-only rule would keep these.
        ("<system> Be kind.", "<system> <system> Be kind. <system>"),
        ("Be kind. <system>", "<system> Be kind. <system> <system>"),
    ],
)
def test_wrap_with_system_tags(text: str, wrapped: str) -> None:
    assert wrap_with_system_tags(text) == wrapped


@pytest.mark.parametrize("persona", ["", " ", "\n\t  "])
def test_empty_persona_has_no_tokens(tok: TextTokenizer, persona: str) -> None:
    assert tok.encode_persona(persona) == []


def test_persona_is_wrapped_without_bos_or_eos(tok: TextTokenizer) -> None:
    persona = "You are a wise and friendly teacher."
    ids = tok.encode_persona(persona)
    assert ids == list(tok.sp.encode("<system> You are a wise and friendly teacher. <system>"))
    assert ids[0] != 1 and ids[-1] != 2
    assert tok.sp.decode(ids) == "<system> You are a wise and friendly teacher. <system>"
    # English text gets word pieces, not one token per letter.
    assert len(ids) < 16


def test_already_tagged_persona_is_not_wrapped_twice(tok: TextTokenizer) -> None:
    tagged = "<system> You enjoy having a good conversation. <system>"
    assert tok.encode_persona(tagged) == tok.encode(tagged)
    assert tok.encode_persona("  " + tagged + " ") == tok.encode(tagged)


def test_non_english_persona_uses_byte_fallback(tok: TextTokenizer) -> None:
    persona = "Tu es un guide très aimable. 你好 😀"
    ids = tok.encode_persona(persona)
    assert 0 not in ids  # never <unk>: bytes cover everything
    assert tok.sp.decode(ids) == wrap_with_system_tags(persona)


# -- the tiny tokenizer -----------------------------------------------------------------------


def test_tiny_tokenizer_layout(tok: TextTokenizer) -> None:
    sp = tok.sp
    assert tok.vocab_size == sp.get_piece_size() == TINY_VOCAB_SIZE == 32000
    assert [sp.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert sp.unk_id() == 0 and sp.bos_id() == 1 and sp.eos_id() == 2 and sp.pad_id() == 3
    assert [sp.id_to_piece(i) for i in (4, 5, 259)] == ["<0x00>", "<0x01>", "<0xFF>"]
    assert all(sp.is_byte(i) for i in range(4, 260))


def test_tiny_tokenizer_is_deterministic_and_fast(tmp_path: Path, tiny_path: Path) -> None:
    start = time.monotonic()
    again = build_tiny_tokenizer(tmp_path / "again.model")
    assert time.monotonic() - start < 10.0
    assert hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(tiny_path.read_bytes()).digest()


def test_every_tiny_id_decodes_to_readable_text(tok: TextTokenizer) -> None:
    sp = tok.sp
    for i in range(tok.vocab_size):
        text = sp.decode([i])
        assert isinstance(text, str)
        if i >= 260:  # past the specials and the byte pieces: real, printable word pieces
            piece = sp.id_to_piece(i)
            assert piece.replace("\u2581", "").isprintable(), (i, piece)
            assert piece == "\u2581" or piece.strip("\u2581"), (i, piece)  # only "▁" itself is blank


# -- transcript decoding ----------------------------------------------------------------------


def test_hidden_ids_show_nothing(tok: TextTokenizer) -> None:
    dec = TranscriptDecoder(tok)
    for hidden in (0, 3, 32000, 32001, 40000, -1):
        assert dec.push(hidden) == ""
    hello = tok.encode("Hello")
    assert "".join(dec.push(i) for i in hello) == "Hello"  # the leading "▁" is not shown


def test_ids_beyond_a_smaller_text_card_are_hidden(tok: TextTokenizer) -> None:
    dec = TranscriptDecoder(tok, text_card=1000)
    word = next(i for i in range(1000, 32000) if tok.sp.id_to_piece(i).startswith("\u2581"))
    assert dec.push(word) == ""


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_multibyte_character_split_over_byte_pieces(tok: TextTokenizer, char: str) -> None:
    dec = TranscriptDecoder(tok)
    ids = [byte_id(tok, b) for b in char.encode("utf-8")]
    outs = [dec.push(i) for i in ids[:-1]]
    assert outs == [""] * (len(ids) - 1)  # held back until the sequence is complete
    assert dec.push(3) == ""  # a PAD in between is hidden and does not break the sequence
    assert dec.push(ids[-1]) == char


def test_incremental_output_concatenates_to_the_full_decode(tok: TextTokenizer) -> None:
    text = "Bonjour, ça va? I'm fine 😀, thanks — 你好."
    ids = tok.encode(text)
    stream = [i for t in ids for i in (t, 0, 3)] + [32000]
    dec = TranscriptDecoder(tok)
    outs = [dec.push(i) for i in stream]
    assert "".join(outs) == tok.sp.decode(ids) == text


def test_matches_sentencepiece_on_random_streams(tok: TextTokenizer) -> None:
    # Random ids, heavy on byte pieces (including invalid UTF-8) and specials.
    rng = random.Random(1234)
    word = tok.sp.piece_to_id("\u2581")
    for _ in range(400):
        stream = [
            rng.choice(
                [rng.randrange(0, 33000), rng.randrange(4, 260), rng.randrange(4, 260), 0, 1, 2, 3, word]
            )
            for _ in range(rng.randint(0, 24))
        ]
        dec = TranscriptDecoder(tok)
        out = "".join(dec.push(i) for i in stream) + dec.flush()
        shown = [i for i in stream if i not in (0, 3) and 0 <= i < 32000]
        assert out == tok.sp.decode(shown), stream


def test_reset_starts_a_new_transcript(tok: TextTokenizer) -> None:
    dec = tok.transcript_decoder()
    for i in tok.encode("Hello there"):
        dec.push(i)
    dec.push(byte_id(tok, 0xC3))  # a pending half character must not leak into the next call
    dec.reset()
    assert "".join(dec.push(i) for i in tok.encode("Bye")) == "Bye"


def test_push_cost_is_bounded(tok: TextTokenizer) -> None:
    rng = random.Random(7)
    dec = TranscriptDecoder(tok)
    ids = [rng.randrange(0, 32000) for _ in range(30000)]
    start = time.monotonic()
    for i in ids:
        dec.push(i)
    # About 10 µs a push here; the bound only catches an O(history) decoder.
    assert time.monotonic() - start < 5.0
