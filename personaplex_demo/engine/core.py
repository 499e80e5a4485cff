"""Batched lockstep over the LM: B conversations stepped together on tokens, one 80 ms frame per tick,
with no host sync (docs/engine.md § The tick). Every row counts only its own steps, so a recycled row is
exactly a fresh session; a tick steps the first n rows, n one of `buckets`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..call_settings import SamplingParams
from ..model.config import LMConfig
from ..model.lm import PersonaPlexLM
from ..model.ring import RingKV, RowStates
from .cuda_graphs import CudaGraphed
from .prompt import PREFIX_CACHE_SIZE, PrefixCache, VoiceTokens
from .rows import batch_buckets
from .sampling import SamplingState, TopK, sample, stream_keys, top_k_bucket, top_k_buckets
from .staging import StagingRing
from .tokens import USER_ROWS

# Temporal attention reads the filled part of the KV rings, rounded up to a multiple of this many
# slots (20.5 s of conversation): few enough CUDA graphs, little wasted reading.
VISIBLE_BUCKET = 256


@dataclass
class LMState(RowStates):
    """Everything the lockstep keeps per row on the device; `reset_rows` makes rows fresh."""

    kv: RingKV  # temporal keys and values
    ring: StagingRing  # staged tokens and each row's offset
    text: SamplingState
    audio: SamplingState
    live: torch.Tensor  # [B] bool: the row is in conversation

    @classmethod
    def empty(cls, lm: PersonaPlexLM, batch: int, device: torch.device, dtype: torch.dtype,
              context: int) -> LMState:
        return cls(lm.new_kv(batch, device, dtype, capacity=context), StagingRing(batch, lm.cfg.delays, device),
                   SamplingState.empty(batch, device), SamplingState.empty(batch, device),
                   torch.zeros(batch, dtype=torch.bool, device=device))

    def move_row(self, src: int, dst: int) -> None:
        """Row `dst` continues row `src`'s conversation; `src` is no longer live."""
        super().move_row(src, dst)
        self.live[src] = False


@dataclass
class RowBook:
    """What the host knows of one row, so that a tick reads nothing back from the device."""

    live: bool = False
    length: int | None = 0  # keys in its KV ring; None: not tracked
    top_k: tuple[int, int] | None = None  # (text, audio) top-k of its sampling


class CoreStep(NamedTuple):
    frame: torch.Tensor  # [n, 17] emitted frame of every row stepped (meaningful where `emitted`)
    emitted: torch.Tensor  # [n] the row stepped and its offset is past the delays
    live: torch.Tensor  # [n] the row is in conversation: its frame is real output


class LockstepCore:
    """Token-level batched lockstep over a PersonaPlexLM."""

    def __init__(self, lm: PersonaPlexLM, batch_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, skip_user_steps: bool = True,
                 prefix_cache_size: int = PREFIX_CACHE_SIZE, context: int | None = None,
                 cuda_graphs: bool = False, attend_filled: bool = True):
        self.lm = lm
        self.cfg: LMConfig = lm.cfg
        self.B = batch_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.context = context or self.cfg.context
        # User rows are always given, so depformer steps 8..15 never change an output.
        self.dep_steps = 8 if skip_user_steps else self.cfg.dep_q
        self.state = LMState.empty(lm, batch_size, self.device, dtype, self.context)
        # The batch sizes a tick runs at, and each one's view of the state.
        self.buckets = self.batch_buckets()
        self._heads = {n: self.state.head(n) for n in self.buckets}
        self.rows = [RowBook() for _ in range(batch_size)]
        self.prefixes = PrefixCache(lm, dtype, self.context, self.device, prefix_cache_size)
        self._slots = torch.arange(batch_size, device=self.device)
        # How many candidates each stream ranks: the largest top-k in use, bucketed; rows mask the rest.
        self._top_k = self._bucketed(25, 250)
        # Attend only the filled part of the rings, from the host's copy of each row's length.
        self.attend_filled = attend_filled
        self._visible: int | None = None
        # Stream ids of a tick's nine draws: text, then the depformer's steps.
        self._streams = torch.arange(1 + self.dep_steps, device=self.device)
        # A tick is two graphs, so that their keys multiply no further: the temporal transformer
        # keyed by the visible ring slots, the sampling and depformer by the top-k buckets.
        graphs = cuda_graphs and self.device.type == "cuda"
        self._graphed_listen = CudaGraphed(self._live_listen, "lockstep temporal", graphs)
        self._graphed_speak = CudaGraphed(self._speak, "lockstep depformer", graphs)

    def batch_buckets(self) -> list[int]:
        """The batch sizes a tick may run at (engine/rows.py)."""
        return batch_buckets(self.B)

    @property
    def graphed(self) -> list[CudaGraphed]:
        """The CUDA-graph wrappers of the tick (for checks and start-up capture)."""
        return [self._graphed_listen, self._graphed_speak]

    def graph_keys(self) -> tuple[list[int], list[int | None], list[tuple[int, int]]]:
        """Every key the tick can meet: batch buckets, visible-slot buckets and (text, audio)
        top-k buckets (docs/engine.md § CUDA graphs)."""
        visible: list[int | None] = [None]
        if self.attend_filled:
            visible = [*range(VISIBLE_BUCKET, self.context, VISIBLE_BUCKET), None]
        top_k = [(t, a) for t in top_k_buckets(self.cfg.text_card) for a in top_k_buckets(self.cfg.card)]
        return list(self.buckets), visible, top_k

    @torch.no_grad()
    def capture_graphs(self) -> int:
        """Capture the graphs of every key now, before any row is live (then a tick changes nothing
        a row can see), so that serving never captures. Returns the number of graphs held."""
        if any(r.live for r in self.rows):
            raise RuntimeError("capture_graphs runs before any row is live")
        batches, visible_keys, top_k_keys = self.graph_keys()
        served_top_k = self._top_k
        try:
            for n in batches:
                codes = torch.zeros(n, 8, dtype=torch.long, device=self.device)
                for visible in visible_keys:
                    self._visible = visible
                    h, target, prov, rows = self._graphed_listen.capture(codes, key=visible)
                for top_k in top_k_keys:
                    self._top_k = top_k
                    self._graphed_speak.capture(h, target, prov, rows, rows, key=top_k)
        finally:
            self._top_k = served_top_k
        return sum(g.captured for g in self.graphed)

    def _bucketed(self, text_top_k: int, audio_top_k: int) -> tuple[int, int]:
        return top_k_bucket(text_top_k, self.cfg.text_card), top_k_bucket(audio_top_k, self.cfg.card)

    # ---- slots --------------------------------------------------------------------------------

    def recycle(self, slot: int) -> None:
        """Forget everything of `slot`: its keys, staging ring, sampling knobs and liveness."""
        self.state.reset_rows(self._slots == slot)
        self.rows[slot] = RowBook()

    def set_sampling(self, slot: int, params: SamplingParams, seed: int) -> None:
        self.state.text.set_row(slot, params.text_temperature, params.text_top_k, params.greedy, seed)
        self.state.audio.set_row(slot, params.audio_temperature, params.audio_top_k, params.greedy, seed)
        self.rows[slot].top_k = (params.text_top_k, params.audio_top_k)
        in_use = [r.top_k for r in self.rows if r.top_k is not None]
        self._top_k = self._bucketed(max(t for t, _ in in_use), max(a for _, a in in_use))

    def start(self, slot: int, voice: VoiceTokens, persona: list[int], params: SamplingParams,
              seed: int) -> None:
        """Recycle `slot` and give it a new session, its system prompt installed at once from
        a parallel forward, cached per (voice, persona)."""
        self.recycle(slot)
        self.set_sampling(slot, params, seed)
        prefix = self.prefixes.get(voice, persona)
        self.state.kv.load_row(slot, prefix.kv, prefix.length)
        ring = self.state.ring
        ring.cache[slot] = prefix.cache.to(self.device)
        ring.provided[slot] = prefix.provided.to(self.device)
        ring.local[slot] = prefix.local
        self.rows[slot].length = prefix.length
        self.set_live(slot, True)

    def end(self, slot: int) -> None:
        self.set_live(slot, False)

    def move(self, src: int, dst: int) -> None:
        """Row `dst` takes over row `src`'s conversation, to the token (a free row below it, so
        that ticks step fewer rows); `src` is left not live."""
        self.state.move_row(src, dst)
        self.rows[dst], self.rows[src] = self.rows[src], RowBook()

    def set_live(self, slot: int, live: bool) -> None:
        self.state.live[slot] = live
        self.rows[slot].live = live

    def is_live(self, slot: int) -> bool:
        return self.rows[slot].live

    def visible_slots(self) -> int | None:
        """How many ring slots this tick must attend, None for the whole ring
        (docs/engine.md § Attending the filled ring)."""
        if not self.attend_filled:
            return None
        lengths = [r.length for r in self.rows if r.live]
        if any(n is None for n in lengths):
            return None
        need = max(lengths, default=0) + 1
        visible = -(-need // VISIBLE_BUCKET) * VISIBLE_BUCKET
        return visible if visible < self.context else None

    def _count_step(self) -> None:
        """One more key in the ring of every live row (as the tick just wrote)."""
        for r in self.rows:
            if r.live and r.length is not None:
                r.length += 1

    # ---- one tick -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, user_codes: torch.Tensor) -> CoreStep:
        """One tick of the first n rows, n = len(user_codes), one of `buckets`: user_codes
        [n, 8] for the live rows (others are ignored). Every live row must be among them."""
        n = user_codes.shape[0]
        if n not in self._heads or any(r.live for r in self.rows[n:]):
            raise ValueError(f"a tick of {n} rows (buckets {self.buckets}) would leave a live row behind")
        self._visible = self.visible_slots()
        h, target, prov, rows = self._graphed_listen(user_codes.to(self.device), key=self._visible)
        res = self._graphed_speak(h, target, prov, rows, rows, key=self._top_k)
        self._count_step()
        return res

    def _user_staging(self, user_codes: torch.Tensor, st: LMState) -> tuple[torch.Tensor, torch.Tensor]:
        n = user_codes.shape[0]
        values = torch.zeros(n, st.ring.K, dtype=torch.long, device=self.device)
        values[:, USER_ROWS] = user_codes
        mask = torch.zeros(n, st.ring.K, dtype=torch.bool, device=self.device)
        mask[:, USER_ROWS] = st.live.view(-1, 1)
        return values, mask

    def _live_listen(self, user_codes: torch.Tensor) -> tuple[torch.Tensor, ...]:
        st = self._heads[user_codes.shape[0]]
        values, mask = self._user_staging(user_codes, st)
        rows = st.live.clone()
        return (*self._listen(st, values, mask, rows, visible=self._visible), rows)

    def _listen(self, st: LMState, values: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                override: tuple[torch.Tensor, torch.Tensor] | None = None,
                visible: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage the tokens of the rows of `st` and run the temporal transformer: (h [n, 1, D],
        the target column [n, 17] and where it is provided [n, 17])."""
        st.ring.stage(values, mask)
        st.ring.warm_up(rows)
        inp, target, prov = st.ring.columns()
        x = self.lm.embed_codes(inp).to(self.dtype)
        if override is not None:
            embeddings, use = override
            x = torch.where(use.view(-1, 1, 1), embeddings[:, None, :], x)
        return self.lm.temporal_step(x, st.kv, rows, visible), target, prov

    def _speak(self, h: torch.Tensor, target: torch.Tensor, prov: torch.Tensor, rows: torch.Tensor,
               live: torch.Tensor) -> CoreStep:
        """Sample the text token, run the depformer over the agent's audio, commit and emit, for
        the first len(h) rows."""
        st = self._heads[h.shape[0]]
        n = self.dep_steps
        seeds = torch.cat([st.text.seed.view(-1, 1), st.audio.seed.view(-1, 1).expand(-1, n)], dim=1)
        keys = stream_keys(seeds, st.ring.local, self._streams)
        text = sample(self.lm.text_logits(h), TopK.prepare(st.text, self._top_k[0]), keys[:, :1])
        next_text = torch.where(prov[:, 0], target[:, 0], text)
        audio_knobs = TopK.prepare(st.audio, self._top_k[1])

        def choose(s: int, logits: torch.Tensor) -> torch.Tensor:
            return sample(logits, audio_knobs, keys[:, 1 + s:2 + s])

        audio = self.lm.depformer_frame(h, next_text, target[:, 1:1 + n], prov[:, 1:1 + n], n, choose)
        chosen = torch.cat([text[:, None], audio, target[:, 1 + n:]], dim=1)
        st.ring.commit(chosen, rows)
        frame, emitted = st.ring.emitted()
        st.ring.advance(rows)
        return CoreStep(frame, emitted & rows, live)
