"""The system prompt: its steps, and the whole prompt as one parallel forward, cached per
(voice, persona) (docs/engine.md § System prompt and prefill).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..model.lm import PersonaPlexLM
from .staging import StagingRing
from .tokens import AUDIO_INITIAL, SILENCE_CODES, SILENCE_FRAMES, SINE_CODES, TEXT_PAD

PREFIX_CACHE_SIZE = 8  # system prompts kept; `--slots auto` reserves memory for this many


@dataclass(frozen=True)
class VoiceTokens:
    """A voice prompt as the lockstep needs it: embeddings [T, D] and the saved ring [17, CT]."""

    name: str
    embeddings: torch.Tensor
    cache: torch.Tensor


@dataclass(frozen=True)
class PromptStep:
    kind: str  # "dead" | "voice" | "tokens"
    index: int = 0  # voice embedding index, or forced text id for "tokens"
    restore: bool = False  # restore the voice's saved ring before this step


def prompt_steps(voice_len: int, persona: list[int]) -> list[PromptStep]:
    """The system prompt, one entry per tick: dead, voice, silence, persona, silence."""
    steps = [PromptStep("dead")] + [PromptStep("voice", t) for t in range(voice_len)]
    texts = [TEXT_PAD] * SILENCE_FRAMES + list(persona) + [TEXT_PAD] * SILENCE_FRAMES
    steps += [PromptStep("tokens", t, restore=(i == 0)) for i, t in enumerate(texts)]
    return steps


def prompt_tokens(step: PromptStep, rows: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [rows] a prompt step provides (all of them): voice steps give text PAD and initial
    audio tokens (the reference's placeholders), token steps give the forced text, agent
    silence and user sine."""
    if step.kind in ("dead", "voice"):
        values = torch.tensor([TEXT_PAD] + [AUDIO_INITIAL] * (rows - 1), dtype=torch.long)
    else:
        values = torch.tensor([step.index, *SILENCE_CODES, *SINE_CODES], dtype=torch.long)
    return values.to(device), torch.ones(rows, dtype=torch.bool, device=device)


@dataclass
class Prefix:
    """A row's state right after its system prompt, ready to install into any row."""

    kv: torch.Tensor  # keys and values of every layer [layers, 2, H, L, Dh]
    length: int  # temporal steps taken (L)
    cache: torch.Tensor  # [17, CT]
    provided: torch.Tensor  # [17, CT]
    local: int  # L + 1: the dead step counts as an offset but not as a temporal step


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    prefills: int = 0


class PrefixCache:
    """System prompts computed by one parallel forward, the most recent `size` kept."""

    def __init__(self, lm: PersonaPlexLM, dtype: torch.dtype, context: int, device: torch.device,
                 size: int = PREFIX_CACHE_SIZE):
        self.lm = lm
        self.dtype = dtype
        self.context = context
        self.device = device
        self.size = size
        self.entries: OrderedDict[tuple, Prefix] = OrderedDict()
        self.stats = PrefixStats()

    def _key(self, voice_name: str, persona: list[int]) -> tuple:
        return voice_name, tuple(persona), self.dtype, self.context

    def has(self, voice_name: str, persona: list[int]) -> bool:
        return self._key(voice_name, persona) in self.entries

    def get(self, voice: VoiceTokens, persona: list[int]) -> Prefix:
        key = self._key(voice.name, persona)
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            self.stats.hits += 1
            return hit
        self.stats.misses += 1
        prefix = self.compute(voice, persona)
        self.entries[key] = prefix
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return prefix

    @torch.no_grad()
    def compute(self, voice: VoiceTokens, persona: list[int]) -> Prefix:
        """The whole prompt is teacher-forced (every target token is provided), so the temporal
        inputs are known before the model runs: replay the staging ring alone to get them, then
        run one causal forward over all of them."""
        self.stats.prefills += 1
        ring = StagingRing(1, self.lm.cfg.delays, "cpu")
        one = torch.ones(1, dtype=torch.bool)
        columns = []
        for step in prompt_steps(voice.embeddings.shape[0], persona):
            if step.restore:
                ring.cache[0] = voice.cache.cpu()
            values, mask = prompt_tokens(step, ring.K, "cpu")
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
