"""Differentiable collectives of tensor parallelism (Megatron's conjugate pairs).

Each function is an autograd op whose backward is the transpose of its forward:

| function                 | forward                          | backward                         |
| ------------------------ | -------------------------------- | -------------------------------- |
| ``copy_to_tp``           | identity                         | all-reduce (sum)                 |
| ``reduce_from_tp``       | all-reduce (sum)                 | identity                         |
| ``gather_sequence``      | all-gather along the sequence    | reduce-scatter along the sequence|
| ``reduce_scatter_sequence`` | reduce-scatter along the sequence | all-gather along the sequence |

Activations are ``[batch, sequence, hidden]``; sequence parallelism shards dim 1. With a group of one rank every
function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQUENCE_DIM = 1


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def start_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Launch the all-gather of sequence shards; ``finish_gather_sequence`` turns the buffer into [B, S, ...]."""
    size = dist.get_world_size(group)
    # Collectives concatenate along dim 0: gather [size * B, S/tp, ...], then move the rank axis next to S.
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, dist.all_gather_into_tensor(out, x.contiguous(), group=group, async_op=True)


def finish_gather_sequence(buffer: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    return buffer.unflatten(0, (size, -1)).movedim(0, SEQUENCE_DIM).flatten(SEQUENCE_DIM, SEQUENCE_DIM + 1)


def start_reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Launch the reduce-scatter of [B, S, ...] partial sums into this rank's [B, S/tp, ...] slice of the sum."""
    size = dist.get_world_size(group)
    if x.shape[SEQUENCE_DIM] % size:
        raise ValueError(f"sequence length {x.shape[SEQUENCE_DIM]} is not divisible by the tensor-parallel size {size}")
    chunks = x.unflatten(SEQUENCE_DIM, (size, -1)).movedim(SEQUENCE_DIM, 0).flatten(0, 1).contiguous()
    out = torch.empty((x.shape[0], x.shape[SEQUENCE_DIM] // size, *x.shape[2:]), dtype=x.dtype, device=x.device)
    return out, dist.reduce_scatter_tensor(out, chunks, group=group, async_op=True)


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sequence shards of every rank, gathered along the sequence, outside autograd."""
    buffer, work = start_gather_sequence(x, group)
    work.wait()
    return finish_gather_sequence(buffer, group)


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out, work = start_reduce_scatter_sequence(x, group)
    work.wait()
    return out


def sum_partials(x: torch.Tensor, group: dist.ProcessGroup, scatter: bool) -> torch.Tensor:
    """The sum over TP of partial sums, outside autograd: reduce-scattered into this rank's sequence shard
    (``scatter``) or all-reduced."""
    return _reduce_scatter_sequence(x, group) if scatter else _all_reduce(x, group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # Summed into a copy, never into x: x is a row-parallel matmul's output, which pointwise recomputation
        # (nn/recompute.py) keeps for the backward; summed in place, its recomputed forward would sum it again.
        return _all_reduce(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


def _single(group: dist.ProcessGroup) -> bool:
    return dist.get_world_size(group) == 1


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if _single(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if _single(group) else _ReduceFromTP.apply(x, group)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if _single(group) else _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if _single(group) else _ReduceScatterSequence.apply(x, group)
