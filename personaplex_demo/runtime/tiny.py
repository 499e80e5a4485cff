"""The tiny offline model: a hash-v1 checkpoint set in the official repository layout, with the golden
fixtures' tiny configurations and seeds, and a tokenizer of the real one's layout and size (its text head
emits any id below 32000). It babbles, but it runs every path of the app on a laptop CPU. Torch and
SentencePiece are imported only to build it: the start-up checks look for its folder first."""

from __future__ import annotations

import io
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..call_settings import VOICE_NAMES
from ..frame import AUDIO_CARD, TEXT_CARD
from ..model.config import LMConfig, MimiConfig, ModelFiles
from ..model.files import atomic_file

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

RECIPE = "hash-v1"
LM_SEED = 1242
MIMI_SEED = 4347
VOICE_SEED = 20251202  # the golden fixtures' data seed
_MARKER = "tiny-model.txt"


def default_cache_dir() -> Path:
    base = os.environ.get("PERSONAPLEX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "personaplex-live")
    return Path(base)


def build_tiny_repo(directory: Path) -> Path:
    """Write the four model files into `directory`."""
    from ..model.checkpoint import meta_lm, meta_mimi, write_hash_checkpoint
    from .voices import write_voices_archive

    files = ModelFiles()
    directory.mkdir(parents=True, exist_ok=True)
    lm_cfg = LMConfig.tiny()
    write_hash_checkpoint(meta_lm(lm_cfg), directory / files.lm, "lm", LM_SEED)
    write_hash_checkpoint(meta_mimi(MimiConfig.tiny()), directory / files.mimi, "mimi", MIMI_SEED)
    build_tiny_tokenizer(directory / files.tokenizer)
    write_voices_archive(directory / files.voices, tiny_voice_prompts(lm_cfg.dim))
    (directory / _MARKER).write_text(f"{RECIPE} lm_seed={LM_SEED} mimi_seed={MIMI_SEED}\n")
    return directory


def tiny_repo_path(cache_dir: Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"tiny-{RECIPE}"


def tiny_repo_ready(cache_dir: Path | None = None) -> bool:
    return (tiny_repo_path(cache_dir) / _MARKER).is_file()


def ensure_tiny_repo(cache_dir: Path | None = None) -> Path:
    """The tiny model's directory, built once (atomically) under the cache directory."""
    target = tiny_repo_path(cache_dir)
    if tiny_repo_ready(cache_dir):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the tiny offline model in %s", target)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        build_tiny_repo(tmp)
        try:
            tmp.rename(target)
        except OSError:  # built concurrently by another process: keep theirs
            if not (target / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_voice_prompts(dim: int, seed: int = VOICE_SEED) -> dict[str, dict[str, torch.Tensor]]:
    """hash-v1 voice prompts for the tiny model: the 18 official names, T = 4 + index % 5. Embeddings follow
    the golden fixtures' voice recipe; the ring's rows are taken modulo their card, so every value is a valid token."""
    import torch

    from ..model.hashinit import hash_ints, hash_tensor
    from .voices import CACHE_SHAPE

    prompts: dict[str, dict[str, torch.Tensor]] = {}
    for index, name in enumerate(VOICE_NAMES):
        length = 4 + index % 5
        emb = hash_tensor(f"{name}.embeddings", seed, [length, 1, 1, dim], 0.0, 2.0)
        cache = hash_ints(f"{name}.cache", seed, list(CACHE_SHAPE), AUDIO_CARD)
        cache[:, 0] = hash_ints(f"{name}.cache", seed, list(CACHE_SHAPE), TEXT_CARD)[:, 0]
        prompts[name] = {"embeddings": torch.from_numpy(emb), "cache": torch.from_numpy(cache)}
    return prompts


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
    log.debug("wrote the tiny tokenizer (%d pieces) to %s", TINY_VOCAB_SIZE, path)
    return path


def _train_tiny_bpe() -> bytes:
    import sentencepiece as spm

    from .tokenizer import wrap_with_system_tags

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
