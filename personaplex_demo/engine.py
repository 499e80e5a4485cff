"""Batched lockstep engine: B conversations stepped together, one 80 ms frame per tick
(spec §E-H).

`LockstepCore` works on tokens: the staging ring, the per-slot system prompt (played tick by
tick, or computed at once by a parallel teacher-forced forward and cached), sampling, and
per-slot recycle. `LockstepEngine` wraps it with Mimi (PCM in and out), voices, the tokenizer
and the transcript, and is what the SlotPool drives.

Every row keeps its own offset `local`: its staging column is `local % CT`, its RoPE position
and KV ring index count only its own steps. A recycled row is therefore exactly a fresh
session, with no ring roll needed (spec §H rolls because it shares one physical offset).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .cuda_graphs import CudaGraphed
from .errors import AudioFormatError, CallerError, PersonaTooLongError
from .model.config import LMConfig
from .model.lm import PersonaPlexLM
from .sampling import SamplingState, sample
from .sampling_params import SamplingParams
from .tokens import AUDIO_INITIAL, SILENCE_CODES, SILENCE_FRAMES, SINE_CODES, TEXT_INITIAL, TEXT_PAD

log = logging.getLogger(__name__)

# Temporal attention reads the filled part of the KV rings, rounded up to a multiple of this many
# slots (20.5 s of conversation): few enough CUDA graphs, little wasted reading.
VISIBLE_BUCKET = 256

MAX_PERSONA_TOKENS = 512


@dataclass
class TickOutput:
    pcm: np.ndarray  # float32 [B, 1920]: agent audio; zeros for rows that are not live
    text: list[str]  # per row: transcript text that became final this tick ("" if none)
    tokens: np.ndarray | None = None  # int64 [B, 17]: the emitted frame (text, agent, user codes)
    live: np.ndarray | None = None  # bool [B]: rows whose output is a real conversation frame


@dataclass(frozen=True)
class VoiceTokens:
    """A voice prompt as the core needs it: embeddings [T, D] and the saved ring [17, CT]."""

    name: str
    embeddings: torch.Tensor
    cache: torch.Tensor


@dataclass(frozen=True)
class PromptStep:
    kind: str  # "dead" | "voice" | "tokens"
    index: int = 0  # voice embedding index, or forced text id for "tokens"
    restore: bool = False  # restore the voice's saved ring before this step


def prompt_steps(voice_len: int, persona: list[int]) -> list[PromptStep]:
    """The system prompt of spec §F, one entry per tick: dead, voice, silence, persona, silence."""
    steps = [PromptStep("dead")] + [PromptStep("voice", t) for t in range(voice_len)]
    texts = [TEXT_PAD] * SILENCE_FRAMES + list(persona) + [TEXT_PAD] * SILENCE_FRAMES
    steps += [PromptStep("tokens", t, restore=(i == 0)) for i, t in enumerate(texts)]
    return steps


@dataclass
class Prefix:
    """A row's state right after its system prompt, ready to install into any row."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer keys/values [H, L, Dh]
    length: int  # temporal steps taken (L)
    cache: torch.Tensor  # [17, CT]
    provided: torch.Tensor  # [17, CT]
    local: int  # L + 1: the dead step counts as an offset but not as a temporal step


class StagingRing:
    """The token staging ring of every row: cache/provided [B, 17, CT] and `local` [B]."""

    def __init__(self, batch: int, delays: tuple[int, ...], device: torch.device | str):
        self.K = len(delays)
        self.CT = max(delays) + 3
        self.max_delay = max(delays)
        self.delays = torch.tensor(delays, dtype=torch.long, device=device)
        self.initial = torch.tensor([TEXT_INITIAL] + [AUDIO_INITIAL] * (self.K - 1), dtype=torch.long, device=device)
        self.cache = self.initial.view(1, -1, 1).repeat(batch, 1, self.CT)
        self.provided = torch.zeros(batch, self.K, self.CT, dtype=torch.bool, device=device)
        self.local = torch.zeros(batch, dtype=torch.long, device=device)

    def reset_rows(self, rows: torch.Tensor) -> None:
        self.cache[rows] = self.initial.view(-1, 1)
        self.provided[rows] = False
        self.local[rows] = 0

    def _col(self, offset: torch.Tensor) -> torch.Tensor:
        return (offset % self.CT).view(-1, 1, 1).expand(-1, self.K, 1)

    def stage(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Provide tokens [B, 17] where mask [B, 17]: row k goes to column local + delay[k]."""
        cols = ((self.local.view(-1, 1) + self.delays.view(1, -1)) % self.CT)[..., None]
        old = self.cache.gather(2, cols)[..., 0]
        self.cache.scatter_(2, cols, torch.where(mask, values, old)[..., None])
        self.provided.scatter_(2, cols, (self.provided.gather(2, cols)[..., 0] | mask)[..., None])

    def warm_up(self, rows: torch.Tensor) -> None:
        """At the start of a stream a delayed row has no value yet: use the initial token."""
        gate = (self.local.view(-1, 1) <= self.delays.view(1, -1)) & rows.view(-1, 1)
        col = self._col(self.local)
        old = self.cache.gather(2, col)[..., 0]
        self.cache.scatter_(2, col, torch.where(gate, self.initial.view(1, -1), old)[..., None])
        self.provided.scatter_(2, col, (self.provided.gather(2, col)[..., 0] | gate)[..., None])

    def dead_step(self, rows: torch.Tensor) -> None:
        """The reference's model-less step at offset 0 (spec §E.3)."""
        self.cache[:, :, 0] = torch.where(rows.view(-1, 1), self.initial.view(1, -1), self.cache[:, :, 0])
        self.local += rows.long()

    def columns(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(model input [B, 17], target [B, 17], target provided [B, 17])."""
        mip = self._col(self.local - 1)
        tp = self._col(self.local)
        return self.cache.gather(2, mip)[..., 0], self.cache.gather(2, tp)[..., 0], self.provided.gather(2, tp)[..., 0]

    def commit(self, chosen: torch.Tensor, rows: torch.Tensor) -> None:
        """Write chosen tokens [B, 17] into the target column where not provided (spec §E.7)."""
        mip = self._col(self.local - 1)
        tp = self._col(self.local)
        prov_mip = self.provided.gather(2, mip)[..., 0]
        self.provided.scatter_(2, mip, (prov_mip & ~rows.view(-1, 1))[..., None])
        prov = self.provided.gather(2, tp)[..., 0]
        old = self.cache.gather(2, tp)[..., 0]
        write = rows.view(-1, 1) & ~prov
        self.cache.scatter_(2, tp, torch.where(write, chosen, old)[..., None])

    def emitted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(frame [B, 17], emitted [B]): text and agent cb0 from column o-1, the rest from o."""
        cols = ((self.local.view(-1, 1) - 1 + self.delays.view(1, -1)) % self.CT)[..., None]
        return self.cache.gather(2, cols)[..., 0], self.local > self.max_delay

    def advance(self, rows: torch.Tensor) -> None:
        self.local += rows.long()


class CoreStep(NamedTuple):
    frame: torch.Tensor  # [B, 17] emitted frame of every row (meaningful where `emitted`)
    emitted: torch.Tensor  # [B] the row stepped and its offset is past the delays
    live: torch.Tensor  # [B] the row is in conversation: its frame is real output


@dataclass
class _SlotPrompt:
    voice: VoiceTokens
    steps: deque[PromptStep]


@dataclass
class CoreStats:
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefills: int = 0


class LockstepCore:
    """Token-level batched lockstep over a PersonaPlexLM."""

    def __init__(self, lm: PersonaPlexLM, batch_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, skip_user_steps: bool = True,
                 prefix_cache_size: int = 8, context: int | None = None, cuda_graphs: bool = False,
                 attend_filled: bool = True):
        self.lm = lm
        self.cfg: LMConfig = lm.cfg
        self.B = batch_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.context = context or self.cfg.context
        # User rows are always given, so depformer steps 8..15 never change an output (spec §C.1).
        self.dep_steps = 8 if skip_user_steps else self.cfg.dep_q
        self.ring = StagingRing(batch_size, self.cfg.delays, self.device)
        self.kv = lm.new_kv(batch_size, self.device, dtype, capacity=self.context)
        self.text_sampling = SamplingState.empty(batch_size, self.device)
        self.audio_sampling = SamplingState.empty(batch_size, self.device)
        self.top_k_in_use: dict[int, tuple[int, int]] = {}
        self.live = torch.zeros(batch_size, dtype=torch.bool, device=self.device)
        self.prompts: dict[int, _SlotPrompt] = {}
        self.prefix_cache: OrderedDict[tuple, Prefix] = OrderedDict()
        self.prefix_cache_size = prefix_cache_size
        self.stats = CoreStats()
        self.silence = torch.tensor(SILENCE_CODES, dtype=torch.long, device=self.device)
        self.sine = torch.tensor(SINE_CODES, dtype=torch.long, device=self.device)
        self._rows = torch.arange(batch_size, device=self.device)
        self._max_text_k = 25
        self._max_audio_k = 250
        # Host copies of each row's ring length (None: not tracked, after a stepwise prompt) and
        # of the live rows, so that a tick can attend only the filled part of the rings without
        # reading anything back from the device.
        self.attend_filled = attend_filled
        self._ends: list[int | None] = [0] * batch_size
        self._live_slots: set[int] = set()
        self._visible: int | None = None
        # One graph per (text top-k, audio top-k, visible ring slots) in use; eager on the CPU.
        self._graphed_live_tick = CudaGraphed(self._live_tick, "lockstep tick",
                                              enabled=cuda_graphs and self.device.type == "cuda")

    # ---- slots --------------------------------------------------------------------------------

    def recycle(self, slot: int) -> None:
        """Forget everything of `slot` (spec §H): its keys, staging ring and sampling knobs."""
        rows = self._rows == slot
        for cache in self.kv:
            cache.reset_rows(rows)
        self.ring.reset_rows(rows)
        self.live[slot] = False
        self._ends[slot] = 0
        self._live_slots.discard(slot)
        self.prompts.pop(slot, None)
        self.top_k_in_use.pop(slot, None)

    def set_sampling(self, slot: int, params: SamplingParams, seed: int) -> None:
        self.text_sampling.set_row(slot, params.text_temperature, params.text_top_k, params.greedy, seed)
        self.audio_sampling.set_row(slot, params.audio_temperature, params.audio_top_k, params.greedy, seed)
        # One top-k per stream for the whole batch (the largest in use); rows mask the rest.
        self.top_k_in_use[slot] = (params.text_top_k, params.audio_top_k)
        self._max_text_k = max(t for t, _ in self.top_k_in_use.values())
        self._max_audio_k = max(a for _, a in self.top_k_in_use.values())

    def start(self, slot: int, voice: VoiceTokens, persona: list[int], params: SamplingParams,
              seed: int, stepwise: bool = False) -> None:
        """Recycle `slot` and give it a new session. With `stepwise`, the system prompt is played
        one tick at a time by `step` (the reference's way); otherwise it is installed at once
        from a parallel forward, cached per (voice, persona)."""
        self.recycle(slot)
        self.set_sampling(slot, params, seed)
        if stepwise:
            self.prompts[slot] = _SlotPrompt(voice, deque(prompt_steps(voice.embeddings.shape[0], persona)))
            self._ends[slot] = None  # dead steps do not advance the ring; not worth mirroring
            return
        prefix = self.prefix(voice, persona)
        for cache, (k, v) in zip(self.kv, prefix.kv):
            cache.load_row(slot, k, v, prefix.length)
        self.ring.cache[slot] = prefix.cache.to(self.device)
        self.ring.provided[slot] = prefix.provided.to(self.device)
        self.ring.local[slot] = prefix.local
        self.live[slot] = True
        self._ends[slot] = prefix.length
        self._live_slots.add(slot)

    def end(self, slot: int) -> None:
        self.live[slot] = False
        self._live_slots.discard(slot)
        self.prompts.pop(slot, None)

    def visible_slots(self) -> int | None:
        """How many ring slots this tick must attend: the live rows' longest length after the
        tick's append, rounded up to VISIBLE_BUCKET (one CUDA graph per bucket); None for the
        whole ring (a row has wrapped, is not tracked, or the option is off)."""
        if not self.attend_filled:
            return None
        ends = [self._ends[s] for s in self._live_slots]
        if any(e is None for e in ends):
            return None
        need = max(ends, default=0) + 1
        visible = -(-need // VISIBLE_BUCKET) * VISIBLE_BUCKET
        return visible if visible < self.context else None

    def _advance_ends(self) -> None:
        for s in self._live_slots:
            end = self._ends[s]
            if end is not None:
                self._ends[s] = end + 1

    @property
    def prefilling(self) -> list[int]:
        return sorted(self.prompts)

    # ---- the system prompt as one parallel forward -----------------------------------------------

    def prefix(self, voice: VoiceTokens, persona: list[int]) -> Prefix:
        key = (voice.name, tuple(persona), self.dtype, self.context)
        hit = self.prefix_cache.get(key)
        if hit is not None:
            self.prefix_cache.move_to_end(key)
            self.stats.prefix_hits += 1
            return hit
        self.stats.prefix_misses += 1
        prefix = self.compute_prefix(voice, persona)
        self.prefix_cache[key] = prefix
        while len(self.prefix_cache) > self.prefix_cache_size:
            self.prefix_cache.popitem(last=False)
        return prefix

    @torch.no_grad()
    def compute_prefix(self, voice: VoiceTokens, persona: list[int]) -> Prefix:
        """The whole prompt is teacher-forced (every target token is provided), so the temporal
        inputs are known before the model runs: replay the staging ring alone to get them, then
        run one causal forward over all of them (spec §F, DESIGN §3)."""
        self.stats.prefills += 1
        ring = StagingRing(1, self.cfg.delays, "cpu")
        one = torch.ones(1, dtype=torch.bool)
        columns = []
        for step in prompt_steps(voice.embeddings.shape[0], persona):
            if step.restore:
                ring.cache[0] = voice.cache.cpu()
            values, mask = self._prompt_staging(step, "cpu")
            ring.stage(values.view(1, -1), mask.view(1, -1))
            ring.warm_up(one)
            if step.kind == "dead":
                ring.dead_step(one)
                continue
            inp, _, _ = ring.columns()
            if step.kind == "tokens":
                columns.append(inp[0])
            # Every target is provided during the prompt, so `chosen` is never written.
            ring.commit(torch.zeros(1, ring.K, dtype=torch.long), one)
            ring.advance(one)
        x_voice = voice.embeddings.to(self.device, self.dtype)  # [T, D]
        x_tokens = self.lm.embed_codes(torch.stack(columns).to(self.device))[:, 0] if columns else x_voice[:0]
        x = torch.cat([x_voice, x_tokens.to(self.dtype)], dim=0)[None]
        kv = self.lm.temporal_prefill(x, capacity=self.context)
        return Prefix(kv=kv, length=x.shape[1], cache=ring.cache[0].clone(), provided=ring.provided[0].clone(),
                      local=int(ring.local[0]))

    def _prompt_staging(self, step: PromptStep, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [17] a prompt step provides (all rows): voice steps give text PAD and initial
        audio tokens (the reference's `step_embeddings` dummies), token steps give the forced
        text, agent silence and user sine."""
        K = self.ring.K
        if step.kind in ("dead", "voice"):
            values = torch.tensor([TEXT_PAD] + [AUDIO_INITIAL] * (K - 1), dtype=torch.long)
        else:
            values = torch.tensor([step.index, *SILENCE_CODES, *SINE_CODES], dtype=torch.long)
        return values.to(device), torch.ones(K, dtype=torch.bool, device=device)

    # ---- one tick -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, user_codes: torch.Tensor) -> CoreStep:
        """One tick. user_codes [B, 8] for the live rows (others are ignored)."""
        user_codes = user_codes.to(self.device)
        if not self.prompts:  # the hot path: only live and idle rows
            self._visible = self.visible_slots()
            res = self._graphed_live_tick(user_codes, key=(self._max_text_k, self._max_audio_k, self._visible))
            self._advance_ends()
            return res
        # Stepwise system prompts (the reference's way; tests and diagnostics).
        B = self.B
        values, mask = self._user_staging(user_codes)
        dead = torch.zeros(B, dtype=torch.bool, device=self.device)
        prompt_rows = torch.zeros(B, dtype=torch.bool, device=self.device)
        override = torch.zeros(B, self.cfg.dim, dtype=self.dtype, device=self.device)
        use_override = torch.zeros(B, dtype=torch.bool, device=self.device)
        finished = []
        for slot, prompt in self.prompts.items():
            step = prompt.steps.popleft()
            if step.restore:
                self.ring.cache[slot] = prompt.voice.cache.to(self.device)
            values[slot], mask[slot] = self._prompt_staging(step, self.device)
            prompt_rows[slot] = True
            if step.kind == "dead":
                dead[slot] = True
            elif step.kind == "voice":
                override[slot] = prompt.voice.embeddings[step.index].to(self.device, self.dtype)
                use_override[slot] = True
            if not prompt.steps:
                finished.append(slot)
        res = self._tick(values, mask, self.live | prompt_rows, dead, override, use_override)
        self._advance_ends()
        for slot in finished:
            del self.prompts[slot]
            self.live[slot] = True
            self._live_slots.add(slot)
        return res

    def _user_staging(self, user_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.zeros(self.B, self.ring.K, dtype=torch.long, device=self.device)
        values[:, 9:] = user_codes
        mask = torch.zeros(self.B, self.ring.K, dtype=torch.bool, device=self.device)
        mask[:, 9:] = self.live.view(-1, 1)
        return values, mask

    def _live_tick(self, user_codes: torch.Tensor) -> CoreStep:
        values, mask = self._user_staging(user_codes)
        return self._tick(values, mask, self.live.clone(), None, None, None, self._visible)

    def _tick(self, values: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, dead: torch.Tensor | None,
              override: torch.Tensor | None, use_override: torch.Tensor | None,
              visible: int | None = None) -> CoreStep:
        """The lockstep algorithm of spec §E for every row at once: tensors in, tensors out,
        no host sync. `rows` step this tick; `dead` rows take the model-less offset-0 step;
        attention reads the first `visible` ring slots (all when None)."""
        live = self.live.clone()
        self.ring.stage(values, mask)
        self.ring.warm_up(rows)
        active = rows
        if dead is not None:
            self.ring.dead_step(dead)
            active = rows & ~dead
        inp, target, prov = self.ring.columns()
        x = self.lm.embed_codes(inp).to(self.dtype)
        if override is not None:
            x = torch.where(use_override.view(-1, 1, 1), override[:, None, :], x)
        h = self.lm.temporal_step(x, self.kv, active, visible)
        counter = self.ring.local
        text = sample(self.lm.text_logits(h), self.text_sampling, counter, 0, self._max_text_k)
        next_text = torch.where(prov[:, 0], target[:, 0], text)

        def choose(s: int, logits: torch.Tensor) -> torch.Tensor:
            return sample(logits, self.audio_sampling, counter, 1 + s, self._max_audio_k)

        audio = self.lm.depformer_frame(h, next_text, target[:, 1:1 + self.dep_steps],
                                        prov[:, 1:1 + self.dep_steps], self.dep_steps, choose)
        chosen = torch.cat([text[:, None], audio, target[:, 1 + self.dep_steps:]], dim=1)
        self.ring.commit(chosen, active)
        frame, emitted = self.ring.emitted()
        self.ring.advance(active)
        return CoreStep(frame, emitted & active, live)


_CONTROL = {c for c in range(32) if chr(c) not in "\n\t"} | set(range(127, 160))
MAX_PERSONA_CHARS = 4000


def persona_token_ids(tokenizer, persona: str, max_tokens: int = MAX_PERSONA_TOKENS) -> list[int]:
    """Token ids of the persona's system prompt; raises a CallerError when it is unusable."""
    if not isinstance(persona, str):
        raise CallerError("the persona must be text")
    if len(persona) > MAX_PERSONA_CHARS:
        raise PersonaTooLongError(f"the persona is {len(persona)} characters long; the limit is "
                                  f"{MAX_PERSONA_CHARS} characters ({max_tokens} tokens)")
    persona = persona.replace("\r\n", "\n").replace("\r", "\n")
    bad = sorted({f"U+{ord(c):04X}" for c in persona if ord(c) in _CONTROL})
    if bad:
        raise CallerError(f"the persona contains control characters ({', '.join(bad[:5])}); "
                          "use plain text, newlines and tabs only")
    ids = tokenizer.encode_persona(persona)
    if len(ids) > max_tokens:
        raise PersonaTooLongError(f"the persona is {len(ids)} tokens long with its <system> tags; the limit "
                                  f"is {max_tokens} tokens")
    return ids


@dataclass
class EngineStats:
    sanitized_frames: int = 0  # frames with NaN/inf or out-of-range samples that were cleaned


class LockstepEngine:
    """B conversations of PCM in, PCM and transcript out, one 80 ms frame per `step`.

    Only the engine thread may call `start_session`, `end_session` and `step`;
    `validate_request` and `persona_tokens` are safe from any thread.
    """

    frame_size = 1920
    sample_rate = 24000

    def __init__(self, lm: PersonaPlexLM, mimi, tokenizer, voices, batch_size: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 max_persona_tokens: int = MAX_PERSONA_TOKENS, prefix_cache_size: int = 8,
                 context: int | None = None, stepwise_prefill: bool = False, cuda_graphs: bool = True):
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.core = LockstepCore(lm, batch_size, self.device, dtype, prefix_cache_size=prefix_cache_size,
                                 context=context, cuda_graphs=cuda_graphs)
        self.mimi = mimi
        self.mimi_state = mimi.init_state(batch_size, device=self.device)
        graphs = cuda_graphs and self.device.type == "cuda"
        self._encode = CudaGraphed(lambda pcm: mimi.encode_step(pcm, self.mimi_state), "mimi encode", graphs)
        self._decode = CudaGraphed(lambda codes: mimi.decode_step(codes, self.mimi_state), "mimi decode", graphs)
        self.tokenizer = tokenizer
        self.voices = voices
        self.max_persona_tokens = max_persona_tokens
        self.stepwise_prefill = stepwise_prefill
        self.stats = EngineStats()
        self._transcripts = [tokenizer.transcript_decoder(lm.cfg.text_card) for _ in range(batch_size)]
        # Rows whose codec state must start fresh when their conversation begins.
        self._codec_reset = torch.zeros(batch_size, dtype=torch.bool, device=self.device)
        self._silence = torch.tensor(SILENCE_CODES, dtype=torch.long, device=self.device)

    @property
    def voice_names(self) -> list[str]:
        return list(self.voices.names)

    # ---- requests (any thread) ------------------------------------------------------------------

    def persona_tokens(self, persona: str) -> list[int]:
        """Token ids of the persona's system prompt; raises a CallerError when it is unusable."""
        return persona_token_ids(self.tokenizer, persona, self.max_persona_tokens)

    def validate_request(self, voice: str, persona: str, sampling: SamplingParams) -> None:
        self.voices.check_name(voice)
        self.persona_tokens(persona)
        sampling.validate()

    # ---- engine thread --------------------------------------------------------------------------

    def start_session(self, slot: int, voice: str, persona: str, sampling: SamplingParams) -> None:
        ids = self.persona_tokens(persona)
        sampling.validate()
        prompt = self.voices.load(voice, self.dtype, self.device, dim=self.core.cfg.dim)
        tokens = VoiceTokens(prompt.name, prompt.embeddings.reshape(prompt.length, -1), prompt.cache[0])
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.core.start(slot, tokens, ids, sampling, seed, stepwise=self.stepwise_prefill)
        self._transcripts[slot].reset()
        self._codec_reset[slot] = True
        log.debug("slot %d: session started (voice %s, %d persona tokens)", slot, voice, len(ids))

    def end_session(self, slot: int) -> str:
        """Stop `slot`; returns any transcript text still held back."""
        self.core.end(slot)
        return self._transcripts[slot].flush()

    def sanitize(self, pcm: np.ndarray) -> np.ndarray:
        """float32 [B, 1920]; NaN/inf become 0 and samples are clipped to [-1, 1] (counted)."""
        pcm = np.asarray(pcm)
        if pcm.shape != (self.batch_size, self.frame_size):
            raise AudioFormatError(f"expected PCM of shape ({self.batch_size}, {self.frame_size}) at "
                                   f"{self.sample_rate} Hz, got {tuple(pcm.shape)}")
        if pcm.dtype == np.int16:
            pcm = pcm.astype(np.float32) / 32768.0
        pcm = pcm.astype(np.float32, copy=False)
        bad = ~np.isfinite(pcm) | (np.abs(pcm) > 1.0)
        if bad.any():
            self.stats.sanitized_frames += int(bad.any(axis=1).sum())
            pcm = np.clip(np.nan_to_num(pcm, nan=0.0, posinf=0.0, neginf=0.0), -1.0, 1.0)
        return pcm

    @torch.no_grad()
    def step(self, pcm: np.ndarray) -> TickOutput:
        pcm_t = torch.from_numpy(self.sanitize(pcm)).to(self.device)
        # A new caller's codec starts fresh, as the reference resets Mimi after the prompt.
        fresh = self._codec_reset & self.core.live
        self.mimi.reset_rows(self.mimi_state, fresh)
        self._codec_reset &= ~fresh
        codes = self._encode(pcm_t)
        res = self.core.step(codes)
        audio = res.frame[:, 1:9]
        speak = res.live & res.emitted
        # Mimi has no code 2048 (the initial token): silence for warm-up and hidden rows.
        audio = torch.where(speak.view(-1, 1) & (audio < AUDIO_INITIAL), audio, self._silence.view(1, -1))
        out = self._decode(audio)
        # Clipped here because the int16 conversion downstream (fastrtc's) wraps values past full
        # scale into loud clicks instead of saturating.
        out = torch.where(res.live.view(-1, 1), out.float().clamp(-1.0, 1.0), torch.zeros((), device=out.device))
        # One host transfer per tick: the PCM, the text ids and the masks together.
        text_ids = torch.where(speak, res.frame[:, 0], torch.full_like(res.frame[:, 0], TEXT_PAD))
        out_np = out.cpu().numpy()
        frame = torch.cat([text_ids[:, None], res.frame[:, 1:], speak[:, None].long()], dim=1).cpu().numpy()
        texts = [self._transcripts[b].push(i) if i != TEXT_PAD else "" for b, i in enumerate(frame[:, 0].tolist())]
        return TickOutput(out_np, texts, frame[:, :17], frame[:, 17].astype(bool))
