"""How many conversations fit on the device: the arithmetic behind `--slots auto` and `--context`.
Plain numbers in and out (no torch), so it can be checked for any card on any machine; slot_memory.py
measures the device.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

FRAME_RATE = 12.5  # frames per second: one 80 ms frame per tick
CPU_AUTO_SLOTS = 4  # the tiny model on a CPU: what two cores keep in real time
DEFAULT_MAX_SLOTS = 64  # the batch the GPU targets are set for
MIN_CONTEXT_SECONDS = 1.0
GiB = 1 << 30
MiB = 1 << 20
MARGIN_MIN_BYTES = 1 * GiB
MARGIN_FRACTION = 0.03  # of the device's total memory
# The model dtype's names for --dtype, each with torch's own ("auto" picks by device; runtime/build.py).
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


class NoSlotFitsError(RuntimeError):
    """Not even one conversation fits in the device memory left after the weights."""


def parse_slots(text: str | int) -> int | str:
    """`--slots`: "auto" or a whole number of at least 1."""
    value = str(text).strip().lower()
    if value == "auto":
        return "auto"
    try:
        slots = int(value)
    except ValueError:
        raise ValueError(f"{text!r} is neither auto nor a whole number") from None
    if slots < 1:
        raise ValueError(f"must be at least 1, not {slots}")
    return slots


def context_frames(seconds: float | None, model_frames: int) -> int:
    """Ring length in frames for `--context SECONDS` (None: the model's whole window)."""
    if seconds is None:
        return model_frames
    longest = model_frames / FRAME_RATE
    if not (MIN_CONTEXT_SECONDS <= seconds <= longest):  # also false for NaN
        raise ValueError(f"--context must be between {MIN_CONTEXT_SECONDS:g} and {longest:g} seconds "
                         f"(the model's window), got {seconds:g}")
    return min(model_frames, round(seconds * FRAME_RATE))


def kv_ring_bytes(num_layers: int, num_heads: int, head_dim: int, frames: int, itemsize: int) -> int:
    """Keys and values of one slot's temporal ring."""
    return 2 * num_layers * num_heads * head_dim * frames * itemsize


def safety_margin(total_bytes: int) -> int:
    return max(MARGIN_MIN_BYTES, int(MARGIN_FRACTION * total_bytes))


def gib(n: float) -> str:
    """A byte count for people: GiB from 1 GiB up, MiB below."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB" if abs(n) >= 10 * MiB else f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class SlotCost:
    """Device bytes one conversation slot holds."""

    kv: int  # temporal KV ring at the chosen context
    mimi: int  # Mimi encoder and decoder streaming state
    activations: int  # its share of a tick's working memory, times the CUDA graphs kept

    @property
    def total(self) -> int:
        return self.kv + self.mimi + self.activations


@dataclass(frozen=True)
class SlotPlan:
    """The decision and the numbers behind it, as the log and `/api/status` show them."""

    slots: int
    mode: str  # "auto" (memory), "auto-cpu" (the CPU default) or "fixed" (--slots N)
    device: str
    context_seconds: float
    context_frames: int
    max_slots: int
    cost: SlotCost
    free_bytes: int | None = None  # device memory free after the weights (CUDA only)
    reserve_bytes: int = 0  # prefix cache, a tick's fixed working memory, safety margin
    fit: int | None = None  # slots that fit before the --max-slots cap (CUDA only)

    @property
    def trusted_rows(self) -> int:
        """What `--slots auto` would choose here, whatever --slots says: the calls admission by
        headroom seats before it has measured a tick (serving/headroom.py)."""
        if self.free_bytes is None:
            return min(CPU_AUTO_SLOTS, self.max_slots)
        return max(1, min(self.fit or 0, self.max_slots))

    @property
    def bound(self) -> str:
        """What set the number of slots: "memory", "--max-slots", "--slots" or "the CPU default"."""
        if self.mode == "fixed":
            return "--slots"
        if self.mode == "auto-cpu":
            return "the CPU default"
        return "memory" if (self.fit or 0) <= self.max_slots else "--max-slots"

    def describe(self) -> str:
        c = self.cost
        n = f"{self.slots} slot{'' if self.slots == 1 else 's'}"
        per_slot = (f"{gib(c.total)} per slot (KV {gib(c.kv)} at {self.context_seconds:g} s = {self.context_frames} "
                    f"frames, Mimi {gib(c.mimi)}, activations {gib(c.activations)})")
        if self.mode == "auto-cpu":
            return f"{n} on the CPU (the CPU default, --max-slots {self.max_slots}); {per_slot}"
        if self.free_bytes is None:
            return f"{n} (--slots {self.slots}); {per_slot}"
        arithmetic = (f"({gib(self.free_bytes)} free after the weights - {gib(self.reserve_bytes)} reserved) / "
                      f"{per_slot} = {self.fit}")
        if self.mode == "fixed":
            return f"{n} (--slots {self.slots}) on {self.device}; {arithmetic} would fit"
        capped = f", capped by --max-slots {self.max_slots}" if self.fit is not None and self.fit > self.slots else ""
        return f"{n} on {self.device}: {arithmetic}{capped}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cost"]["total"] = self.cost.total
        d["arithmetic"] = self.describe()
        d["bound"] = self.bound
        return d


def fitting_slots(free_bytes: int, reserve_bytes: int, cost: SlotCost) -> int:
    return max(0, (free_bytes - reserve_bytes) // max(cost.total, 1))


def plan_slots(slots: int | str, *, device: str, free_bytes: int | None, reserve_bytes: int, cost: SlotCost,
               context_frames: int, max_slots: int = DEFAULT_MAX_SLOTS, kv_bytes_per_frame: int | None = None
               ) -> SlotPlan:
    """Decide the number of slots. `free_bytes` is the device memory free after the weights (None on a
    CPU, where "auto" means CPU_AUTO_SLOTS). NoSlotFitsError when "auto" finds no room for one slot;
    given `kv_bytes_per_frame`, its message names the longest --context that would fit one."""
    if max_slots < 1:
        raise ValueError(f"--max-slots must be at least 1, got {max_slots}")
    seconds = context_frames / FRAME_RATE
    common = dict(device=device, context_seconds=seconds, context_frames=context_frames, max_slots=max_slots,
                  cost=cost, reserve_bytes=reserve_bytes)
    if free_bytes is None:
        if slots == "auto":
            return SlotPlan(min(CPU_AUTO_SLOTS, max_slots), "auto-cpu", **common)
        return SlotPlan(int(slots), "fixed", **common)
    fit = fitting_slots(free_bytes, reserve_bytes, cost)
    if slots != "auto":
        return SlotPlan(int(slots), "fixed", free_bytes=free_bytes, fit=fit, **common)
    if fit < 1:
        raise NoSlotFitsError(_no_room(free_bytes, reserve_bytes, cost, seconds, device, kv_bytes_per_frame))
    return SlotPlan(min(fit, max_slots), "auto", free_bytes=free_bytes, fit=fit, **common)


def _no_room(free: int, reserve: int, cost: SlotCost, seconds: float, device: str, per_frame: int | None) -> str:
    text = (f"not even one conversation slot fits on {device}: {gib(free)} free after the weights, "
            f"{gib(reserve)} reserved, and one slot needs {gib(cost.total)} at --context {seconds:g}")
    if per_frame:
        room = free - reserve - cost.mimi - cost.activations
        longest = math.floor(room / per_frame / FRAME_RATE) if room > 0 else 0
        if longest >= MIN_CONTEXT_SECONDS:
            return text + f"; a shorter --context fits one slot (--context {longest} or less), or use a larger GPU"
    return text + "; this GPU is too small for the model: use a larger one (or --device cpu)"

