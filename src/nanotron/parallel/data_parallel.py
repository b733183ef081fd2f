"""Gradient reduction over data-parallel replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


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
