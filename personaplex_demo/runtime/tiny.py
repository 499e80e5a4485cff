"""The tiny offline model: a hash-v1 checkpoint set in the official repository layout, with the golden
fixtures' tiny configurations and seeds. It babbles, but it runs every path of the app on a laptop CPU."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..frame import AUDIO_CARD, TEXT_CARD
from ..model.config import LMConfig, MimiConfig, ModelFiles
from .voice_names import VOICE_NAMES

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
    # Imported here: finding the tiny model's folder (start-up checks) must not wait for torch.
    from ..model.checkpoint import meta_lm, meta_mimi, write_hash_checkpoint
    from .tokenizer import build_tiny_tokenizer
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
