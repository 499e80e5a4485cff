"""The PCM engine: `LockstepCore` with Mimi, voices, the tokenizer and the transcript; what the
SlotPool drives (docs/engine.md). The pool speaks of slots, the core of rows (engine/rows.py).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..call_settings import MAX_PERSONA_TOKENS, SamplingParams, persona_token_ids
from ..errors import AudioFormatError
from ..frame import FRAME_SAMPLES, SAMPLE_RATE
from ..model.lm import PersonaPlexLM
from .core import LockstepCore
from .cuda_graphs import CudaGraphed
from .prompt import VoiceTokens
from .rows import RowPlaces, batch_bucket
from .tokens import AGENT_ROWS, AUDIO_INITIAL, SILENCE_CODES, TEXT_PAD

log = logging.getLogger(__name__)

@dataclass
class TickOutput:
    """One tick's output by slot."""

    pcm: np.ndarray  # float32 [B, 1920]: agent audio; zeros for slots that are not live
    text: list[str]  # per slot: transcript text that became final this tick ("" if none)
    tokens: np.ndarray | None = None  # int64 [B, 17]: the emitted frame (text, agent, user codes)
    live: np.ndarray | None = None  # bool [B]: slots whose output is a real conversation frame
    rows: int | None = None  # the batch the tick stepped (its bucket); None: every slot


class LockstepEngine:
    """B conversations of PCM in, PCM and transcript out, one 80 ms frame per `step`. Only the engine
    thread may call `start_session`, `end_session` and `step`; the request checks are thread-safe."""

    frame_size = FRAME_SAMPLES
    sample_rate = SAMPLE_RATE

    def __init__(self, lm: PersonaPlexLM, mimi, tokenizer, voices, batch_size: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 max_persona_tokens: int = MAX_PERSONA_TOKENS, context: int | None = None,
                 cuda_graphs: bool = True, core_class: type[LockstepCore] = LockstepCore):
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        # `core_class`: stepwise.StepwiseCore plays the prompt tick by tick, as the reference does.
        self.core = core_class(lm, batch_size, self.device, dtype, context=context, cuda_graphs=cuda_graphs)
        self.mimi = mimi
        self.mimi_state = mimi.init_state(batch_size, device=self.device)
        self.places = RowPlaces(batch_size)  # slot <-> row
        # Each batch bucket's first rows of the codec state: a tick of n rows encodes and decodes n.
        self._mimi_heads = {n: self.mimi_state.head(n) for n in self.core.buckets}
        graphs = cuda_graphs and self.device.type == "cuda"
        self._encode = CudaGraphed(lambda pcm: mimi.encode_step(pcm, self._mimi_heads[pcm.shape[0]]),
                                   "mimi encode", graphs)
        self._decode = CudaGraphed(lambda codes: mimi.decode_step(codes, self._mimi_heads[codes.shape[0]]),
                                   "mimi decode", graphs)
        self.tokenizer = tokenizer
        self.voices = voices
        self.max_persona_tokens = max_persona_tokens
        self.sanitized_frames = 0  # frames with NaN/inf or out-of-range samples that were cleaned
        self._transcripts = [tokenizer.transcript_decoder(lm.cfg.text_card) for _ in range(batch_size)]
        # Slots whose codec state must start fresh when their conversation begins.
        self._codec_reset: set[int] = set()
        self._silence = torch.tensor(SILENCE_CODES, dtype=torch.long, device=self.device)
        self._pinned: torch.Tensor | None = None  # the host side of the tick's one transfer (CUDA)
        self._persona_ids = functools.lru_cache(maxsize=64)(
            lambda persona: tuple(persona_token_ids(tokenizer, persona, max_persona_tokens)))

    @property
    def graphed(self) -> list[CudaGraphed]:
        """Every CUDA-graph wrapper of a tick: the LM's, then Mimi's encode and decode."""
        return [*self.core.graphed, self._encode, self._decode]

    def _to_host(self, packed: torch.Tensor) -> np.ndarray:
        """A copy of `packed` on the host: on CUDA through a pinned buffer, with one wait."""
        if packed.device.type != "cuda":
            return packed.numpy()
        if self._pinned is None or self._pinned.shape != packed.shape:
            self._pinned = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._pinned.copy_(packed, non_blocking=True)
        torch.cuda.current_stream(packed.device).synchronize()
        return self._pinned.numpy().copy()

    @torch.no_grad()
    def capture_graphs(self) -> int:
        """Capture every CUDA graph a tick can need, before the first caller (before the ticker
        starts, no session started yet). Mimi's state moves on by a frame; a row's codec is reset
        when its conversation begins. Returns the number of graphs held (0 where graphs are off)."""
        if not any(g.enabled for g in self.graphed):
            return 0
        held = self.core.capture_graphs()
        for n in self.core.buckets:
            self._encode.capture(torch.zeros(n, self.frame_size, device=self.device))
            self._decode.capture(self._silence.view(1, -1).expand(n, -1).contiguous())
        return held + self._encode.captured + self._decode.captured

    def bucket(self, rows: int) -> int:
        """The batch a tick of `rows` conversations steps."""
        return batch_bucket(rows, self.core.buckets)

    @property
    def voice_names(self) -> list[str]:
        return list(self.voices.names)

    # ---- requests (any thread) ------------------------------------------------------------------

    def persona_tokens(self, persona: str) -> list[int]:
        """Token ids of the persona's system prompt; raises a CallerError when it is unusable.
        The ids of recent personas are kept: the ticker asks for them in every gap while a
        caller waits (`prefix_cached`), and again at the start."""
        if not isinstance(persona, str):
            return persona_token_ids(self.tokenizer, persona, self.max_persona_tokens)
        return list(self._persona_ids(persona))

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
        row = self.places.take(slot)
        try:
            self.core.start(row, tokens, ids, sampling, seed)
        except BaseException:
            self.places.free(slot)
            raise
        self._transcripts[slot].reset()
        self._codec_reset.add(slot)
        log.debug("slot %d: session started on row %d (voice %s, %d persona tokens)", slot, row, voice, len(ids))

    def prefix_cached(self, voice: str, persona: str) -> bool:
        """Whether a session of (voice, persona) would start from the prefix cache, without a
        forward over its prompt."""
        return self.core.prefixes.has(voice, self.persona_tokens(persona))

    def end_session(self, slot: int) -> str:
        """Stop `slot`; returns any transcript text still held back."""
        row = self.places.free(slot)
        if row is not None:
            self.core.end(row)
        self._codec_reset.discard(slot)
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
            self.sanitized_frames += int(bad.any(axis=1).sum())
            pcm = np.clip(np.nan_to_num(pcm, nan=0.0, posinf=0.0, neginf=0.0), -1.0, 1.0)
        return pcm

    @torch.no_grad()
    def step(self, pcm: np.ndarray) -> TickOutput:
        """One 80 ms tick: pcm [B, 1920] by slot in, the output by slot."""
        pcm = self.sanitize(pcm)
        for src, dst in self.places.compaction(self.core.buckets):
            self.core.move(src, dst)
            self.mimi_state.move_row(src, dst)
        n = batch_bucket(self.places.top, self.core.buckets)
        slots = self.places.slots_in(n)
        held = slots >= 0
        rows_pcm = np.zeros((n, self.frame_size), dtype=np.float32)
        rows_pcm[held] = pcm[slots[held]]
        out, ids = self._step_rows(torch.from_numpy(rows_pcm).to(self.device))
        host = self._to_host(torch.cat([out, ids.float()], dim=1))
        by_slot = np.zeros((self.batch_size, host.shape[1]), dtype=np.float32)
        by_slot[slots[held]] = host[held]
        out_np, frame = np.ascontiguousarray(by_slot[:, :self.frame_size]), by_slot[:, self.frame_size:].astype(np.int64)
        # A slot without a row has zeros here, and no word: only a row that spoke has text.
        texts = [self._transcripts[b].push(i) if spoke and i != TEXT_PAD else ""
                 for b, (i, spoke) in enumerate(zip(frame[:, 0].tolist(), frame[:, 17].tolist()))]
        return TickOutput(out_np, texts, frame[:, :17], frame[:, 17].astype(bool), rows=n)

    def _step_rows(self, pcm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first len(pcm) rows through Mimi and the LM: (agent audio [n, 1920], and the
        text id, the rest of the frame and whether the row spoke [n, 18])."""
        # A new caller's codec starts fresh, as the reference resets Mimi after the prompt.
        fresh = [row for s in self._codec_reset if (row := self.places.row_of[s]) is not None and self.core.is_live(row)]
        if fresh:
            self.mimi.reset_rows(self.mimi_state, fresh)
            self._codec_reset.difference_update(self.places.slot_at[row] for row in fresh)
        codes = self._encode(pcm)
        res = self.core.step(codes)
        audio = res.frame[:, AGENT_ROWS]
        speak = res.live & res.emitted
        # Mimi has no code 2048 (the initial token): silence for warm-up and hidden rows.
        audio = torch.where(speak.view(-1, 1) & (audio < AUDIO_INITIAL), audio, self._silence.view(1, -1))
        out = self._decode(audio)
        # Clipped here because the int16 conversion downstream (fastrtc's) wraps values past full
        # scale into loud clicks instead of saturating.
        out = torch.where(res.live.view(-1, 1), out.float().clamp(-1.0, 1.0), torch.zeros((), device=out.device))
        text_ids = torch.where(speak, res.frame[:, 0], torch.full_like(res.frame[:, 0], TEXT_PAD))
        # One host transfer per tick: the PCM, then the tokens and the mask as floats (every id is
        # below 2^24, so exact), in one block.
        return out, torch.cat([text_ids[:, None], res.frame[:, 1:], speak[:, None].long()], dim=1)
