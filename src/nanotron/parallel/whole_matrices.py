"""A tensor-parallel parameter's matrices whole on every rank of its TP group, and this rank's part cut back out.

An optimizer that transforms each matrix as a whole (Muon's orthogonalisation) needs what TP splits: the rows of a
column-parallel weight (chunk by chunk for fused q|k|v and gate|up, kv heads replicated in groups where there are
fewer than ranks), the columns of a row-parallel one, an expert's feed-forward slice. ``gather_over_tp`` all-gathers
the local tensors and puts every rank's pieces where ``Placement`` says they belong; shards over other axes stay as
they are (expert parallelism: each rank keeps whole experts, and transforms its own). ``local_part`` is the
inverse. Both are exact copies, so a transform of the gathered tensor is the single-process transform.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron.layout import Axis
from nanotron.parallel.placement import Placement


def _tp_pieces(placement: Placement, rank: int, tp: int):
    shard = placement.shard_on(Axis.TP)
    return shard.dim, shard.intervals(placement.logical_shape[shard.dim], rank, tp)


def gather_over_tp(local: torch.Tensor, placement: Placement, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``local`` with its TP-sharded dim made whole (the logical size along it); ``local`` itself where the
    parameter is not sharded over TP. Collective over ``group`` (the TP ranks) for sharded parameters."""
    if placement.shard_on(Axis.TP) is None or group is None or dist.get_world_size(group) == 1:
        return local
    tp = dist.get_world_size(group)
    gathered = torch.empty((tp * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
    gathered = gathered.view(tp, *local.shape)
    dim, _ = _tp_pieces(placement, 0, tp)
    shape = list(local.shape)
    shape[dim] = placement.logical_shape[dim]
    whole = torch.empty(shape, dtype=local.dtype, device=local.device)
    for rank in range(tp):
        for piece in _tp_pieces(placement, rank, tp)[1]:
            whole.narrow(dim, piece.global_start, piece.length).copy_(
                gathered[rank].narrow(dim, piece.local_start, piece.length))
    return whole


def local_part(whole: torch.Tensor, placement: Placement, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's part of a tensor that ``gather_over_tp`` made whole."""
    if placement.shard_on(Axis.TP) is None or group is None or dist.get_world_size(group) == 1:
        return whole
    dim, pieces = _tp_pieces(placement, dist.get_rank(group), dist.get_world_size(group))
    return torch.cat([whole.narrow(dim, piece.global_start, piece.length) for piece in pieces], dim=dim)
