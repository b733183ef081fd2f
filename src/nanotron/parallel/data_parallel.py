"""Gradient reduction over replicas: data-parallel ranks, and the copies of weights tied across pipeline stages."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nanotron.parallel.placement import get_placement


@torch.no_grad()
def all_reduce_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """SUM-reduce ``tensors`` in place with one collective per dtype.

    SUM, not mean: each rank's loss is already divided by the global token count (see ``nanotron.nn.loss``).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same_dtype in by_dtype.values():
        flat = _flatten_dense_tensors(same_dtype)
        dist.all_reduce(flat, group=group)
        for tensor, reduced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            tensor.copy_(reduced)


@torch.no_grad()
def sync_tied_copies(grads: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter],
                     group: dist.ProcessGroup) -> None:
    """Sum the gradients of weights held by several pipeline stages, so every copy takes the same update."""
    tied = [grads[name] for name, param in params.items() if get_placement(param).pipeline_copies]
    if tied:
        all_reduce_coalesced(tied, group)
