"""The PersonaPlex LM: input embeddings, the temporal transformer and the depformer
(spec §B, §C). Module names reproduce the official `model.safetensors` keys (spec §A.1).

Two entry points run the temporal transformer:
- `temporal_step`: one frame for every batch row, against per-row ring KV caches;
- `temporal_prefill`: a parallel causal forward over a whole teacher-forced prompt of one row,
  whose keys and values can be installed into a row's ring (`RingKV.load_row`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import LMConfig
from .transformer import (
    Attention,
    RingKV,
    RMSNorm,
    SwiGLU,
    prefill_attention_mask,
    rope_angles,
    rotate,
    step_attention_mask,
)


class ZeroableEmbedding(nn.Embedding):
    """NVIDIA's `ScaledEmbedding`: id -1 gives an exact zero vector, other ids are clamped >= 0."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = super().forward(ids.clamp(min=0))
        return torch.where((ids == -1)[..., None], torch.zeros((), dtype=y.dtype, device=y.device), y)


class TemporalLayer(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg.dim, cfg.num_heads)
        self.norm2 = RMSNorm(cfg.dim, cfg.norm_eps)
        self.gating = SwiGLU(cfg.dim, cfg.hidden)


class DepformerLayer(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.depformer_dim, cfg.norm_eps)
        self.self_attn = Attention(cfg.depformer_dim, cfg.depformer_num_heads, steps=cfg.dep_q)
        self.norm2 = RMSNorm(cfg.depformer_dim, cfg.norm_eps)
        self.gating = nn.ModuleList(SwiGLU(cfg.depformer_dim, cfg.depformer_hidden) for _ in range(cfg.dep_q))


class Stack(nn.Module):
    """Holds `layers` so that keys read `transformer.layers.N...` as in the checkpoint."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)


def depformer_step_mask(steps: int, device: torch.device | str) -> torch.Tensor:
    """[steps, steps] bool: which of the frame's step slots step s may attend to.

    The reference keeps the depformer's keys in a ring of capacity `steps` with the same
    `delta <= 0` rule as the temporal ring, so step s sees slots 0..s except that the last step
    cannot see slot 0 (it only produces user cb7, which is always replaced; kept for parity).
    """
    mask = torch.zeros(steps, steps, dtype=torch.bool, device=device)
    idx = torch.arange(steps, device=device)
    for s in range(steps):
        end = s + 1
        delta = idx - end % steps
        pos = torch.where(delta <= 0, end + delta, end + delta - steps)
        pos = torch.where(idx >= end, torch.full_like(pos, -1), pos)
        mask[s] = (pos >= 0) & (s - pos >= 0)
    return mask


class PersonaPlexLM(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        D, Dd = cfg.dim, cfg.depformer_dim
        self.emb = nn.ModuleList(ZeroableEmbedding(cfg.card + 1, D) for _ in range(cfg.n_q))
        self.text_emb = ZeroableEmbedding(cfg.text_card + 1, D)
        self.transformer = Stack([TemporalLayer(cfg) for _ in range(cfg.num_layers)])
        self.out_norm = RMSNorm(D, cfg.norm_eps)
        self.text_linear = nn.Linear(D, cfg.text_card, bias=False)
        self.depformer_in = nn.ModuleList(nn.Linear(D, Dd, bias=False) for _ in range(cfg.dep_q))
        self.depformer_text_emb = ZeroableEmbedding(cfg.text_card + 1, Dd)
        self.depformer_emb = nn.ModuleList(ZeroableEmbedding(cfg.card + 1, Dd) for _ in range(cfg.dep_q - 1))
        self.depformer = Stack([DepformerLayer(cfg) for _ in range(cfg.depformer_num_layers)])
        self.linears = nn.ModuleList(nn.Linear(Dd, cfg.card, bias=False) for _ in range(cfg.dep_q))
        self._step_masks: dict[torch.device, torch.Tensor] = {}

    # ---- inputs -------------------------------------------------------------------------------

    def embed_codes(self, column: torch.Tensor) -> torch.Tensor:
        """column [B, 17] token ids -> [B, 1, D]: audio rows 0..15 summed first, then text.

        The order matters in bf16 (spec §J.1)."""
        x = None
        for i, table in enumerate(self.emb):
            e = table(column[:, 1 + i])
            x = e if x is None else x + e
        x = x + self.text_emb(column[:, 0])
        return x[:, None, :]

    # ---- temporal transformer -----------------------------------------------------------------

    def new_kv(self, batch: int, device: torch.device | str, dtype: torch.dtype,
               capacity: int | None = None) -> list[RingKV]:
        cfg = self.cfg
        cap = capacity or cfg.context
        return [RingKV.empty(batch, cfg.num_heads, cap, cfg.head_dim, device, dtype) for _ in range(cfg.num_layers)]

    def temporal_step(self, x: torch.Tensor, kv: list[RingKV], active: torch.Tensor,
                      visible: int | None = None) -> torch.Tensor:
        """x [B, 1, D] -> out_norm(h) [B, 1, D]. Rows with `active` false write no key and do
        not advance; their output is meaningless.

        `visible`: attend only the first `visible` ring slots. Exact when no active row has
        wrapped and each holds at most `visible` keys after this step's append (the caller
        knows the rows' lengths on the host); None attends the whole ring."""
        cfg = self.cfg
        L = kv[0].capacity if visible is None else min(visible, kv[0].capacity)
        pos = kv[0].end.clone()  # each row's next stream position (the dead step never advances it)
        angles = rope_angles(pos.view(-1, 1), cfg.head_dim, cfg.max_period)
        mask = None
        for layer, cache in zip(self.transformer.layers, kv):
            h = layer.norm1(x)
            q, k, v = layer.self_attn.qkv(h)
            q, k = rotate(q, angles), rotate(k, angles)
            cache.append(k, v, active)
            if mask is None:
                # Every layer's ring is written, reset and loaded together, so all hold the same
                # positions after this append: one mask serves the whole tick.
                mask = step_attention_mask(cache, pos, cfg.context, L)
                # A row with nothing visible (inactive, empty) would give NaN; let it see slot 0.
                mask = mask | (~mask.any(dim=-1, keepdim=True) & (torch.arange(mask.shape[-1], device=x.device) == 0))
            a = F.scaled_dot_product_attention(q, cache.keys[:, :, :L], cache.values[:, :, :L], mask)
            x = x + layer.self_attn.project_out(a)
            x = x + layer.gating(layer.norm2(x))
        return self.out_norm(x)

    def temporal_prefill(self, x: torch.Tensor, capacity: int | None = None
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Parallel causal forward of one row's prompt, x [1, L, D], from a fresh stream.

        Returns the (rotated) keys and values of every layer, [H, L, Dh] each, equal to what
        L single steps would have written into a ring of `capacity` (default: the context)."""
        cfg = self.cfg
        L = x.shape[1]
        cap = capacity or cfg.context
        positions = torch.arange(L, device=x.device).view(1, L)
        angles = rope_angles(positions, cfg.head_dim, cfg.max_period)
        mask = prefill_attention_mask(L, cap, cfg.context, x.device)
        kvs = []
        for layer in self.transformer.layers:
            h = layer.norm1(x)
            q, k, v = layer.self_attn.qkv(h)
            q, k = rotate(q, angles), rotate(k, angles)
            kvs.append((k[0], v[0]))
            a = F.scaled_dot_product_attention(q, k, v, mask)
            x = x + layer.self_attn.project_out(a)
            x = x + layer.gating(layer.norm2(x))
        return kvs

    def text_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, 1, D] -> fp32 logits [B, text_card]."""
        return self.text_linear(h[:, 0]).float()

    # ---- depformer ----------------------------------------------------------------------------

    def depformer_frame(self, h: torch.Tensor, text_token: torch.Tensor, forced: torch.Tensor,
                        forced_mask: torch.Tensor, steps: int, choose) -> torch.Tensor:
        """Run depformer steps 0..steps-1 for one frame (spec §C).

        h [B, 1, D] post-norm temporal output; text_token [B] (step 0's input); forced [B, steps]
        and forced_mask [B, steps]: teacher forcing of each step's token as the NEXT step's
        input; `choose(step, logits [B, card] fp32) -> tokens [B]` samples or takes the argmax.
        Returns the chosen (not forced) tokens [B, steps].
        """
        cfg = self.cfg
        B = h.shape[0]
        n = cfg.dep_q
        mask_table = self._step_masks.get(h.device)
        if mask_table is None:
            mask_table = self._step_masks[h.device] = depformer_step_mask(n, h.device)
        H, Dh = cfg.depformer_num_heads, cfg.depformer_dim // cfg.depformer_num_heads
        # Keys of every step of this frame, in a buffer of dep_q slots, as in the reference: the
        # full buffer with a boolean mask keeps bf16 rounding identical to it (spec §C).
        caches = [(h.new_zeros(B, H, n, Dh), h.new_zeros(B, H, n, Dh)) for _ in self.depformer.layers]
        prev = text_token
        out = []
        for s in range(steps):
            e = self.depformer_text_emb(prev) if s == 0 else self.depformer_emb[s - 1](prev)
            x = self.depformer_in[s](h) + e[:, None, :]
            for layer, (ck, cv) in zip(self.depformer.layers, caches):
                a_in = layer.norm1(x)
                q, k, v = layer.self_attn.qkv(a_in, step=s)
                ck[:, :, s] = k[:, :, 0]
                cv[:, :, s] = v[:, :, 0]
                a = F.scaled_dot_product_attention(q, ck, cv, mask_table[s].view(1, 1, 1, n))
                x = x + layer.self_attn.project_out(a, step=s)
                x = x + layer.gating[s](layer.norm2(x))
            logits = self.linears[s](x[:, 0]).float()
            tok = choose(s, logits)
            out.append(tok)
            prev = torch.where(forced_mask[:, s], forced[:, s], tok)
        return torch.stack(out, dim=1)
