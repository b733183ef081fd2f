"""Step statistics: named, summable tensors that stages compute and the trainer reads once per step.

A statistic is anything whose step value is a sum: the loss contributions (each already divided by the global token
count), per-domain loss sums and token counts, auxiliary losses of any stage. The pipeline schedule adds them up over
a step's micro-batches on each stage; :func:`sum_over_replicas` then adds them up over pipeline stages and
data-parallel ranks in one all-reduce, so that every rank ends the step with the same values (and any rank can log
them). Tensor-parallel ranks compute identical copies, so the sum runs over the ``pp_dp_cp_ep`` group, one rank of
each TP group. The collective needs the same tensors on every rank: ``template`` names them all, with their shapes,
and what a stage did not compute (the loss on an inner stage) counts as zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron.layout import Group
from nanotron.parallel.context import ParallelContext

Statistics = dict[str, torch.Tensor]


def accumulate(total: Statistics, new: Statistics) -> None:
    """Add ``new`` into ``total`` (detached), key by key."""
    for name, value in new.items():
        value = value.detach()
        total[name] = total[name] + value if name in total else value


def sum_over_replicas(local: Statistics, template: dict[str, tuple[int, ...]], parallel_context: ParallelContext,
                      group: Group = Group.STATISTICS) -> Statistics:
    """Every statistic of ``template`` summed over pipeline stages and data-parallel ranks (``group``: over the
    ranks of another group, such as ``DENSE_REPLICAS``, the ranks of a stage that see different tokens), as fp64
    on every rank."""
    names = sorted(template)
    device = parallel_context.device
    flat = torch.cat([
        (local[name].to(torch.float64) if name in local else torch.zeros(template[name], dtype=torch.float64,
                                                                          device=device)).reshape(-1)
        for name in names
    ])
    if parallel_context.size(group) > 1:
        dist.all_reduce(flat, group=parallel_context.group(group))
    sizes = [torch.Size(template[name]).numel() for name in names]
    return {name: piece.view(template[name]) for name, piece in zip(names, flat.split(sizes))}


def sum_over_all_ranks(values: torch.Tensor, parallel_context: ParallelContext) -> torch.Tensor:
    """``values`` summed over every rank, in place: counts that each rank makes of its own work (every stage's
    layers, every replica's batch, every TP rank's shards), like FP8's cast values."""
    if parallel_context.world_size > 1:
        dist.all_reduce(values)
    return values


def max_over_ranks(values: torch.Tensor, parallel_context: ParallelContext,
                   groups: tuple[Group, ...] = (Group.TP, Group.DENSE_REPLICAS)) -> torch.Tensor:
    """``values`` maximised over the tensor- and data-parallel ranks of this pipeline stage (which hold the same
    modules), in place: a statistic every such rank must agree on, like FP8's step amaxes. With ``groups``
    ``(DENSE_REPLICAS,)``, over the replicas only (every tensor-parallel rank its own values, like QK-clip's
    per-head logits)."""
    for group in groups:
        if parallel_context.size(group) > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=parallel_context.group(group))
    return values

