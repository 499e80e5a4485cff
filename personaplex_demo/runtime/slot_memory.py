"""What one conversation slot holds on the device, measured from the loaded model for `capacity.plan_slots`:
state sizes from meta tensors (nothing allocated), and on CUDA a probe of a tick's peak at two batch sizes."""

from __future__ import annotations

import dataclasses
import gc
import logging

import torch

from ..call_settings import MAX_PERSONA_TOKENS
from ..engine.core import VISIBLE_BUCKET, LockstepCore
from ..engine.prompt import PREFIX_CACHE_SIZE
from ..engine.tokens import SILENCE_FRAMES
from ..frame import FRAME_SAMPLES
from ..model.config import LMConfig
from .capacity import SlotCost, kv_ring_bytes, plan_slots, safety_margin
from .voices import VoiceCatalog, read_voice_file

log = logging.getLogger(__name__)

PROBE_BATCHES = (1, 4)


def tensor_bytes(obj: object) -> int:
    """Bytes of every tensor in a nested dataclass / list / tuple / dict (meta tensors count too)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def mimi_state_bytes(mimi) -> int:
    """Streaming state of one slot (encoder and decoder), without allocating it."""
    return tensor_bytes(mimi.init_state(1, device=torch.device("meta")))


def graph_pools(cuda_graphs: bool) -> int:
    """Copies of a tick's working memory the engine keeps: with CUDA graphs, one pool per graph
    wrapper (the LM's temporal and depformer parts, Mimi encode and decode), each shared by all
    of that wrapper's keys and at most a whole tick's peak; eagerly, the allocator's one."""
    return 4 if cuda_graphs else 1


def longest_voice(voices: VoiceCatalog) -> int:
    """The longest voice prompt, in frames (the files are small; unreadable ones count as 0)."""
    longest = 0
    for name in voices.names:
        try:
            longest = max(longest, int(read_voice_file(voices.path_of(name))[0].shape[0]))
        except Exception as e:  # a broken voice is reported when a caller picks it, not here
            log.debug("voice %s not measured: %s", name, e)
    return longest


def prefix_cache_bytes(cfg: LMConfig, itemsize: int, voice_frames: int, entries: int) -> int:
    """The prefix cache at its fullest: `entries` prompts of the longest voice and persona."""
    prompt = voice_frames + 2 * SILENCE_FRAMES + MAX_PERSONA_TOKENS
    return entries * kv_ring_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, prompt, itemsize)


def estimated_tick_bytes(cfg: LMConfig, frames: int, itemsize: int) -> int:
    """Rough per-slot working memory of one tick, for when the probe cannot run: one layer's
    activations, the attention scores and mask, the logits and the sampler's copies of them."""
    layer = (4 * cfg.dim + 4 * cfg.hidden) * itemsize + cfg.num_heads * frames * 4 + frames
    logits = 4 * 4 * (cfg.text_card + cfg.dep_q * cfg.card)
    mimi_decode = 4 * 64 * FRAME_SAMPLES * 4  # the decoder's widest activations (64 channels x 1920 samples), a few copies
    return 2 * (layer + logits + mimi_decode)


def probe_tick_bytes(lm, mimi, device: torch.device, dtype: torch.dtype) -> tuple[int, int] | None:
    """(fixed, per slot) bytes of a tick's working memory on CUDA: the allocator's peak over one
    Mimi encode, LM tick and Mimi decode at two batch sizes. None where there is no CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    peaks = []
    for batch in PROBE_BATCHES:
        core = LockstepCore(lm, batch, device, dtype, context=VISIBLE_BUCKET, cuda_graphs=False)
        state = mimi.init_state(batch, device=device)
        pcm = torch.zeros(batch, FRAME_SAMPLES, device=device)
        with torch.no_grad():
            # One whole tick first: lazy set-up (cuBLAS workspaces, Mimi's first-call buffers) is
            # paid once per process, not per slot, so it stays outside the peak.
            res = core.step(mimi.encode_step(pcm, state))
            mimi.decode_step(res.frame[:, 1:9].clamp(0, 2047), state)
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            res = core.step(mimi.encode_step(pcm, state))
            mimi.decode_step(res.frame[:, 1:9].clamp(0, 2047), state)
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
        del core, state, res
    gc.collect()  # the core and its graph wrapper refer to each other
    torch.cuda.empty_cache()
    (b1, p1), (b2, p2) = zip(PROBE_BATCHES, peaks)
    per_slot = max(0, (p2 - p1) // (b2 - b1))
    return max(0, p1 - per_slot * b1), per_slot


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device, after returning the allocator's cached blocks."""
    if device.type != "cuda":
        return None
    gc.collect()  # engines refer to themselves through their graph wrappers: free any dropped one first
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def slot_cost(cfg: LMConfig, mimi_bytes: int, frames: int, itemsize: int, cuda_graphs: bool,
              probe: tuple[int, int] | None) -> tuple[SlotCost, int]:
    """(one slot's bytes at `frames` of context, a tick's fixed working bytes), each working-memory
    figure counted once per graph pool: the probe's figures (`probe_tick_bytes`), else the estimate."""
    fixed, per_slot = probe if probe else (0, estimated_tick_bytes(cfg, frames, itemsize))
    graphs = graph_pools(cuda_graphs)
    kv = kv_ring_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, frames, itemsize)
    return SlotCost(kv=kv, mimi=mimi_bytes, activations=per_slot * graphs), fixed * graphs


def plan_for(lm, mimi, voices: VoiceCatalog, *, slots: int | str, max_slots: int, frames: int,
             device: torch.device, dtype: torch.dtype):
    """The SlotPlan for a loaded model on `device`, served by a `LockstepEngine` with its defaults."""
    cfg: LMConfig = lm.cfg
    itemsize = torch.finfo(dtype).bits // 8
    on_cuda = device.type == "cuda"
    probe = None
    if on_cuda and slots == "auto":
        try:
            probe = probe_tick_bytes(lm, mimi, device, dtype)
        except Exception as e:  # the arithmetic can still go on with the estimate
            log.warning("slot memory probe failed (%s: %s); using an estimate", type(e).__name__, e)
    cost, fixed = slot_cost(cfg, mimi_state_bytes(mimi), frames, itemsize, on_cuda, probe)
    free, reserve = None, 0
    if (memory := device_memory(device)) is not None:
        free, total = memory
        reserve = (prefix_cache_bytes(cfg, itemsize, longest_voice(voices), PREFIX_CACHE_SIZE)
                   + fixed + safety_margin(total))
    per_frame = kv_ring_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, 1, itemsize)
    return plan_slots(slots, device=str(device), free_bytes=free,
                      reserve_bytes=reserve, cost=cost, context_frames=frames, max_slots=max_slots,
                      kv_bytes_per_frame=per_frame)
