"""The attention core: softmax attention of queries over keys, under a mask written over the tokens' indices.

A decoder's attention block computes its queries, keys and values (projections, RoPE, the KV cache) and hands them
to an ``AttentionCore``, the seam where a parallel mechanism changes where the keys come from: context parallelism
(``parallel/context_parallel.py``) swaps the core for one that gathers the keys and values of the whole sequence
from the ranks holding its other parts. Which key a query may attend to is a ``MaskRule`` over explicit vectors of
global token indices (queries and keys), never over positions in a local tensor, so that the same rule serves one
rank holding the whole sequence and a rank holding two chunks of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Since torch 2.5, SDPA groups query heads over kv heads itself, without materialising repeated keys and values.
SDPA_GROUPS_HEADS = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class MaskRule:
    """Causal attention, within ``window`` tokens when set (a window of W covers W tokens, the query's own
    included, as transformers and flash-attention's ``window_size=(W - 1, 0)``)."""

    window: int | None = None

    def __call__(self, query_index: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
        """[..., queries, keys] (True = attend) from the global indices of the queries [..., queries] and of the
        keys [..., keys]."""
        query, key = query_index[..., :, None], key_index[..., None, :]
        allowed = key <= query
        if self.window is not None:
            allowed = allowed & (key > query - self.window)
        return allowed


CAUSAL = MaskRule()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [batch, heads, queries, head_dim] over k, v [batch, kv_heads, keys, head_dim] (grouped-query heads
    when there are fewer kv heads) under ``mask`` (True = attend; None: causal over keys aligned with the queries)."""
    q_per_kv = q.shape[1] // k.shape[1]
    grouped = {}
    if q_per_kv > 1 and SDPA_GROUPS_HEADS:
        grouped = {"enable_gqa": True}
    elif q_per_kv > 1:
        k = k.repeat_interleave(q_per_kv, dim=1)
        v = v.repeat_interleave(q_per_kv, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **grouped)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **grouped)


class AttentionCore(nn.Module):
    """Attention of queries that are the last of the keys (one rank holds the whole sequence; in generation the KV
    cache holds the earlier positions), under ``rule``. ``attention_mask`` [batch, 1, queries, keys] (True =
    attend: generation's padded prompts) restricts it further. Holds no parameters."""

    def __init__(self, rule: MaskRule):
        super().__init__()
        self.rule = rule

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        queries, keys = q.shape[2], k.shape[2]
        if self.rule.window is None and attention_mask is None:
            return attend(q, k, v, None)  # the plain causal mask, which the fused kernels take without a tensor
        query_index = torch.arange(keys - queries, keys, device=q.device)
        mask = self.rule(query_index, torch.arange(keys, device=q.device))
        return attend(q, k, v, mask if attention_mask is None else attention_mask & mask)
