"""Attention: which keys each query may see (one rule), and the kernels that apply it.

The rule reads per-token vectors: query ``q`` may attend to key ``k`` when

- ``key_index[k] <= query_index[q]`` (causal);
- ``key_index[k] > query_index[q] - window`` on sliding layers (a window of W positions, the query's own included);
- ``key_document[k] == query_document[q]`` with document masking (the documents packed into one sample never see
  each other).

Indices are the tokens' places in the full sequence, not in the tensors at hand, so a caller holding any subset of the
queries and keys (context parallelism: chunks of queries against gathered keys) states the rule with its own vectors.

A decoder's attention block computes its queries, keys and values (projections, RoPE, the KV cache) and hands them,
with its layer's mask, to an ``AttentionCore``: the seam where a parallel mechanism changes where the keys come from
(context parallelism, ``parallel/context_parallel.py``, swaps the core for one that gathers the keys and values of
the whole sequence; its masks hold the rank's query indices against every key's).

Two kernels apply it. SDPA with the boolean mask built from the rule, dense (queries × keys), is the plain-torch
reference and the path on CPU. On CUDA, flex attention takes a ``BlockMask`` built from the same rule: fully masked
blocks are skipped and no dense mask exists at any length. A rule that is plain causal attention over a whole sequence
runs SDPA's own causal kernel (``is_causal``), the fastest on every device. Generation's padded prompts (a boolean
``padding`` mask) use the dense mask. A model whose attention runs FlashAttention-4 (``model.attention_backend``,
``nn/flash_attention.py``) gets the rule in FA4's terms (a ``FlashMask``) wherever FA4 expresses it, and torch's
kernels elsewhere, each such case named once in the log.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from nanotron.nn.flash_attention import FlashMask, document_boundaries, flash_attend, report_fallback

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch < 2.5
    BlockMask = create_block_mask = flex_attention = None

logger = logging.getLogger(__name__)

_TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2])
# Since torch 2.5, SDPA and flex attention group query heads over kv heads themselves, without repeating the keys.
SDPA_GROUPS_HEADS = _TORCH >= (2, 5)
FLEX_AVAILABLE = flex_attention is not None and _TORCH >= (2, 5)


def allowed(query_index: torch.Tensor, key_index: torch.Tensor, window: int | None = None,
            query_document: torch.Tensor | None = None, key_document: torch.Tensor | None = None) -> torch.Tensor:
    """The rule, elementwise over broadcast vectors: True where the query may attend to the key."""
    allow = key_index <= query_index
    if window is not None:
        allow = allow & (key_index > query_index - window)
    if query_document is not None:
        allow = allow & (query_document == key_document)
    return allow


class AttentionMasks:
    """The vectors the rule reads for one forward, and the masks built from them: one per window, built on first
    request and shared by every layer with that window (their block masks are built once per micro-batch).

    ``query_index`` [queries] and ``key_index`` [keys] are shared by the batch rows; ``query_document`` [batch,
    queries] and ``key_document`` [batch, keys] are given together or not at all; ``padding`` [batch, 1, queries,
    keys] hides keys (generation's left padding). ``whole_sequence`` says that the queries and the keys are the same
    positions 0, 1, ...: without a window, documents or padding the rule is then SDPA's own causal mask.

    ``flash``: the model's attention runs FlashAttention-4 where FA4 expresses the rule, which needs the queries as
    ``query_runs``, the (first position, length) of each contiguous run of ``query_index`` in order, the keys being
    positions 0, 1, ... (whole sequences, a context-parallel rank's chunks; unknown: None).
    """

    def __init__(self, query_index: torch.Tensor, key_index: torch.Tensor,
                 query_document: torch.Tensor | None = None, key_document: torch.Tensor | None = None,
                 padding: torch.Tensor | None = None, whole_sequence: bool = False,
                 query_runs: tuple[tuple[int, int], ...] | None = None, flash: bool = False):
        if (query_document is None) != (key_document is None):
            raise ValueError("give the documents of both the queries and the keys, or of neither")
        self.query_index, self.key_index = query_index, key_index
        self.query_document, self.key_document = query_document, key_document
        self.padding = padding
        self.whole_sequence = whole_sequence
        self.query_runs, self.flash = query_runs, flash
        self._masks: dict[int | None, torch.Tensor | BlockMask | FlashMask | None] = {}

    @classmethod
    def of_sequence(cls, length: int, device: torch.device, past: int = 0, documents: torch.Tensor | None = None,
                    padding: torch.Tensor | None = None, flash: bool = False) -> AttentionMasks:
        """``length`` queries that follow ``past`` earlier positions (a KV cache) and attend to all of them;
        ``documents`` [batch, past + length] are the tokens' document ids (document masking)."""
        keys = torch.arange(past + length, device=device)
        return cls(keys[past:], keys, None if documents is None else documents[:, past:], documents, padding,
                   whole_sequence=past == 0, query_runs=((0, length),) if past == 0 else None, flash=flash)

    def for_window(self, window: int | None) -> torch.Tensor | BlockMask | FlashMask | None:
        """The mask of the layers with ``window`` (None: full attention), in the form the device runs fastest: a
        ``FlashMask`` where the model runs FA4 and FA4 expresses the rule, None for plain causal attention, a flex
        BlockMask on CUDA, else the dense boolean mask."""
        if window not in self._masks:
            flash = self.flash_mask(window) if self.flash else None
            self._masks[window] = flash if flash is not None else self.torch_mask(window)
        return self._masks[window]

    def torch_mask(self, window: int | None) -> torch.Tensor | BlockMask | None:
        """The mask for torch's kernels: None for plain causal attention (SDPA's causal kernel), a flex BlockMask
        on CUDA, else the dense boolean mask."""
        plain = window is None and self.query_document is None and self.padding is None
        if plain and self.whole_sequence:
            return None
        if self.query_index.is_cuda and self.padding is None and _flex_runs():
            return self.block_mask(window)
        return self.dense(window)

    def flash_mask(self, window: int | None) -> FlashMask | None:
        """The rule in FA4's terms, or None where FA4 does not express it (named once in the log)."""
        if self.padding is not None:
            report_fallback("padded prompts", "FA4 takes no padding mask")
        elif self.query_runs is None:
            report_fallback("queries after a KV cache (generation)", "FA4 runs training's whole sequences")
        elif self.query_document is None:
            return FlashMask(window, query_runs=self.query_runs)
        elif self.whole_sequence:
            return FlashMask(window, cu_seqlens=document_boundaries(self.query_document))
        else:
            report_fallback("documents under context parallelism", "a rank's chunks of documents are not "
                            "expressed as FA4 varlen sequences")
        return None

    def dense(self, window: int | None) -> torch.Tensor:
        """The rule as a boolean mask [batch | 1, 1, queries, keys], for SDPA."""
        documents = {}
        if self.query_document is not None:
            documents = {"query_document": self.query_document[:, :, None], "key_document": self.key_document[:, None]}
        mask = allowed(self.query_index[:, None], self.key_index[None, :], window, **documents)
        mask = mask[:, None] if mask.dim() == 3 else mask[None, None]
        return mask if self.padding is None else mask & self.padding

    def block_mask(self, window: int | None) -> BlockMask:
        """The rule as a flex-attention BlockMask (compiled on CUDA, so that no dense mask is built)."""
        query_index, key_index = self.query_index, self.key_index
        query_document, key_document = self.query_document, self.key_document
        batch = None if query_document is None else query_document.shape[0]

        def mask_mod(b, h, q, k):
            if query_document is None:
                return allowed(query_index[q], key_index[k], window)
            return allowed(query_index[q], key_index[k], window, query_document[b, q], key_document[b, k])

        build = _compiled_create_block_mask() if query_index.is_cuda else create_block_mask
        return build(mask_mod, batch, None, len(query_index), len(key_index), device=query_index.device)


class AttentionCore(nn.Module):
    """``attend`` as a child module of each attention block, with no parameters: the one place a parallel mechanism
    swaps to change where the keys and values come from."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | BlockMask | FlashMask | None) -> torch.Tensor:
        return attend(q, k, v, mask)

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """The keys the queries attend to, given this rank's ``k`` (no gradient): ``k`` itself here."""
        return k


_compiled_flex = _compiled_block_mask = None
_reported = False


def _compiled_create_block_mask():
    """create_block_mask compiled once per process: eager, it evaluates the mask over every (query, key) pair, the
    dense mask flex attention exists to avoid (torch's ``_compile=True`` flag did the same and is deprecated)."""
    global _compiled_block_mask
    if _compiled_block_mask is None:
        _compiled_block_mask = torch.compile(create_block_mask)
    return _compiled_block_mask


def _compiled_flex_attention():
    """flex attention compiled once per process: eager, it materialises the scores it is meant to skip."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _flex_runs() -> bool:
    """Whether flex attention is there; on CUDA without it (torch < 2.5) the dense mask serves, reported once."""
    global _reported
    if not FLEX_AVAILABLE and not _reported:
        _reported = True
        logger.warning(f"flex attention needs torch>=2.5 (this is {torch.__version__}): sliding windows and document "
                       "masking use a dense (queries x keys) mask on CUDA, which costs memory at long sequences")
    return FLEX_AVAILABLE


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | BlockMask | FlashMask | None) -> torch.Tensor:
    """Attention of ``q`` [batch, heads, queries, head_dim] over ``k``, ``v`` [batch, kv_heads, keys, head_dim]
    (grouped-query: heads a multiple of kv_heads) where ``mask`` allows (``AttentionMasks.for_window``)."""
    if isinstance(mask, FlashMask):
        return flash_attend(q, k, v, mask)
    q_per_kv = q.shape[1] // k.shape[1]
    if FLEX_AVAILABLE and isinstance(mask, BlockMask):
        flex = _compiled_flex_attention() if q.is_cuda else flex_attention  # eager on CPU: the tests' comparison
        return flex(q, k, v, block_mask=mask, enable_gqa=q_per_kv > 1)
    grouped = {}
    if q_per_kv > 1 and SDPA_GROUPS_HEADS:
        grouped = {"enable_gqa": True}
    elif q_per_kv > 1:
        k, v = k.repeat_interleave(q_per_kv, dim=1), v.repeat_interleave(q_per_kv, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **grouped)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **grouped)
