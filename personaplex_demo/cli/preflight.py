"""Checks before any heavy work, each failure one line and exit status 2 seconds after the start
instead of after a model load: the port is free, the Hub grants access to the real model's files not
cached yet, and the cache folder is writable with room for them."""

from __future__ import annotations

import errno
import logging
import shutil
import socket
import tempfile
from pathlib import Path

from ..errors import ModelDownloadError
from ..model.config import ModelFiles
from ..runtime.capacity import NoSlotFitsError
from ..runtime.hub import FILE_BYTES, REAL_MODEL, access_denied, hub_offline

log = logging.getLogger(__name__)

EXIT_PREFLIGHT = 2
GB = 1e9
TINY_MODEL_BYTES = 16 << 20  # the tiny model's files, with room to spare
HUB_TIMEOUT_SECONDS = 10.0


class PreflightError(RuntimeError):
    """A start-up problem the user can fix; the message is one line."""


# Start-up failures reported as one line with EXIT_PREFLIGHT rather than a traceback.
START_ERRORS = (PreflightError, ModelDownloadError, NoSlotFitsError)


def check_port(host: str, port: int) -> None:
    """Fail unless `port` can be bound on `host` (and on 127.0.0.1, which Gradio also tries)."""
    if not 0 < port < 65536:
        raise PreflightError(f"--port {port} is not a TCP port number (1-65535)")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    for address in dict.fromkeys([bare, "127.0.0.1"]):
        try:
            infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise PreflightError(f"--host {host}: cannot resolve the address ({e.strerror})") from None
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as s:
            # As uvicorn binds: a socket of a closed server (TIME_WAIT) does not count as busy.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise PreflightError(f"port {port} on {address} is already in use (is the app already "
                                         f"running?); choose another with --port") from None
                if e.errno == errno.EACCES:
                    raise PreflightError(f"port {port} on {address} needs privileges; choose one above 1023 "
                                         "with --port") from None
                raise PreflightError(f"cannot listen on {address}:{port} ({e.strerror}); check --host and "
                                     "--port") from None


def check_cache_folder(folder: Path, need_bytes: float, what: str = "the model download") -> None:
    """Fail unless `folder` can be created and written and its disk has `need_bytes` free."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise PreflightError(f"the cache folder {folder} is a file; point --cache-dir (or HF_HOME) at a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as e:
        raise PreflightError(f"the cache folder {folder} is not writable ({e.strerror or e}); point --cache-dir "
                             "(or HF_HOME) at a writable folder") from None
    free = shutil.disk_usage(folder).free  # it exists now
    if free < need_bytes:
        raise PreflightError(f"the cache folder {folder} has {free / GB:.1f} GB free, but {what} needs "
                             f"{need_bytes / GB:.1f} GB; free some space or point --cache-dir (or HF_HOME) "
                             "at a larger disk")


def missing_files(repo: str, cache_dir: Path | None) -> list[str]:
    """Kinds ("lm", "mimi", ...) of the model files not yet in the local Hub cache."""
    from huggingface_hub import try_to_load_from_cache

    files = ModelFiles()
    return [kind for kind in FILE_BYTES
            if not isinstance(try_to_load_from_cache(repo, getattr(files, kind), cache_dir=cache_dir), str)]


def download_size(repo: str, kinds: list[str], explicit: bool) -> float | None:
    """Bytes left to download, from the Hub's answers for each missing file. A gated, 401 or 403
    answer is a PreflightError when the real model was asked for by name; with "auto" (and on any
    other failure) None: the download reports it, and "auto" falls back to the tiny model."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    files = ModelFiles()
    total = 0.0
    for kind in kinds:
        try:
            meta = get_hf_file_metadata(hf_hub_url(repo, getattr(files, kind)), timeout=HUB_TIMEOUT_SECONDS)
        except Exception as e:  # huggingface_hub raises many types; only access is decided here
            denied = access_denied(e, repo)
            if denied and explicit:
                raise PreflightError(f"cannot download {repo}: {denied} (or run the tiny offline model with "
                                     "--model tiny)") from None
            log.debug("preflight: no answer for %s (%s)", kind, type(e).__name__)
            return None
        total += meta.size or FILE_BYTES[kind]
    return total


def check_model_files(model: str, repo: str, cache_dir: Path | None, device: str) -> None:
    """Access and disk checks for the files the start will need."""
    real = model == REAL_MODEL or (model == "auto" and cuda_in_use(device))
    if not real:
        from ..runtime.tiny import default_cache_dir, tiny_repo_ready

        if not tiny_repo_ready(cache_dir):
            check_cache_folder(Path(cache_dir) if cache_dir else default_cache_dir(), TINY_MODEL_BYTES,
                               "the tiny model")
        return
    kinds = missing_files(repo, cache_dir)
    if not kinds or hub_offline():  # all cached; or offline, where the cache lookup reports what lacks
        return
    need = download_size(repo, kinds, explicit=model == REAL_MODEL)
    if need is not None:
        from huggingface_hub import constants

        check_cache_folder(Path(cache_dir) if cache_dir else Path(constants.HF_HUB_CACHE), need)


def cuda_in_use(device: str) -> bool:
    """Whether the start will run on CUDA (imports torch, so it comes after the port check; a CUDA
    device that does not exist is reported by loading.check_placement)."""
    if device != "auto":
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()
