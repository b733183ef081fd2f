"""Context parallelism: every sequence split over the ``cp`` ranks, attention still over the whole sequence.

**The split.** With N ranks the sequence is cut into 2N equal chunks and rank r holds chunks r and 2N-1-r, in that
order (``token_indices``): under the causal mask a query's work grows with its index, so pairing an early chunk
with a late one gives every rank the same number of (query, key) pairs. Every per-token tensor of a micro-batch
(inputs, labels, label mask, positions) is cut alike by the step's batch transform ``ContextParallelBatches``; the
samples are the same on every cp rank, so the global batch does not change, and the loss stays the sum of the token
losses over the global count of target tokens, each rank summing its own tokens' losses. Under document masking the
micro-batch keeps the whole sequence's document ids beside the rank's (``key_document_ids``), which the keys' side of
the mask reads.

**Attention.** Everything in a decoder layer but attention works token by token, so only attention needs the
other ranks: ``apply_context_parallel`` swaps every attention core (``nn/attention.py``) for a
``ContextParallelAttention``, which all-gathers the keys and values of the whole sequence over the cp group (their
gradients are reduce-scattered back to the ranks that computed them) and puts them in global order. The local
queries then attend to them under the layer's mask, which the step hands the model (``ContextParallelBatches``):
the attention rule evaluated at the queries' global indices against every key's, so sliding windows and document
masking need nothing more. The model is never told about the exchange: its attention block hands its queries, keys,
values and mask to whatever core it holds.

**Overlap.** The exchange goes by groups of kv heads (up to ``MAX_HEAD_GROUPS``), each group's query heads attending
to its kv heads only (``overlapped_attention``): forward launches every group's all-gather at once and waits for
each right before its group's attention, so a group's keys travel while the previous group's attention computes;
backward launches a group's reduce-scatter as soon as its gradients exist and computes the previous group's
meanwhile. Groups share no keys, so any attention kernel serves as it is (no log-sum-exp merge). With one kv head
on the rank there is one collective and nothing overlaps. The gain on GPUs is not measured: it needs several GPUs.

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

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from nanotron.data.batch import MicroBatch
from nanotron.nn.attention import AttentionCore, AttentionMasks, BlockMask, attend
from nanotron.nn.sequence_sum import SequenceSum

SEQUENCE_DIM = 2  # of keys and values, [batch, heads, sequence, head_dim]
MAX_HEAD_GROUPS = 4  # of kv heads whose exchanges overlap the attention of the others


def token_indices(rank: int, size: int, sequence_length: int, device: torch.device | None = None) -> torch.Tensor:
    """Global indices of the tokens that cp rank ``rank`` of ``size`` holds, in its local order: chunks ``rank`` and
    ``2 * size - 1 - rank`` of ``2 * size`` equal chunks."""
    if sequence_length % (2 * size):
        raise ValueError(f"a sequence of {sequence_length} tokens cannot be cut into 2 x {size} equal chunks")
    chunk = sequence_length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


class ContextParallelBatches:
    """The batch transform of context parallelism (``training/step.py``): every micro-batch cut to this cp rank's
    tokens (``prepare``), and the attention masks of those tokens handed to the model (``model_inputs``); ``flash``:
    the model's attention runs FlashAttention-4."""

    def __init__(self, rank: int, size: int, flash: bool = False):
        self.rank, self.size, self.flash = rank, size, flash

    def prepare(self, batch: MicroBatch) -> MicroBatch:
        """This rank's part of a micro-batch: every per-token tensor (shaped [batch, sequence, ...] like
        ``input_ids``) cut to the rank's tokens, and ``position_ids`` (the tokens' positions in the whole sequence,
        0, 1, ... unless the micro-batch has them) cut alike; per-sample and scalar tensors stay whole. Under document
        masking the whole sequence's document ids stay too, as ``extras["key_document_ids"]``."""
        rows, sequence = batch.input_ids.shape
        device = batch.input_ids.device
        if batch.position_ids is None:
            positions = torch.arange(sequence, device=device).expand(rows, sequence)
            batch = dataclasses.replace(batch, position_ids=positions)
        index = token_indices(self.rank, self.size, sequence, device)

        def part(value: torch.Tensor | None) -> torch.Tensor | None:
            if value is not None and value.dim() >= 2 and value.shape[:2] == (rows, sequence):
                return value.index_select(1, index)
            return value

        extras = {key: part(value) for key, value in batch.extras.items()}
        if batch.document_ids is not None:
            extras["key_document_ids"] = batch.document_ids
        return dataclasses.replace(batch, **{name: part(getattr(batch, name)) for name in batch.tensor_fields()},
                                   extras=extras)

    def model_inputs(self, batch: MicroBatch) -> dict[str, AttentionMasks]:
        """The attention masks of a prepared micro-batch: its tokens' global indices against the whole sequence's,
        and under document masking their documents against the whole sequence's; for a model whose attention runs
        FlashAttention-4, each of the rank's two chunks against the keys up to its end."""
        device = batch.input_ids.device
        sequence = batch.input_ids.shape[1] * self.size
        chunk = sequence // (2 * self.size)
        runs = ((self.rank * chunk, chunk), ((2 * self.size - 1 - self.rank) * chunk, chunk))
        return {"masks": AttentionMasks(token_indices(self.rank, self.size, sequence, device),
                                        torch.arange(sequence, device=device), batch.document_ids,
                                        batch.extras.get("key_document_ids"), query_runs=runs, flash=self.flash)}


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


def _start_gather(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Launch the all-gather of every rank's [batch, ...] ``x`` into [size * batch, ...] (rank after rank); the
    result is valid once the returned work is waited for."""
    gathered = torch.empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return gathered, dist.all_gather_into_tensor(gathered, x.contiguous(), group=group, async_op=True)


def _start_reduce_scatter(grad: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Launch the reduce-scatter of the gradient of a gathered sequence ([batch, ..., sequence, d], global order):
    each rank's queries contribute to every key's gradient; the sum belongs to the rank holding that key."""
    size = dist.get_world_size(group)
    chunks = _to_rank_order(grad, size).contiguous()
    out = torch.empty((chunks.shape[0] // size, *chunks.shape[1:]), dtype=grad.dtype, device=grad.device)
    return out, dist.reduce_scatter_tensor(out, chunks, group=group, async_op=True)


class _GatherSequenceChunks(torch.autograd.Function):
    """All-gather of every rank's two chunks into the whole sequence; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        gathered, work = _start_gather(x, group)
        work.wait()
        return _to_global_order(gathered, dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad):
        out, work = _start_reduce_scatter(grad, ctx.group)
        work.wait()
        return out, None


def gather_sequence_chunks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[batch, heads, local, d] of every cp rank -> [batch, heads, sequence, d] in sequence order (differentiable)."""
    return _GatherSequenceChunks.apply(x, group)


def head_groups(kv_heads: int) -> list[int]:
    """The numbers of kv heads of the groups whose exchange overlaps the attention of the others: as many groups as
    kv heads up to ``MAX_HEAD_GROUPS``, sizes as equal as they can be. Only the first group's gather (and the last
    one's reduce-scatter) is not hidden, a quarter of the exchange at four groups; every further group adds a
    collective and an attention call of its own, smaller ones."""
    groups = min(kv_heads, MAX_HEAD_GROUPS)
    return [kv_heads // groups + (g < kv_heads % groups) for g in range(groups)]


class _Exchange:
    """The collectives of one grouped exchange in flight, shared by its autograd nodes: the gathers launched in
    forward (each dropped once waited for), the reduce-scatters launched in backward."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.gathers: list[tuple[torch.Tensor, dist.Work] | None] = []
        self.reduce_scatters: list[dist.Work] = []


class _LaunchGathers(torch.autograd.Function):
    """Forward: launch the all-gather of every group's keys and values (one tensor each, side by side on the feature
    dimension: keys and values may differ in size, as DeepSeek-V3's) and return the local tensors launched, which
    link each group's ``_AwaitGather`` to ``k`` and ``v``. Backward: it runs once every group's ``_AwaitGather`` has
    launched its reduce-scatter; it waits for them and returns the keys' and values' gradients."""

    @staticmethod
    def forward(ctx, k, v, exchange, kv_sizes):
        ctx.exchange, ctx.widths = exchange, [k.shape[-1], v.shape[-1]]
        launched = [torch.cat([k_g, v_g], dim=-1)
                    for k_g, v_g in zip(k.split(kv_sizes, dim=1), v.split(kv_sizes, dim=1))]
        exchange.gathers = [_start_gather(kv_g, exchange.group) for kv_g in launched]
        return tuple(launched)

    @staticmethod
    def backward(ctx, *grads):
        for work in ctx.exchange.reduce_scatters:
            work.wait()
        grad_k, grad_v = zip(*(grad.split(ctx.widths, dim=-1) for grad in grads))
        return torch.cat(grad_k, dim=1), torch.cat(grad_v, dim=1), None, None


class _AwaitGather(torch.autograd.Function):
    """Forward: wait for group ``index``'s all-gather and put it in sequence order. Backward: launch the
    reduce-scatter of its gradient and return the buffer it fills (``_LaunchGathers`` waits before reading it)."""

    @staticmethod
    def forward(ctx, launched, exchange, index):  # launched: the local tensor gathered, the graph's link to k and v
        ctx.exchange = exchange
        gathered, work = exchange.gathers[index]
        exchange.gathers[index] = None
        work.wait()
        return _to_global_order(gathered, dist.get_world_size(exchange.group))

    @staticmethod
    def backward(ctx, grad):
        out, work = _start_reduce_scatter(grad, ctx.exchange.group)
        ctx.exchange.reduce_scatters.append(work)
        return out, None, None


def overlapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask,
                         group: dist.ProcessGroup) -> torch.Tensor:
    """``attend`` of the local queries over the keys and values of every cp rank in ``group``, one group of kv heads
    (``head_groups``, with the query heads that read them) at a time, so that each collective but the first
    (forward) and the last (backward) runs while another group's attention computes. Groups share no keys, so their
    outputs are concatenated, never merged: no kernel has to return its log-sum-exp.

    Forward launches every group's all-gather at once (NCCL runs them one after the other on its stream, gloo in its
    threads), and waits for each right before its group's attention. Backward needs no code of its own: the
    autograd engine runs the ready node created last first, so it computes the last group's attention gradients,
    then (``_AwaitGather``, created right before that attention) launches their reduce-scatter, then goes on with
    the previous group; ``_LaunchGathers``, created before all of them, waits for the reduce-scatters at the end.
    With NCCL a wait makes the compute stream wait for that collective only. Everything stays in one autograd graph,
    so activation recomputation (``nn/recompute.py``) treats the attention like the rest of the layer, where a
    backward differentiating a per-group graph of its own would recompute the layer once per group (and selective
    recomputation refuses a second backward of a region). Eager inside a compiled layer (flex attention keeps its own
    compiled kernel): async collectives do not trace; ``ContextParallelAttention`` excludes it from compilation."""
    kv_sizes, widths = head_groups(k.shape[1]), [k.shape[-1], v.shape[-1]]
    if len(kv_sizes) == 1:  # nothing to overlap
        k, v = gather_sequence_chunks(torch.cat([k, v], dim=-1), group).split(widths, dim=-1)
        return attend(q, k, v, mask)
    exchange = _Exchange(group)
    launched = _LaunchGathers.apply(k, v, exchange, kv_sizes)
    q_per_kv = q.shape[1] // k.shape[1]
    outs = [attend(q_g, *_AwaitGather.apply(kv_g, exchange, index).split(widths, dim=-1), mask)
            for index, (q_g, kv_g) in enumerate(zip(q.split([n * q_per_kv for n in kv_sizes], dim=1), launched))]
    return torch.cat(outs, dim=1)


class ContextParallelAttention(AttentionCore):
    """An attention core for queries holding this rank's tokens (``token_indices``): the keys and values of the
    whole sequence come from the cp group, group of kv heads after group of kv heads (``overlapped_attention``), and
    the queries attend to them where the mask (``ContextParallelBatches.model_inputs``) allows."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        # Excluded from compilation here, not by decorating the function: the decorator imports dynamo (over a
        # second) in every process that imports this module, context parallelism or not.
        self.overlapped_attention = torch.compiler.disable(overlapped_attention)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        if mask is None:
            raise ValueError("a context-parallel rank's queries are parts of the sequence: give the model the masks "
                             "of ContextParallelBatches.model_inputs")
        return self.overlapped_attention(q, k, v, mask, self.group)

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """The keys of the whole sequence, in order: one more all-gather of ``k`` (no gradient)."""
        gathered, work = _start_gather(k, self.group)
        work.wait()
        return _to_global_order(gathered, dist.get_world_size(self.group))


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
