"""What the page, `/api/status` and the doors know of the model that serves the room, whether it
runs in this process (`runtime.build.Runtime`) or in engine processes and Ray actors
(`procs.engine_process.RemoteRuntime`, built from the facts each engine sends)."""

from __future__ import annotations

from typing import Any, Protocol


class RuntimeFacts(Protocol):
    model_name: str
    is_tiny: bool
    banner: str | None
    weights: str  # "dense" or "int8"

    @property
    def device_name(self) -> str:
        """Where the model runs ("cpu", "cuda:0"; for several engines, the first one's)."""
        ...

    def capacity_facts(self) -> dict[str, Any] | None:
        """How the number of slots was decided (`SlotPlan.as_dict`), or None when nobody planned it."""
        ...
