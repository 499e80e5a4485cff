"""Voice prompts: the catalogue of `voices/NAME.pt` files from `voices.tgz` (docs/model.md § Files).
Every member of the archive passes tarfile's "data" filter and the size bounds before any is extracted,
only regular `voices/NAME.pt` files are, and a caller's voice name only ever selects a catalogue entry.
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import pickle
import tarfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

import torch

from ..call_settings import VOICE_NAME_RE
from ..errors import UnknownVoiceError, VoiceArchiveError, VoiceFileError
from ..frame import AUDIO_CARD, TEXT_CARD
from ..model.files import atomic_file

logger = logging.getLogger(__name__)

VOICES_FOLDER = "voices"

CACHE_SHAPE = (1, 17, 4)  # [batch, token rows, staging ring columns] (docs/engine.md § Staging ring and delays)

# The official voices are about 0.5 MB each and 8 MB in all; these bounds leave a wide margin
# while stopping a hostile archive from filling the disk.
MAX_MEMBER_BYTES = 64 << 20
MAX_ARCHIVE_BYTES = 1 << 30
MAX_MEMBERS = 4096


@dataclass(frozen=True, eq=False)
class VoicePrompt:
    name: str
    embeddings: torch.Tensor  # [T, 1, 1, D] in the model dtype, on the model device
    cache: torch.Tensor  # long [1, 17, 4]: the saved staging ring, copied into a slot verbatim

    @property
    def length(self) -> int:
        """T: the number of voice-replay ticks."""
        return int(self.embeddings.shape[0])

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[-1])


def _member_problem(member: tarfile.TarInfo, root: Path) -> str | None:
    """Why `member` must not be in the archive (tarfile's "data" filter, and the size bound), or None."""
    try:
        tarfile.data_filter(member, str(root))
    except tarfile.FilterError as exc:
        return str(exc)
    if member.size > MAX_MEMBER_BYTES:
        return f"{member.name!r} is {member.size} bytes, over the {MAX_MEMBER_BYTES}-byte limit for one member"
    return None


def _voice_member_name(member: tarfile.TarInfo) -> str | None:
    """The voice name of a `voices/NAME.pt` regular file, else None."""
    path = PurePosixPath(member.name)  # no "." parts: "./voices/A.pt" is ("voices", "A.pt")
    if member.isfile() and path.parts[:-1] == (VOICES_FOLDER,) and path.suffix == ".pt" and VOICE_NAME_RE.match(path.stem):
        return path.stem
    return None


def _checked_voice_members(tf: tarfile.TarFile, label: str, root: Path) -> dict[str, tarfile.TarInfo]:
    """The archive's voice members by name, once every member has passed `_member_problem` and the bounds."""
    voices: dict[str, tarfile.TarInfo] = {}
    total = 0
    try:
        for count, member in enumerate(tf, start=1):
            if count > MAX_MEMBERS:
                raise VoiceArchiveError(f"{label}: more than {MAX_MEMBERS} members")
            if (problem := _member_problem(member, root)) is not None:
                raise VoiceArchiveError(f"{label}: refusing a member: {problem}")
            total += member.size
            if total > MAX_ARCHIVE_BYTES:
                raise VoiceArchiveError(f"{label}: members add up to more than {MAX_ARCHIVE_BYTES} bytes")
            if (name := _voice_member_name(member)) is not None:
                voices[name] = member
            elif member.isfile():
                logger.debug("%s: ignoring %s (not voices/NAME.pt)", label, member.name)
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise VoiceArchiveError(f"{label}: corrupt archive ({exc})") from exc
    if not voices:
        raise VoiceArchiveError(f"{label}: no {VOICES_FOLDER}/NAME.pt files in the archive")
    return voices


def _copy_bounded(src: IO[bytes], dst_path: Path, limit: int) -> None:
    with atomic_file(dst_path) as out:
        copied = 0
        while chunk := src.read(1 << 20):
            copied += len(chunk)
            if copied > limit:
                raise VoiceArchiveError(f"{dst_path.name}: member grew past {limit} bytes")
            out.write(chunk)


class VoiceCatalog:
    """The voices a model offers, by name; loaded prompts are cached per (name, dtype, device)."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        for name in files:
            if not VOICE_NAME_RE.match(name):
                raise ValueError(f"invalid voice name {name!r}")
        self._files = {name: Path(path) for name, path in sorted(files.items())}
        self._loaded: dict[tuple[str, torch.dtype, str], VoicePrompt] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_archive(cls, tgz_path: str | os.PathLike[str], extract_dir: str | os.PathLike[str]) -> VoiceCatalog:
        """Unpack the `voices/NAME.pt` members of `voices.tgz` into `extract_dir`; other files are ignored.
        Every member is checked before anything is written: one unsafe member fails the whole archive."""
        label = Path(tgz_path).name
        root = Path(extract_dir).resolve()
        try:
            tf = tarfile.open(tgz_path, mode="r:*")
        except (OSError, tarfile.TarError) as exc:
            raise VoiceArchiveError(f"{label}: not a readable tar archive ({exc})") from exc
        with tf:
            files: dict[str, Path] = {}
            for name, member in _checked_voice_members(tf, label, root).items():
                files[name] = root / VOICES_FOLDER / f"{name}.pt"
                try:
                    with tf.extractfile(member) as src:  # type: ignore[union-attr]  # a regular file has data
                        _copy_bounded(src, files[name], MAX_MEMBER_BYTES)
                except (OSError, tarfile.TarError, EOFError) as exc:
                    raise VoiceArchiveError(f"{label}: cannot extract {member.name!r} ({exc})") from exc
        logger.info("voice catalogue: %d voices from %s", len(files), tgz_path)
        return cls(files)

    @property
    def names(self) -> list[str]:
        return list(self._files)

    def check_name(self, name: object) -> str:
        """Return `name` if it is a catalogued voice; otherwise raise `UnknownVoiceError`."""
        valid = ", ".join(self._files)
        if not isinstance(name, str) or not VOICE_NAME_RE.match(name):
            raise UnknownVoiceError(  # a short repr only: the value comes from a caller
                f"invalid voice name {repr(name)[:80]}: a voice is one of the listed names, not a path "
                f"(letters, digits, '_' and '-' only). Valid voices: {valid}")
        if name not in self._files:
            raise UnknownVoiceError(f"unknown voice {name!r}. Valid voices: {valid}")
        return name

    def path_of(self, name: str) -> Path:
        return self._files[self.check_name(name)]

    def load(self, name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             dim: int | None = None) -> VoicePrompt:
        """The prompt `name`, its embeddings cast to `dtype` on `device`; `dim`, if given, must match D."""
        name = self.check_name(name)
        dev = torch.device(device)
        key = (name, dtype, str(dev))
        with self._lock:
            prompt = self._loaded.get(key)
            if prompt is None:
                embeddings, cache = read_voice_file(self._files[name])
                prompt = VoicePrompt(name, embeddings.to(device=dev, dtype=dtype), cache.to(device=dev, dtype=torch.long))
                self._loaded[key] = prompt
        if dim is not None and prompt.dim != dim:
            raise VoiceFileError(f"{self._files[name].name}: embeddings have dimension {prompt.dim}, the model needs {dim}")
        return prompt


def read_voice_file(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Load and check one `.pt` voice prompt; returns (embeddings, cache) as stored, on CPU."""
    data = _load_tensors(path)
    fname = path.name
    if not isinstance(data, dict):
        raise VoiceFileError(f"{fname}: expected a dict with 'embeddings' and 'cache', got {type(data).__name__}")
    missing = [k for k in ("embeddings", "cache") if k not in data]
    if missing:
        raise VoiceFileError(f"{fname}: missing key(s) {missing}; found {sorted(map(str, data))}")
    return _checked_embeddings(fname, data["embeddings"]), _checked_cache(fname, data["cache"])


def _load_tensors(path: Path) -> object:
    """What `path` unpickles to with torch's weights-only loader, or a VoiceFileError that says why not."""
    fname = path.name
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise VoiceFileError(f"{fname}: cannot read the voice file ({exc})") from exc
    if size > MAX_MEMBER_BYTES:
        raise VoiceFileError(f"{fname}: {size} bytes, over the {MAX_MEMBER_BYTES}-byte limit")
    try:
        # weights_only: a voice file is data; it must not be able to run code when unpickled.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types here (UnpicklingError, RuntimeError, ...)
        text = str(exc).strip()
        if isinstance(exc, pickle.UnpicklingError) or "weights_only" in text:
            # torch's own message suggests retrying with weights_only=False: never repeat that;
            # keep only the unpickler's reason (an unsupported global or opcode).
            lines = [line.strip() for line in text.splitlines()[1:]
                     if line.strip() and not line.startswith(("Check the documentation", "Please file an issue"))]
            reason = lines[0][:160] if lines else "it holds more than tensors"
            detail = f"refused by the weights-only unpickler: {reason}"
        else:
            detail = f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else 'unreadable'}"
        raise VoiceFileError(f"{fname}: not a tensor file that loads with weights_only=True ({detail})") from exc


def _checked_embeddings(fname: str, emb: object) -> torch.Tensor:
    if not isinstance(emb, torch.Tensor) or not emb.is_floating_point():
        raise VoiceFileError(f"{fname}: 'embeddings' must be a floating-point tensor, got {_describe(emb)}")
    if emb.dim() != 4 or emb.shape[0] < 1 or emb.shape[1:3] != (1, 1) or emb.shape[3] < 1:
        raise VoiceFileError(f"{fname}: 'embeddings' must have shape [T, 1, 1, D] with T >= 1, got {list(emb.shape)}")
    if not bool(torch.isfinite(emb).all()):
        raise VoiceFileError(f"{fname}: 'embeddings' contains NaN or infinite values")
    return emb


def _checked_cache(fname: str, cache: object) -> torch.Tensor:
    if not isinstance(cache, torch.Tensor) or cache.is_floating_point() or cache.is_complex() or cache.dtype == torch.bool:
        raise VoiceFileError(f"{fname}: 'cache' must be an integer tensor, got {_describe(cache)}")
    if tuple(cache.shape) != CACHE_SHAPE:
        raise VoiceFileError(f"{fname}: 'cache' must have shape {list(CACHE_SHAPE)}, got {list(cache.shape)}")
    # Row 0 holds text ids (up to the text card: the text-initial token), rows 1..16 audio codes (up
    # to the audio card, the audio-initial token). -1 and -2 are moshi's "no token" / "not generated".
    cache = cache.to(torch.long)
    if int(cache.min()) < -2 or int(cache[:, 0].max()) > TEXT_CARD or int(cache[:, 1:].max()) > AUDIO_CARD:
        raise VoiceFileError(f"{fname}: 'cache' values out of range (row 0 must be in [-2, {TEXT_CARD}], "
                             f"rows 1-16 in [-2, {AUDIO_CARD}])")
    return cache


def _describe(value: object) -> str:
    return f"a {value.dtype} tensor of shape {list(value.shape)}" if torch.is_tensor(value) else type(value).__name__


def write_voices_archive(tgz_path: str | os.PathLike[str], prompts: Mapping[str, Mapping[str, torch.Tensor]]) -> Path:
    """Write `prompts` as an official-layout `voices.tgz` (`voices/NAME.pt`, each a `torch.save` of
    {"embeddings", "cache"}). Fixed member order, and TarInfo's zero times and owners: same input, same bytes."""
    tgz_path = Path(tgz_path)
    with (atomic_file(tgz_path) as out, gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as gz,
          tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tf):
        folder = tarfile.TarInfo(VOICES_FOLDER)
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tf.addfile(folder)
        for name in sorted(prompts):
            if not VOICE_NAME_RE.match(name):
                raise ValueError(f"invalid voice name {name!r}")
            payload = io.BytesIO()
            torch.save({"embeddings": prompts[name]["embeddings"], "cache": prompts[name]["cache"]}, payload)
            member = tarfile.TarInfo(f"{VOICES_FOLDER}/{name}.pt")
            member.size = payload.tell()
            payload.seek(0)
            tf.addfile(member, payload)
    return tgz_path
