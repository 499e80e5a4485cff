"""hash-v1: deterministic test weights from (key, seed, shape), bit-identical everywhere: the
recipe of the golden fixtures (tests/golden/README.md §1), integer hashing in numpy, one float64
multiply and add, one round-to-nearest cast to float32.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator, Sequence

import numpy as np

M32 = np.uint64(0xFFFFFFFF)

RULE_PARAMS = {
    "weight_var": 3.0, "embedding_scale": 1.0, "norm_offset": 1.0, "norm_scale": 0.5,
    "ln_bias_scale": 0.1, "layer_scale_offset": 0.1, "layer_scale_scale": 0.05,
    "conv_bias_scale": 0.1, "codebook_scale": 0.5,
    "cluster_usage_offset": 1.0, "cluster_usage_scale": 0.5,
}
_LM_EMB = re.compile(r"^(emb\.\d+|text_emb|depformer_emb\.\d+|depformer_text_emb)\.weight$")


def fmix32(h: np.ndarray | np.uint64) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer, exact in uint64."""
    h = np.asarray(h, dtype=np.uint64)
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & M32
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & M32
    return h ^ (h >> np.uint64(16))


def hash_u32(key: str, seed: int, n: int, start: int = 0) -> np.ndarray:
    """Hashes (uint32) of element indices start..start+n-1 for one tensor key. uint32 arrays wrap on
    multiplication, the recipe's "mod 2**32": in place, several times faster than the uint64 form."""
    c = np.uint32(int(fmix32(np.uint64(zlib.crc32(key.encode("utf-8"))) ^ fmix32(np.uint64(seed)))))
    h = np.arange(start, start + n, dtype=np.uint32)
    h *= np.uint32(0x9E3779B1)
    h ^= c
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def _values(key: str, seed: int, n: int, start: int, offset: float, scale: float) -> np.ndarray:
    # The float64 steps of the recipe, one rounding each, in place: u = h / 2**32; (2u - 1) * scale + offset.
    if scale == 0.0:
        return np.full(n, offset, dtype=np.float32)
    v = hash_u32(key, seed, n, start).astype(np.float64)
    v /= 4294967296.0
    v *= 2.0
    v -= 1.0
    v *= scale
    if offset != 0.0:
        v += offset
    return v.astype(np.float32)


def hash_tensor(key: str, seed: int, shape: Sequence[int], offset: float, scale: float) -> np.ndarray:
    """float32(offset + (2u - 1) * scale), u uniform in [0, 1)."""
    shape = tuple(int(s) for s in shape)
    return _values(key, seed, math.prod(shape), 0, offset, scale).reshape(shape)


def tensor_chunks(kind: str, key: str, shape: Sequence[int], seed: int, chunk: int = 1 << 24
                  ) -> Iterator[np.ndarray]:
    """The hash-v1 tensor of `key` (its `rule`) flattened, in float32 pieces of at most `chunk`
    elements: for writing large checkpoints without holding a whole tensor."""
    offset, scale = rule(kind, key, shape)
    n = math.prod(int(s) for s in shape)
    for start in range(0, n, chunk):
        yield _values(key, seed, min(chunk, n - start), start, offset, scale)


def hash_ints(key: str, seed: int, shape: Sequence[int], high: int) -> np.ndarray:
    """Integers h mod high (used for the tiny voices' saved staging rings)."""
    return (hash_u32(key, seed, int(np.prod(shape))) % np.uint64(high)).astype(np.int64).reshape(shape)


def rule(kind: str, key: str, shape: Sequence[int]) -> tuple[float, float]:
    """(offset, scale) of a tensor; kind is "lm" or "mimi". First match wins."""
    p = RULE_PARAMS
    if key.endswith("._initialized"):
        return 1.0, 0.0
    if key.endswith(".cluster_usage"):
        return p["cluster_usage_offset"], p["cluster_usage_scale"]
    if key.endswith(".embedding_sum"):
        return 0.0, p["codebook_scale"]
    if key.endswith(".alpha"):
        return p["norm_offset"], p["norm_scale"]
    if kind == "mimi" and re.search(r"\.norm\d\.weight$", key):
        return p["norm_offset"], p["norm_scale"]
    if kind == "mimi" and re.search(r"\.norm\d\.bias$", key):
        return 0.0, p["ln_bias_scale"]
    if "layer_scale" in key and key.endswith(".scale"):
        return p["layer_scale_offset"], p["layer_scale_scale"]
    if key.endswith(".bias"):
        return 0.0, p["conv_bias_scale"]
    if kind == "lm" and _LM_EMB.match(key):
        return 0.0, p["embedding_scale"]
    fan_in = int(np.prod(shape[1:]))
    return 0.0, math.sqrt(p["weight_var"] / fan_in)

