"""Where the model files come from: the Hugging Face Hub, or the tiny offline model (docs/model.md § Files).
Tokens are read by huggingface_hub itself (`HF_TOKEN`, or a stored login) and never appear in a message.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import get_token, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import tqdm as hf_tqdm

from ..errors import CallerError, ModelDownloadError
from ..logs import redact_secrets
from ..model.config import ModelFiles

logger = logging.getLogger(__name__)

REAL_MODEL = "personaplex-7b-v1"
TINY_MODEL = "tiny"
MODEL_CHOICES = ("auto", REAL_MODEL, TINY_MODEL)
DEFAULT_HF_REPO = f"nvidia/{REAL_MODEL}"
# --cache-dir, in the app and the offline CLI alike.
CACHE_DIR_HELP = ("folder for the model files: the tiny model is built there, and the real one downloaded there "
                  "instead of the Hugging Face cache")
CACHE_DIR_DEFAULT = "~/.cache/personaplex-live (tiny model), HF_HOME (real model)"

ProgressFn = Callable[[str, float], None]
# Called with the model folder once the tokenizer and the voices are there, before the weights are
# fetched; a CallerError it raises stops everything (a typo in a voice name must not cost 17 GB).
SmallFilesCheck = Callable[[Path], None]
_CHECK_AFTER = "voices"  # the last of the small files in FILE_BYTES

# What the real model's files weigh (docs/model.md § Files), in download order: the small files first, so that
# a 401 fails in a second, not after 16 GB. The sizes weight the progress, and the preflight's disk check.
FILE_BYTES: dict[str, float] = {"tokenizer": 0.6e6, "voices": 8e6, "mimi": 385e6, "lm": 16.7e9}


@dataclass(frozen=True)
class ModelSource:
    name: str  # "personaplex-7b-v1" or "tiny"
    directory: Path  # holds the four files of ModelFiles
    is_tiny: bool
    fallback_reason: str | None = None  # why "auto" ended up on the tiny model

    lm_path = property(lambda self: self.directory / ModelFiles().lm)
    mimi_path = property(lambda self: self.directory / ModelFiles().mimi)
    tokenizer_path = property(lambda self: self.directory / ModelFiles().tokenizer)
    voices_path = property(lambda self: self.directory / ModelFiles().voices)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read at call time (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _token_state() -> str:
    """Whether a token is there (a stored login counts), in the words of our messages."""
    try:
        have = any(os.environ.get(v, "").strip() for v in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")) or bool(get_token())
    except Exception:  # a broken token file must not break start-up
        have = False
    return "HF_TOKEN is set" if have else "HF_TOKEN is not set"


def access_denied(exc: BaseException, repo: str) -> str | None:
    """For a gated, 401 or 403 answer: what to do about it (token-free); None for other failures."""
    status = None
    if isinstance(exc, HfHubHTTPError) and getattr(exc, "response", None) is not None:
        status = exc.response.status_code
    if not (isinstance(exc, (GatedRepoError, RepositoryNotFoundError)) or status in (401, 403)):
        return None
    kind = "the gated repository" if isinstance(exc, GatedRepoError) else "the repository"
    return (f"access denied to {kind} ({status or 'gated'}; {_token_state()}): accept the model licence at "
            f"https://huggingface.co/{repo} and set HF_TOKEN to a read token of that account")


def _describe_failure(exc: BaseException, repo: str) -> str:
    """A short, token-free reason for a failed download."""
    if hub_offline() and isinstance(exc, (LocalEntryNotFoundError, FileNotFoundError, ConnectionError)):
        return "HF_HUB_OFFLINE=1 is set and the files are not in the local cache"
    if denied := access_denied(exc, repo):
        return denied
    if isinstance(exc, LocalEntryNotFoundError):
        return f"no network connection to the Hub and no cached copy ({_token_state()})"
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return redact_secrets(f"{type(exc).__name__}: {detail[:200]}")


def _make_tqdm(on_bytes: Callable[[int, int | None], None]) -> type[hf_tqdm]:
    """A tqdm class for hf_hub_download that forwards byte counts to `on_bytes`."""

    class _ReportingTqdm(hf_tqdm):
        _done = 0  # counted here: a disabled bar (HF_HUB_DISABLE_PROGRESS_BARS) does not track n

        def update(self, n: float | None = 1) -> bool | None:
            result = super().update(n)
            self._done += int(n or 0)
            on_bytes(self._done, int(self.total) if self.total else None)
            return result

    return _ReportingTqdm


def _download_real(repo: str, cache_dir: Path | None, progress: ProgressFn | None,
                   check: SmallFilesCheck | None = None) -> Path:
    files = ModelFiles()
    offline = hub_offline()
    total_weight = sum(FILE_BYTES.values())
    done_weight = 0.0
    revision: str | None = None
    directory: Path | None = None
    last_report = [0.0, -1.0]  # time, fraction: throttle to ~1 % steps or 1 s

    def report(message: str, fraction: float, force: bool = False) -> None:
        if progress is None:
            return
        now = time.monotonic()
        if force or fraction - last_report[1] >= 0.01 or now - last_report[0] >= 1.0:
            last_report[:] = [now, fraction]
            progress(message, min(max(fraction, 0.0), 1.0))

    for kind, weight in FILE_BYTES.items():
        filename = getattr(files, kind)
        report(f"fetching {filename} from {repo}", done_weight / total_weight, force=True)

        def on_bytes(done: int, total: int | None, filename: str = filename, weight: float = weight,
                     base: float = done_weight) -> None:
            part = min(done / total, 1.0) if total else 0.0
            size = f" ({done / 1e9:.2f} / {total / 1e9:.2f} GB)" if total else ""
            report(f"downloading {filename}{size}", (base + part * weight) / total_weight)

        path = Path(hf_hub_download(repo_id=repo, filename=filename, revision=revision, cache_dir=cache_dir,
                                    local_files_only=offline,
                                    tqdm_class=_make_tqdm(on_bytes) if progress is not None else None))
        # Pin the commit of the first file so that all four come from one snapshot, even if
        # the repository changes while the big file downloads.
        if revision is None and path.parent.parent.name == "snapshots":
            revision = path.parent.name
        directory = directory or path.parent
        if path.parent != directory:
            raise ModelDownloadError(f"{filename} landed in {path.parent}, not beside the others in {directory}")
        done_weight += weight
        if check is not None and kind == _CHECK_AFTER:
            check(directory)
    report(f"{repo} is ready", 1.0, force=True)
    assert directory is not None
    return directory


def resolve_model(name: str = "auto", hf_repo: str = DEFAULT_HF_REPO, cache_dir: Path | None = None,
                  progress: ProgressFn | None = None, check: SmallFilesCheck | None = None) -> ModelSource:
    """Find or fetch the files of model `name`. "auto" falls back to the tiny model, with
    `fallback_reason` set, when the real files cannot be had; "personaplex-7b-v1" raises instead."""
    if name not in MODEL_CHOICES:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODEL_CHOICES)}")
    if name == TINY_MODEL:
        return _tiny_source(cache_dir, None, check)

    try:
        directory = _download_real(hf_repo, cache_dir, progress, check)
    except CallerError:
        raise
    except Exception as exc:
        reason = _describe_failure(exc, hf_repo)
        if name == REAL_MODEL:
            raise ModelDownloadError(
                f"could not fetch {hf_repo} ({reason}). Set HF_TOKEN to a token whose account has accepted the licence "
                f"at https://huggingface.co/{hf_repo}, check the network (and HF_HUB_OFFLINE), or run the tiny offline "
                "model with --model tiny.") from exc
        fallback = f"the gated repository {hf_repo} could not be fetched ({reason}): running the tiny offline model"
        logger.warning("%s", fallback)
        return _tiny_source(cache_dir, fallback, check)
    logger.info("model %s from %s", REAL_MODEL, directory)
    return ModelSource(name=REAL_MODEL, directory=directory, is_tiny=False)


def _tiny_source(cache_dir: Path | None, reason: str | None, check: SmallFilesCheck | None = None) -> ModelSource:
    from .tiny import ensure_tiny_repo  # imported late: it builds weights only when asked

    directory = Path(ensure_tiny_repo(cache_dir))
    if check is not None:
        check(directory)
    return ModelSource(name=TINY_MODEL, directory=directory, is_tiny=True, fallback_reason=reason)

