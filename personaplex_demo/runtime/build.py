"""From options to a running engine: resolve the model files, load them, build the engine."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..engine.pcm import LockstepEngine
from ..model.checkpoint import load_lm, load_mimi
from ..model.config import INT8_FLOAT16, LMConfig, MimiConfig, ModelFiles
from ..serving.config import PoolConfig
from .capacity import DEFAULT_MAX_SLOTS, DTYPE_NAMES, FRAME_RATE, SlotPlan
from .hub import DEFAULT_HF_REPO, ModelSource, ProgressFn, resolve_model
from .slot_memory import plan_for
from .tokenizer import TextTokenizer
from .voices import VoiceCatalog

log = logging.getLogger(__name__)

INT8_BANNER = ("The language model runs with int8 weights: half the memory of bfloat16; their effect on the "
               "conversation's quality has not been measured.")
# Checks a request against the model's tokenizer and voices before the weights are fetched or loaded.
RequestCheck = Callable[[TextTokenizer, VoiceCatalog], None]


@dataclass(frozen=True)
class RuntimeOptions:
    model: str = "auto"  # auto | personaplex-7b-v1 | tiny
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    weights: str = "dense"  # dense | int8: the LM's transformer weights (model/int8.py)
    slots: int | str = "auto"  # a number, or "auto": as many as the device memory holds (4 on a CPU)
    max_slots: int = DEFAULT_MAX_SLOTS  # the cap of "auto"
    hf_repo: str = DEFAULT_HF_REPO
    cache_dir: Path | None = None
    context: int | None = None  # temporal ring length in frames (--context seconds x 12.5); None: the model's


@dataclass
class Runtime:
    engine: LockstepEngine
    model_name: str
    is_tiny: bool
    banner: str | None
    tokenizer: TextTokenizer
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    capacity: SlotPlan  # how the number of slots was decided
    weights: str  # RuntimeOptions.weights

    @property
    def device_name(self) -> str:
        return str(self.device)

    def capacity_facts(self) -> dict:
        return self.capacity.as_dict()

    def pool_config(self, config: PoolConfig) -> PoolConfig:
        """`config` with this device's trusted row count for admission before a tick is measured."""
        if config.headroom_prior_rows is not None:
            return config
        return replace(config, headroom_prior_rows=self.capacity.trusted_rows)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device} was asked for, but torch sees no CUDA GPU; use --device cpu")
    return d


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}: choose auto, float32, bfloat16 or float16")
    return getattr(torch, DTYPE_NAMES[dtype])


def check_placement(device: str, dtype: str, weights: str = "dense") -> None:
    """Fail early, with one ValueError, on a device, dtype or weights choice this machine cannot use."""
    try:
        chosen = pick_dtype(dtype, pick_device(device))
    except RuntimeError as exc:  # torch's own complaint about a malformed device string, or no CUDA
        raise ValueError(str(exc).splitlines()[0]) from None
    if weights == "int8" and chosen == torch.float16:
        raise ValueError(INT8_FLOAT16)


def _open_small_files(directory: Path) -> tuple[TextTokenizer, VoiceCatalog]:
    files = ModelFiles()
    return (TextTokenizer(directory / files.tokenizer),
            VoiceCatalog.from_archive(directory / files.voices, directory / "voices"))


def build_runtime(options: RuntimeOptions, progress: ProgressFn | None = None,
                  check: RequestCheck | None = None) -> Runtime:
    """Resolve, check, load. `check(tokenizer, voices)` runs as soon as those two small files are
    there (before the weights are downloaded or loaded); a CallerError it raises stops the start."""
    device = pick_device(options.device)
    dtype = pick_dtype(options.dtype, device)
    model = options.model
    banner = None
    if model == "auto" and device.type != "cuda":
        model = "tiny"
        banner = ("No CUDA GPU found: PersonaPlex-7B needs one, so this demo runs the tiny offline model. "
                  "It babbles; every other part of the app is real.")
    report = progress or (lambda msg, frac: None)
    report("finding the model files", 0.0)
    source = resolve_model(model, options.hf_repo, options.cache_dir, progress=report,
                           check=(lambda directory: check(*_open_small_files(directory))) if check else None)
    if source.is_tiny and banner is None:
        banner = (f"{source.fallback_reason[0].upper()}{source.fallback_reason[1:]}. "
                  "It babbles; every other part of the app is real." if source.fallback_reason else
                  "Running the tiny offline model, a small stand-in with random weights: it babbles; every "
                  "other part of the app is real.")
    lm_cfg = LMConfig.tiny() if source.is_tiny else LMConfig()
    mimi_cfg = MimiConfig.tiny() if source.is_tiny else MimiConfig()
    report("loading the language model", 0.6)
    lm = load_lm(lm_cfg, source.lm_path, dtype, device, weights=options.weights)
    if options.weights == "int8":
        banner = " ".join(filter(None, [banner, INT8_BANNER]))
    report("loading the Mimi codec", 0.85)
    mimi = load_mimi(mimi_cfg, source.mimi_path, device)
    tokenizer, voices = _open_small_files(source.directory)
    frames = options.context or lm_cfg.context
    plan = plan_for(lm, mimi, voices, slots=options.slots, max_slots=options.max_slots, frames=frames,
                    device=device, dtype=dtype)
    log.info("slots: %s", plan.describe())
    if plan.fit is not None and plan.slots > plan.fit:
        log.warning("--slots %d is more than the %d that the free memory holds; the device may run out of memory",
                    plan.slots, plan.fit)
    engine = LockstepEngine(lm, mimi, tokenizer, voices, plan.slots, device, dtype, context=frames)
    if device.type == "cuda":
        report("capturing CUDA graphs", 0.95)
    began = time.monotonic()
    if held := engine.capture_graphs():
        log.info("captured %d CUDA graphs in %.1f s, before the first caller", held, time.monotonic() - began)
    report("ready", 1.0)
    log.info("engine ready: %s on %s (%s, %s weights), %d slots, context %g s", source.name, device,
             str(dtype).removeprefix("torch."), options.weights, plan.slots, frames / FRAME_RATE)
    return Runtime(engine, source.name, source.is_tiny, banner, tokenizer, source, device, dtype, plan, options.weights)
