"""Every message that crosses a process boundary, as a frozen slotted record (docs/processes.md § How they talk):
plain values and numpy arrays only, so either side may be another version or another machine; cheap to pickle (a
`Push` and an `Out` go by for every caller 12.5 times a second). `rid` names a call or request, chosen by the
side that starts it; a receiver matches on the type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

# ---- a pool's clients and its server --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """The server's first word to a new client: what the pool is, before any call."""

    name: str
    slots_total: int
    config: dict[str, Any]  # a PoolConfig's fields
    figures: dict[str, Any]  # a PoolMetrics's fields
    facts: dict[str, Any]  # the engine's facts (engine_process.page_facts), {} when nobody gave any


@dataclass(frozen=True, slots=True)
class Start:
    """Place a call: a free slot, else (when `may_queue`) a place in the queue; a media worker's caller asks
    the room's one queue with it too."""

    rid: int
    voice: str
    persona: str
    sampling: dict[str, Any]  # a SamplingParams's fields
    may_queue: bool
    door: str = "page"  # the door it came through (a label: serving/room.py), for the room's counts


@dataclass(frozen=True, slots=True)
class Push:
    rid: int
    samples: np.ndarray  # the caller's audio as it arrived (any length), int16 (half the bytes of float32) or float32
    held: float = 0.0  # seconds the client held it before sending (tick_gather.py): it arrived that much earlier


@dataclass(frozen=True, slots=True)
class Release:
    """The caller ends its call, or gives up its place in the room's queue."""

    rid: int
    reason: str  # an EndReason, as a plain string


@dataclass(frozen=True, slots=True)
class MediaLag:
    seconds: float  # the client's event loop ran up to this late lately: its media falls behind


# A bad request | no seat (and no place in the queue) | shut.
RefusalKind = Literal["caller", "full", "closed"]


@dataclass(frozen=True, slots=True, kw_only=True)  # by name: two neighbouring `int | None` fields
class StateChange:
    rid: int
    state: str  # a CallState value
    queue_position: int | None = None
    slot: int | None = None
    time_left: float | None = None
    end_reason: str | None = None  # once ended
    wait_reason: str | None = None  # while queued: why


@dataclass(frozen=True, slots=True, kw_only=True)
class Started(StateChange):
    """The answer to a `Start`: the call's first state, and its id."""

    call_id: str


@dataclass(frozen=True, slots=True)
class Refused:
    rid: int
    kind: RefusalKind
    message: str  # for the caller's page
    cause: str | None = None  # busy or full: what is short (a serving.headroom.WaitReason value)


@dataclass(frozen=True, slots=True)
class Out:
    rid: int
    pcm: np.ndarray  # float32 [FRAME_SAMPLES]
    text: str
    tick: int
    latency: float | None = None  # serving.room.SlotOutput's
    input_drops: int = 0
    next_in: float | None = None  # seconds from this message's leaving to the pool's next planned tick


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """The pool's figures, and every tick since the last ones (its time, its frames' latencies)."""

    metrics: dict[str, Any]  # a PoolMetrics's fields
    ticks: list[tuple[float, list[float]]]


# ---- the main process and its children --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop, finishing what is under way (engine processes and media workers alike)."""


@dataclass(frozen=True, slots=True)
class EndCalls:
    """End every call (reason "shutdown") and stop ticking; the server stays up, so the callers hear why."""


@dataclass(frozen=True, slots=True)
class EngineReady:
    facts: dict[str, Any]  # engine_process.page_facts


@dataclass(frozen=True, slots=True)
class EngineFailed:
    error: str  # one line, for the console
    traceback: str  # for the log


@dataclass(frozen=True, slots=True)
class Offer:
    """A WebRTC offer, or a trickled ICE candidate, for the worker that owns the connection."""

    rid: int
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Input:
    """The page's inputs for one connection (fastrtc's `set_input` arguments, plain values)."""

    webrtc_id: str
    args: list[Any]


@dataclass(frozen=True, slots=True)
class RecordingQuery:
    rid: int
    call_id: str
    timeout: float  # how long the worker may wait for the recording to be finished


@dataclass(frozen=True, slots=True)
class Relink:
    """Engine `index` came back at a new address (a restarted Ray actor): link to it for new calls."""

    index: int
    address: Any  # an AF_UNIX path or a TCP (host, port)


@dataclass(frozen=True, slots=True)
class WorkerReady:
    pid: int
    torch_imported: bool  # it should not be


# ---- the room's one queue, kept by the main process for the media workers' callers ----------------
# (beside Start, StateChange, Refused and Release, as between a pool and its clients)


@dataclass(frozen=True, slots=True)
class Grant:
    """The caller `rid` may take a seat on engine number `engine` now; the worker says `Placed`."""

    rid: int
    engine: int


PlacedOutcome = Literal["seated", "busy", "caller", "gone"]  # seated | no seat after all | a bad request | hung up


@dataclass(frozen=True, slots=True)
class Placed:
    rid: int
    outcome: PlacedOutcome
    message: str = ""  # "caller": the engine's words


@dataclass(frozen=True, slots=True)
class QueueLength:
    count: int  # callers in the room's queue, sent to every worker when it changes (their pages' room line)


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to an `Offer`: fastrtc's answer (or refusal) as JSON, and its status code when fastrtc
    answered with a JSONResponse (else None); to a `RecordingQuery`: the recording's (wav, transcript)
    paths, or None."""

    rid: int
    value: tuple[Any, int | None] | tuple[str, str] | None


@dataclass(frozen=True, slots=True)
class Outputs:
    """A page update for one connection (fastrtc's AdditionalOutputs arguments)."""

    webrtc_id: str
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Closed:
    """A connection closed in the worker; `final` is its last page update, if it had one."""

    webrtc_id: str
    final: tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class SocketError:
    """An API socket the worker serves sent its client an error event (for the door's counts)."""

    kind: str  # the door: "realtime", "live" or "chat"
    code: str


@dataclass(frozen=True, slots=True)
class SocketClosed:
    handoff: int  # a socket handed to the worker (socket_handoff.py) closed: its client's socket count has room


ClientMessage = Start | Push | Release | MediaLag
ServerMessage = Started | Refused | StateChange | Out | PoolFigures
WorkerCommand = Offer | Input | RecordingQuery | Relink | Stop | Grant | StateChange | Refused | QueueLength
WorkerReport = WorkerReady | Reply | Outputs | Closed | Start | Placed | Release | SocketError | SocketClosed
