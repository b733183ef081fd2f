"""Global gradient norm and clipping over the whole model, whatever its layout.

The norm must equal the single-process norm. Each rank sums the squares of the gradient values it holds, but counts
a replicated parameter only on one rank of each axis it is replicated over (``Placement.is_unique_copy``), and a
weight tied across pipeline stages on one stage. Under ZeRO-1 the replicas over a bucket's gradient axes hold
different shards of its reduced gradient, so each counts its own. The partial sums are then added over all ranks.
Without that rule a TP-replicated norm weight would be counted tp times, and with expert parallelism dense
weights (sharded by ZeRO-1 over dp × ep) would be counted on one ep rank only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron.parallel.context import ParallelContext
from nanotron.parallel.data_parallel import GradientBuckets
from nanotron.parallel.placement import get_placement


def global_grad_norm(buckets: GradientBuckets, parallel_context: ParallelContext) -> torch.Tensor:
    coords = parallel_context.coordinates
    pieces = [values for name, values, split_axes in buckets.grad_pieces()
              if get_placement(buckets.params[name]).is_unique_copy(coords, split_axes)]
    # One multi-tensor pass reads every gradient once (a pow and a sum per piece would write a squared copy). CUDA
    # reduces each piece as a tree; torch's CPU norm adds sequentially, which in fp32 is off by ~1e-4 for a million
    # elements, so the CPU accumulates in fp64.
    accumulate = torch.float64 if parallel_context.device.type == "cpu" else torch.float32
    norms = torch._foreach_norm(pieces, 2, dtype=accumulate) if pieces else []
    total = torch.stack(norms).pow(2).sum().float() if norms else torch.zeros((), device=parallel_context.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / norm): the factor that brings the gradients' norm down to ``max_norm`` (applied by the
    optimizer as it reads them, which saves a pass over all gradients)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
