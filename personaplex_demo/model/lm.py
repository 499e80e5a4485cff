"""The PersonaPlex LM: input embeddings, the temporal transformer and the depformer
(docs/model.md § The LM). Module names reproduce the official `model.safetensors` keys.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import LMConfig
from .ring import Attend, RingKV, additive, prefill_mask, ring_mask
from .transformer import Attention, RMSNorm, SwiGLU, Transformer, TransformerLayer


class ZeroableEmbedding(nn.Embedding):
    """NVIDIA's `ScaledEmbedding`: id -1 gives an exact zero vector, other ids are clamped >= 0."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids.clamp(min=0), (ids == -1)[..., None])

    def lookup(self, clamped: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """`forward` with the clamp and the -1 test already done (`zero`: [..., 1] bool), for a
        caller that does them once for several tables."""
        return F.embedding(clamped, self.weight).masked_fill_(zero, 0.0)


class LMLayer(TransformerLayer):
    """A layer of the temporal transformer, or with `steps` > 0 of the depformer (per-step
    attention and feed-forward weights, shared norms): RMSNorm, SwiGLU, no layer scale."""

    def __init__(self, dim: int, num_heads: int, hidden: int, eps: float, steps: int = 0):
        super().__init__()
        self.norm1 = RMSNorm(dim, eps)
        self.self_attn = Attention(dim, num_heads, steps)
        self.norm2 = RMSNorm(dim, eps)
        self.gating = (SwiGLU(dim, hidden) if steps == 0 else
                       nn.ModuleList(SwiGLU(dim, hidden) for _ in range(steps)))
        self.layer_scale_1 = self.layer_scale_2 = nn.Identity()

    def feed_forward(self, x: torch.Tensor, step: int | None) -> torch.Tensor:
        return self.gating(x) if step is None else self.gating[step](x)


class PersonaPlexLM(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        D, Dd = cfg.dim, cfg.depformer_dim
        self.emb = nn.ModuleList(ZeroableEmbedding(cfg.card + 1, D) for _ in range(cfg.n_q))
        self.text_emb = ZeroableEmbedding(cfg.text_card + 1, D)
        self.transformer = Transformer([LMLayer(D, cfg.num_heads, cfg.hidden, cfg.norm_eps)
                                        for _ in range(cfg.num_layers)], cfg.head_dim, cfg.max_period)
        self.out_norm = RMSNorm(D, cfg.norm_eps)
        self.text_linear = nn.Linear(D, cfg.text_card, bias=False)
        self.depformer_in = nn.ModuleList(nn.Linear(D, Dd, bias=False) for _ in range(cfg.dep_q))
        self.depformer_text_emb = ZeroableEmbedding(cfg.text_card + 1, Dd)
        self.depformer_emb = nn.ModuleList(ZeroableEmbedding(cfg.card + 1, Dd) for _ in range(cfg.dep_q - 1))
        self.depformer = Transformer([LMLayer(Dd, cfg.depformer_num_heads, cfg.depformer_hidden, cfg.norm_eps,
                                              steps=cfg.dep_q) for _ in range(cfg.depformer_num_layers)],
                                     Dd // cfg.depformer_num_heads, None)
        self.linears = nn.ModuleList(nn.Linear(Dd, cfg.card, bias=False) for _ in range(cfg.dep_q))
        self._step_masks: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    # ---- inputs -------------------------------------------------------------------------------

    def embed_codes(self, column: torch.Tensor) -> torch.Tensor:
        """column [B, 17] token ids -> [B, 1, D]: audio rows 0..15 summed first, then text (the
        order matters in bf16, docs/model.md § The LM)."""
        ids, zero = column.clamp(min=0), (column == -1)[..., None]
        x = None
        for i, table in enumerate(self.emb):
            e = table.lookup(ids[:, 1 + i], zero[:, 1 + i])
            x = e if x is None else x + e
        x = x + self.text_emb.lookup(ids[:, 0], zero[:, 0])
        return x[:, None, :]

    # ---- temporal transformer -----------------------------------------------------------------

    def new_kv(self, batch: int, device: torch.device | str, dtype: torch.dtype,
               capacity: int | None = None) -> RingKV:
        cfg = self.cfg
        return RingKV.empty(cfg.num_layers, batch, cfg.num_heads, capacity or cfg.context, cfg.head_dim,
                            device, dtype)

    def temporal_step(self, x: torch.Tensor, kv: RingKV, active: torch.Tensor,
                      visible: int | None = None) -> torch.Tensor:
        """x [B, 1, D] -> out_norm(h) [B, 1, D]. Rows with `active` false do not advance (see
        `RingKV.advance`); their output is meaningless. `visible`: attend only the first `visible`
        ring slots, exact while no active row holds more keys (None: the whole ring)."""
        attend = kv.advance(1, self.cfg.context, active, visible)
        return self.out_norm(self.transformer(x, attend, kv))

    def temporal_prefill(self, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
        """Parallel causal forward of one row's prompt, x [1, L, D], from a fresh stream: the keys
        and values of every layer [layers, 2, H, L, Dh] that L single steps would have written into
        a ring of `capacity` (default: the context), for `RingKV.load_row` (docs/engine.md § System prompt and prefill)."""
        cfg = self.cfg
        L = x.shape[1]
        kv = self.new_kv(1, x.device, x.dtype, capacity=L)
        positions = torch.arange(L, device=x.device).view(1, L)
        mask = additive(prefill_mask(L, capacity or cfg.context, cfg.context, x.device), x.dtype)
        self.transformer(x, Attend(positions, mask, positions), kv)
        return kv.kv[:, :, 0]

    def text_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, 1, D] -> fp32 logits [B, text_card]."""
        return self.text_linear(h[:, 0]).float()

    # ---- depformer ----------------------------------------------------------------------------

    def depformer_frame(self, h: torch.Tensor, text_token: torch.Tensor, forced: torch.Tensor,
                        forced_mask: torch.Tensor, steps: int, choose) -> torch.Tensor:
        """Run depformer steps 0..steps-1 for one frame (docs/model.md § Depformer): h [B, 1, D];
        text_token [B]; forced and forced_mask [B, steps] force each step's token as the NEXT
        step's input; `choose(step, logits [B, card] fp32) -> tokens [B]`. Returns the chosen
        (not forced) tokens [B, steps]."""
        cfg = self.cfg
        n = cfg.dep_q
        masks = self._step_masks.get((h.device, h.dtype))
        if masks is None:
            # [n, 1, 1, n]: step s sees slots 0..s under the ring rule, except that the last step
            # cannot see slot 0 (kept for parity).
            idx = torch.arange(n, device=h.device)
            masks = additive(ring_mask(idx[:, None], idx + 1, n, None), h.dtype)
            self._step_masks[(h.device, h.dtype)] = masks
        # Step s writes slot s of a ring of dep_q slots. Attending the whole ring under a mask,
        # as the reference does, keeps bf16 rounding identical to it.
        kv = RingKV.empty(cfg.depformer_num_layers, h.shape[0], cfg.depformer_num_heads, n,
                          cfg.depformer_dim // cfg.depformer_num_heads, h.device, h.dtype)
        prev = text_token
        out = []
        for s in range(steps):
            e = self.depformer_text_emb(prev) if s == 0 else self.depformer_emb[s - 1](prev)
            x = self.depformer_in[s](h) + e[:, None, :]
            x = self.depformer(x, Attend(None, masks[s:s + 1], s), kv, step=s)
            logits = self.linears[s](x[:, 0]).float()
            tok = choose(s, logits)
            out.append(tok)
            prev = torch.where(forced_mask[:, s], forced[:, s], tok)
        return torch.stack(out, dim=1)
