"""The system prompt played one tick at a time, as the reference plays it: the oracle that the
parallel prefill is checked against (docs/engine.md § System prompt and prefill).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from personaplex_demo.call_settings import SamplingParams
from personaplex_demo.engine.core import CoreStep, LockstepCore
from personaplex_demo.engine.prompt import PromptStep, VoiceTokens, prompt_steps, prompt_tokens


@dataclass
class _Prompt:
    voice: VoiceTokens
    steps: deque[PromptStep]


class StepwiseCore(LockstepCore):
    """A `LockstepCore` whose `start` queues the system prompt for the next ticks to play; the
    row goes live after its last prompt step. Ticks with a prompt in flight run eagerly and
    attend the whole ring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts: dict[int, _Prompt] = {}

    def batch_buckets(self) -> list[int]:
        # A prompt in flight is stepped by row, in the whole batch: one bucket, so rows never move.
        return [self.B]

    def recycle(self, slot: int) -> None:
        super().recycle(slot)
        self.prompts.pop(slot, None)

    def start(self, slot: int, voice: VoiceTokens, persona: list[int], params: SamplingParams,
              seed: int) -> None:
        self.recycle(slot)
        self.set_sampling(slot, params, seed)
        self.prompts[slot] = _Prompt(voice, deque(prompt_steps(voice.embeddings.shape[0], persona)))
        self.rows[slot].length = None  # the dead step does not write a key: not worth tracking

    def end(self, slot: int) -> None:
        super().end(slot)
        self.prompts.pop(slot, None)

    @torch.no_grad()
    def step(self, user_codes: torch.Tensor) -> CoreStep:
        if not self.prompts:
            return super().step(user_codes)
        st, B = self.state, self.B
        values, mask = self._user_staging(user_codes.to(self.device), st)
        rows = st.live.clone()
        dead = torch.zeros(B, dtype=torch.bool, device=self.device)
        embeddings = torch.zeros(B, self.cfg.dim, dtype=self.dtype, device=self.device)
        use = torch.zeros(B, dtype=torch.bool, device=self.device)
        finished = []
        for slot, prompt in self.prompts.items():
            step = prompt.steps.popleft()
            if step.restore:
                st.ring.cache[slot] = prompt.voice.cache.to(self.device)
            values[slot], mask[slot] = prompt_tokens(step, st.ring.K, self.device)
            if step.kind == "dead":
                dead[slot] = True
            else:
                rows[slot] = True
            if step.kind == "voice":
                embeddings[slot] = prompt.voice.embeddings[step.index].to(self.device, self.dtype)
                use[slot] = True
            if not prompt.steps:
                finished.append(slot)
        # The reference's model-less first step, on the staging ring alone.
        st.ring.stage(values, mask & dead.view(-1, 1))
        st.ring.warm_up(dead)
        st.ring.dead_step(dead)
        live = st.live.clone()
        h, target, prov = self._listen(st, values, mask & ~dead.view(-1, 1), rows, (embeddings, use))
        res = self._speak(h, target, prov, rows, live)
        self._count_step()
        for slot in finished:
            del self.prompts[slot]
            self.set_live(slot, True)
        return res
