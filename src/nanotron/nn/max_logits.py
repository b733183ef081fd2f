"""The largest pre-softmax attention logit of each query head, and the attention core that records it (QK-clip,
``optim/qk_clip.py``).

A head's logit for query ``i`` and key ``j`` is ``q_i . k_j / sqrt(head_dim)``, as the softmax sees it, and only the
pairs the layer's mask allows count. ``max_logits`` computes it without the gradient, one chunk of queries at a time
(at most ``CHUNK_ELEMENTS`` logits at once, never the whole queries x keys matrix), in the model's dtype; under the
plain causal mask a chunk multiplies only the keys up to its last query. It reads every form ``AttentionMasks``
hands a layer: None (plain causal over the whole sequence), the dense boolean mask, a flex ``BlockMask`` (its
``mask_mod``) and FA4's ``FlashMask``.

Cost: one extra ``q k^T`` per layer and micro-batch, half of the attention forward's FLOPs (a sixth of its forward
and backward), and nothing when QK-clip is off (the core is not wrapped then).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from nanotron.nn.attention import AttentionCore, BlockMask, allowed
from nanotron.nn.flash_attention import FlashMask

CHUNK_ELEMENTS = 2**26  # products held at once (128 MiB in bf16, with the chunk's boolean mask 192 MiB)


def _allowed_rows(mask, rows: slice, batch: int, queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """Which keys the queries of ``rows`` may see, [batch | 1, rows, keys]."""
    query_index = torch.arange(queries, device=device)[rows]
    key_index = torch.arange(keys, device=device)
    if mask is None:
        return allowed(query_index[:, None], key_index[None, :])[None]
    if isinstance(mask, torch.Tensor):
        return mask[:, 0, rows]
    if BlockMask is not None and isinstance(mask, BlockMask):
        rows_of = torch.arange(batch, device=device)[:, None, None]
        return mask.mask_mod(rows_of, 0, query_index[None, :, None], key_index[None, None, :])
    if isinstance(mask, FlashMask):
        return _flash_rows(mask, rows, batch, keys, device)
    raise TypeError(f"no rule for an attention mask of type {type(mask).__name__}")


def _flash_rows(mask: FlashMask, rows: slice, batch: int, keys: int, device: torch.device) -> torch.Tensor:
    """A ``FlashMask`` as the rule: queries at the positions of ``query_runs`` over keys ``0, 1, ...``, or, with
    ``cu_seqlens``, whole sequences whose documents (runs of the rows laid end to end) see only themselves."""
    key_index = torch.arange(keys, device=device)
    if mask.cu_seqlens is None:
        positions = torch.cat([torch.arange(start, start + length, device=device) for start, length in mask.query_runs])
        return allowed(positions[rows, None], key_index[None, :], mask.window)[None]
    flat = torch.arange(batch * keys, device=device).view(batch, keys)
    documents = torch.searchsorted(mask.cu_seqlens.to(device), flat, right=True)
    return allowed(key_index[rows, None], key_index[None, :], mask.window,
                   documents[:, rows, None], documents[:, None, :])


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, mask) -> torch.Tensor:
    """The largest logit of each query head (fp32 [heads]; -inf for a head whose queries see no key) of ``q`` [batch,
    heads, queries, head_dim] over ``k`` [batch, kv_heads, keys, head_dim] where ``mask`` allows (a layer's
    ``AttentionMasks.for_window``); query head ``h`` reads kv head ``h // (heads / kv_heads)``."""
    batch, heads, queries, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    grouped = q.view(batch, kv_heads, heads // kv_heads, queries, head_dim)
    keys_t = k.transpose(-1, -2)[:, :, None]  # [batch, kv_heads, 1, head_dim, keys]
    step = max(1, CHUNK_ELEMENTS // max(1, batch * heads * keys))
    best = torch.full((heads,), float("-inf"), device=q.device)
    for start in range(0, queries, step):
        rows = slice(start, min(start + step, queries))
        seen = keys if mask is not None else min(keys, rows.stop)  # plain causal: no key after the chunk's last query
        logits = grouped[:, :, :, rows] @ keys_t[..., :seen]
        allow = _allowed_rows(mask, rows, batch, queries, keys, q.device)[..., :seen]
        logits.masked_fill_(~allow[:, None, None], float("-inf"))
        best = torch.maximum(best, logits.amax(dim=(0, 3, 4)).float().reshape(heads))
    return best * head_dim**-0.5  # the softmax's scale, positive: the largest logit is the largest product scaled


class LogitMaxima(AttentionCore):
    """An attention core that records, while gradients are on (training's forwards, not evaluations'), the largest
    logit of each of its heads (``maximum``, fp32 [local heads]) over the forwards since the last ``take``, then
    runs the core it wraps. ``keys(k)`` of the wrapped core are the keys the queries attend to. ``compiled``: the
    layer is compiled, and the record runs eagerly inside it (a loop over chunks; under context parallelism a
    collective); excluded only then, since excluding imports dynamo (seconds)."""

    def __init__(self, core: AttentionCore, compiled: bool = False):
        super().__init__()
        self.core = core
        self.maximum: torch.Tensor | None = None
        self.record = torch.compiler.disable(self._record) if compiled else self._record

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.record(q.detach(), k.detach(), mask)
        return self.core(q, k, v, mask)

    def _record(self, q: torch.Tensor, k: torch.Tensor, mask) -> None:
        """Not again in a recomputation of the forward (``nn/recompute.py``), which runs inside the backward; out of
        sight of the dispatch modes of selective recomputation, whose forward and recomputation must dispatch the
        same ops (and which would keep the record's products until the backward)."""
        if torch._C._current_graph_task_id() != -1:  # inside a backward
            return
        with _disable_current_modes():
            new = max_logits(q, self.core.keys(k), mask)
            self.maximum = new if self.maximum is None else torch.maximum(self.maximum, new)

    def take(self, heads: int, device: torch.device) -> torch.Tensor:
        """The maxima recorded (-inf for ``heads`` heads where none was), and a fresh start."""
        maximum = self.maximum if self.maximum is not None else torch.full((heads,), float("-inf"), device=device)
        self.maximum = None
        return maximum


def record_max_logits(model: torch.nn.Module, compiled: bool = False) -> None:
    """Wrap every attention core of ``model`` in a ``LogitMaxima`` (a module converter: no parameters change);
    ``compiled``: the model's layers will be compiled."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, AttentionCore) and not isinstance(child, LogitMaxima):
                setattr(module, name, LogitMaxima(child, compiled))
