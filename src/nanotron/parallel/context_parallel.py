"""Context parallelism: every sequence split over the ``cp`` ranks, attention still over the whole sequence.

**The split.** With N ranks the sequence is cut into 2N equal chunks and rank r holds chunks r and 2N-1-r, in that
order (``token_indices``): under the causal mask a query's work grows with its index, so pairing an early chunk
with a late one gives every rank the same number of (query, key) pairs. Every per-token tensor of a micro-batch
(inputs, labels, label mask, positions) is cut alike (``split_micro_batch``); the samples are the same on every cp
rank, so the global batch does not change, and the loss stays the sum of the token losses over the global count of
target tokens, each rank summing its own tokens' losses. Under document masking the micro-batch keeps the whole
sequence's document ids beside the rank's (``key_document_ids``), which the keys' side of the mask reads.

**Attention.** Everything in a decoder layer but attention works token by token, so only attention needs the
other ranks: ``apply_context_parallel`` swaps every attention core (``nn/attention.py``) for a
``ContextParallelAttention``, which all-gathers the keys and values of the whole sequence over the cp group in one
autograd collective (``gather_sequence_chunks``: its backward reduce-scatters their gradients back to the ranks
that computed them) and puts them in global order. The local queries then attend to them under the layer's mask,
which the trainer hands the model (``context_parallel_masks``): the attention rule evaluated at the queries' global
indices against every key's, so sliding windows and document masking need nothing more. The model is never told
about the exchange: its attention block hands its queries, keys, values and mask to whatever core it holds.

**Whole-sequence statistics.** A mixture of experts' router losses are per sequence: the load-balancing loss weighs
each expert's mean routing probability by its share of the sequence's selections, the z-loss averages over the
sequence's tokens. Both are linear in the per-token terms once the whole sequence's selection counts (and so its
length) are known, so each rank computes its own tokens' part of them, and those parts add up over the cp ranks
like the token losses. The counts are what must be summed over the cp group before use: the model's
``SequenceSum`` modules (``nn/sequence_sum.py``) become ``ContextParallelSequenceSum``, an all-reduce over cp.

Parameters are replicated over cp; their gradients, each rank's over its own tokens, are summed over dp × cp
(× ep) like data parallelism (``Placement.gradient_axes``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanotron.nn.attention import AttentionCore, AttentionMasks, BlockMask, attend
from nanotron.nn.sequence_sum import SequenceSum

SEQUENCE_DIM = 2  # of keys and values, [batch, heads, sequence, head_dim]


def token_indices(rank: int, size: int, sequence_length: int, device: torch.device | None = None) -> torch.Tensor:
    """Global indices of the tokens that cp rank ``rank`` of ``size`` holds, in its local order: chunks ``rank`` and
    ``2 * size - 1 - rank`` of ``2 * size`` equal chunks."""
    if sequence_length % (2 * size):
        raise ValueError(f"a sequence of {sequence_length} tokens cannot be cut into 2 x {size} equal chunks")
    chunk = sequence_length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def split_micro_batch(micro_batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This cp rank's part of a micro-batch: every [batch, sequence, ...] tensor (those shaped like ``input_ids``)
    cut to the rank's tokens, and ``position_ids`` (the tokens' positions in the whole sequence, 0, 1, ... unless the
    micro-batch has them) cut alike; per-sample and scalar entries stay whole."""
    batch, sequence = micro_batch["input_ids"].shape
    if "position_ids" not in micro_batch:
        positions = torch.arange(sequence, device=micro_batch["input_ids"].device).expand(batch, sequence)
        micro_batch = micro_batch | {"position_ids": positions}
    index = token_indices(rank, size, sequence, micro_batch["input_ids"].device)
    part = {key: value.index_select(1, index) if value.dim() >= 2 and value.shape[:2] == (batch, sequence) else value
            for key, value in micro_batch.items()}
    if "document_ids" in micro_batch:
        part["key_document_ids"] = micro_batch["document_ids"]
    return part


def context_parallel_masks(micro_batch: dict[str, torch.Tensor], rank: int, size: int) -> AttentionMasks:
    """The attention masks of cp rank ``rank``'s part of a micro-batch (``split_micro_batch``): its tokens' global
    indices against the whole sequence's, and under document masking their documents against the whole sequence's."""
    device = micro_batch["input_ids"].device
    sequence = micro_batch["input_ids"].shape[1] * size
    return AttentionMasks(token_indices(rank, size, sequence, device), torch.arange(sequence, device=device),
                          micro_batch.get("document_ids"), micro_batch.get("key_document_ids"))


def _to_global_order(gathered: torch.Tensor, size: int) -> torch.Tensor:
    """[size * batch, ..., local, d] as gathered (rank after rank, each holding its two chunks) -> [batch, ...,
    2 * size * chunk, d] with the chunks in sequence order."""
    ranks = gathered.unflatten(0, (size, -1)).unflatten(SEQUENCE_DIM + 1, (2, -1))  # [N, b, h, 2, c, d]
    chunks = torch.cat([ranks.select(SEQUENCE_DIM + 1, 0), ranks.select(SEQUENCE_DIM + 1, 1).flip(0)])
    return chunks.movedim(0, SEQUENCE_DIM).flatten(SEQUENCE_DIM, SEQUENCE_DIM + 1)


def _to_rank_order(grad: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of ``_to_global_order``: [batch, ..., sequence, d] -> [size * batch, ..., local, d]."""
    chunks = grad.unflatten(SEQUENCE_DIM, (2 * size, -1)).movedim(SEQUENCE_DIM, 0)  # [2N, b, h, c, d]
    ranks = torch.stack([chunks[:size], chunks[size:].flip(0)], dim=SEQUENCE_DIM + 1)  # [N, b, h, 2, c, d]
    return ranks.flatten(SEQUENCE_DIM + 1, SEQUENCE_DIM + 2).flatten(0, 1)


class _GatherSequenceChunks(torch.autograd.Function):
    """All-gather of every rank's two chunks into the whole sequence; backward: reduce-scatter of the gradient
    (each rank's queries contribute to every key's gradient; the sum belongs to the rank holding that key)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        gathered = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
        return _to_global_order(gathered, size)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        chunks = _to_rank_order(grad, size).contiguous()
        out = torch.empty((chunks.shape[0] // size, *chunks.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, chunks, group=ctx.group)
        return out, None


def gather_sequence_chunks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[batch, heads, local, d] of every cp rank -> [batch, heads, sequence, d] in sequence order (differentiable)."""
    return _GatherSequenceChunks.apply(x, group)


class ContextParallelAttention(AttentionCore):
    """An attention core for queries holding this rank's tokens (``token_indices``): the keys and values of the
    whole sequence are gathered from the cp group (one collective for both), then the queries attend to them where
    the mask (``context_parallel_masks``) allows."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        if mask is None:
            raise ValueError("a context-parallel rank's queries are parts of the sequence: give the model the masks "
                             "of context_parallel_masks")
        k, v = gather_sequence_chunks(torch.cat([k, v]), self.group).chunk(2)
        return attend(q, k, v, mask)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group``; backward: all-reduce of the gradient. Every rank's loss reads the sum, and
    the objective is the sum of the ranks' losses (gradients are summed over the group), so the gradient of a
    rank's part is the sum of every rank's gradient of its loss with respect to the sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class ContextParallelSequenceSum(SequenceSum):
    """Per-sequence sums over this rank's tokens -> over the whole sequences, summed over the cp group."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, sums: torch.Tensor) -> torch.Tensor:
        return _SumOverGroup.apply(sums, self.group)


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Swap every attention core and every sequence sum of ``model`` for its context-parallel form over ``group``
    (on the meta device, before weights exist; neither holds parameters, so names and placements do not change)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, AttentionCore):
                setattr(module, name, ContextParallelAttention(group))
            elif isinstance(child, SequenceSum):
                setattr(module, name, ContextParallelSequenceSum(group))
