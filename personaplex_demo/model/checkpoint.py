"""Official-format checkpoint files: loading with key/shape checks, and hash-v1 tiny files.

Models are built on the meta device and their tensors assigned from the file, so the 17 GB
real checkpoint is never preceded by a random initialisation (docs/model.md).
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import struct
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from ..errors import CheckpointError
from .config import WEIGHTS, LMConfig, MimiConfig, quantized_key
from .files import atomic_file
from .hashinit import tensor_chunks
from .int8 import attach_scales, quantize_rows

log = logging.getLogger(__name__)

_MAX_LISTED = 12


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    return shown + (f" … (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else "")


def expected_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def check_keys(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], path: Path | str) -> None:
    """Raise a CheckpointError naming every missing, unexpected and mis-shaped key."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = sorted(k for k in set(found) & set(expected) if tuple(found[k]) != tuple(expected[k]))
    if not (missing or unexpected or misshaped):
        return
    parts = [f"checkpoint {path} does not match the model:"]
    if missing:
        parts.append(f"{len(missing)} missing key(s): {_listing(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {_listing(unexpected)}")
    if misshaped:
        parts.append(f"{len(misshaped)} key(s) with the wrong shape: " + _listing(
            [f"{k} is {list(found[k])}, expected {list(expected[k])}" for k in misshaped]))
    raise CheckpointError("; ".join(parts))


def load_checkpoint(module: nn.Module, path: Path | str, dtype: torch.dtype, device: torch.device | str = "cpu",
                    int8: bool = False) -> nn.Module:
    """Assign the tensors of `path` to `module` (usually built on the meta device), floating ones
    cast to `dtype`. With `int8`, the `quantized_key` keys are quantized as they are read, one at a
    time (so the load never holds more than one of them at full precision), and get their scales
    (model/int8.py)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    expected = expected_shapes(module)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            check_keys(found, expected, path)
            state, scales = {}, {}
            # With int8, plain reads: the file's pages do not stay mapped beside the int8 copies (peak
            # memory near the int8 size); otherwise the tensors stay views of the mapped file.
            tensors = read_tensors(path, list(expected)) if int8 else ((k, f.get_tensor(k)) for k in expected)
            for key, t in tensors:
                if int8 and quantized_key(key):  # on the device: a GPU rounds 8 B weights in seconds
                    t, scales[key] = quantize_rows(t.to(device), dtype)
                    return_freed_memory()
                elif t.is_floating_point():
                    t = t.to(dtype, copy=int8)  # read_tensors reuses its buffer
                elif int8:
                    t = t.clone()
                state[key] = t.to(device)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises plain errors on truncated or foreign files
        raise CheckpointError(f"checkpoint file {path} could not be read ({type(e).__name__}: {e}); "
                              "it may be truncated or not a safetensors file: delete it and download it again") from e
    if scales:
        module.requires_grad_(False)  # an int8 parameter cannot require gradients
    module.load_state_dict(state, strict=True, assign=True)
    if scales:
        attach_scales(module, scales)
    log.info("loaded %d tensors from %s%s", len(state), path.name,
             f" ({len(scales)} as int8)" if scales else "")
    return module


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
try:
    _LIBC = ctypes.CDLL("libc.so.6") if sys.platform == "linux" else None
    _LIBC.malloc_trim  # noqa: B018 -- musl has no malloc_trim
except (OSError, AttributeError):
    _LIBC = None
_TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
                 "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def return_freed_memory() -> None:
    """Give the heap's freed pages back to the system (glibc's `malloc_trim`; nothing elsewhere).
    Quantizing frees a tensor's working copies between the int8 ones it keeps, and glibc keeps such
    holes resident: over the full-size LM they added about a third to the load's peak."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def read_tensors(path: Path, keys: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file, one at a time, read with plain reads into one buffer
    that each next tensor reuses (copy what you keep): one allocation, not one per tensor, leaves
    the heap no holes to keep when the big tensors are converted and dropped."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        start = 8 + size
        spans = {k: header[k]["data_offsets"] for k in keys}
        buffer = bytearray(max((end - begin for begin, end in spans.values()), default=0))
        for key in keys:
            begin, end = spans[key]
            view = memoryview(buffer)[:end - begin]
            f.seek(start + begin)
            if f.readinto(view) != len(view):
                raise CheckpointError(f"checkpoint file {path} ends inside tensor {key}")
            dtype, shape = _TORCH_DTYPES[header[key]["dtype"]], header[key]["shape"]
            yield key, torch.frombuffer(view, dtype=dtype).reshape(shape) if len(view) else torch.empty(shape, dtype=dtype)


def write_hash_checkpoint(module: nn.Module, path: Path | str, kind: str, seed: int,
                          dtype: torch.dtype = torch.float32, chunk: int = 1 << 24) -> Path:
    """Write hash-v1 weights for every key of `module` (shapes only; meta is fine) as a
    safetensors file, streamed: at most `chunk` elements are in memory at a time, so a full-size
    checkpoint (17 GB) is written with a few hundred MB."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(module)
    itemsize = torch.finfo(dtype).bits // 8
    header: dict[str, dict] = {}
    end = 0
    for key, shape in shapes.items():
        size = math.prod(shape) * itemsize
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [end, end + size]}
        end += size
    header["__metadata__"] = {"format": "pt", "recipe": "hash-v1", "seed": str(seed)}  # type: ignore[assignment]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for key, shape in shapes.items():
            for piece in tensor_chunks(kind, key, shape, seed, chunk):
                f.write(torch.from_numpy(piece).to(dtype).view(torch.uint8).numpy().tobytes())
    return path


def meta_lm(cfg: LMConfig) -> nn.Module:
    from .lm import PersonaPlexLM

    with torch.device("meta"):
        return PersonaPlexLM(cfg)


def meta_mimi(cfg: MimiConfig) -> nn.Module:
    from .mimi import Mimi

    with torch.device("meta"):
        return Mimi(cfg)


def load_lm(cfg: LMConfig, path: Path | str, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu", weights: str = "dense") -> nn.Module:
    """`weights`: "dense" (every weight in `dtype`) or "int8" (the transformer layers' weights
    as int8, model/int8.py)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    lm = load_checkpoint(meta_lm(cfg), path, dtype, device, int8=weights == "int8")
    return lm.eval().requires_grad_(False)


def load_mimi(cfg: MimiConfig, path: Path | str, device: torch.device | str = "cpu") -> nn.Module:
    # Mimi stays fp32 everywhere: it is small, and its codes decide which tokens the LM sees.
    mimi = load_checkpoint(meta_mimi(cfg), path, torch.float32, device)
    return mimi.eval().requires_grad_(False)
