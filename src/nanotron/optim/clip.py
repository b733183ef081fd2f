"""Global gradient norm and clipping over the whole model, whatever its layout.

The norm must equal the single-process norm. Each rank sums the squares of the gradient values it holds, but counts
a replicated parameter only on one rank of each axis it is replicated over (``Placement.is_unique_copy``), and a
weight tied across pipeline stages on one stage. Under ZeRO-1 the replicas over a bucket's gradient axes hold
different shards of its reduced gradient, so each counts its own. The partial sums are then added over all ranks.
Without that rule a TP-replicated norm weight would be counted tp times, and with expert parallelism dense
weights (sharded by ZeRO-1 over dp × ep) would be counted on one ep rank only. Rows replicated over a group of TP
ranks (kv heads shared by the ranks whose query heads use them) count on the group's first rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron.parallel.context import ParallelContext
from nanotron.parallel.data_parallel import GradientBuckets
from nanotron.parallel.placement import get_placement


def _counted(in_param: slice, duplicates: list[tuple[int, int]], row: int) -> list[slice]:
    """The parts of a gradient piece (elements ``in_param`` of the flattened parameter), as ranges within the piece,
    outside the duplicated local rows (kv heads replicated over TP ranks: counted on the first rank of each group)."""
    kept, start = [], in_param.start
    for first, last in duplicates:
        lo, hi = max(first * row, in_param.start), min(last * row, in_param.stop)
        if lo < hi:
            kept.append(slice(start - in_param.start, lo - in_param.start))
            start = hi
    kept.append(slice(start - in_param.start, in_param.stop - in_param.start))
    return [part for part in kept if part.start < part.stop]


def coalesced(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """``pieces`` with every run of views that follow each other in one flat buffer joined into one view.

    A bucket's counted gradients are usually one contiguous run (every parameter counted), so the norm launches a
    reduction per bucket instead of one per parameter."""
    joined: list[torch.Tensor] = []
    for piece in pieces:
        last = joined[-1] if joined else None
        base = piece._base
        if (last is not None and base is not None and last._base is base and base.dim() == 1
                and last.storage_offset() + last.numel() == piece.storage_offset()):
            start = last.storage_offset() - base.storage_offset()
            joined[-1] = base[start:start + last.numel() + piece.numel()]
        else:
            joined.append(piece)
    return joined


class GlobalGradNorm:
    """The global gradient norm of ``buckets``, called once per step.

    Which gradient values this rank counts depends only on the layout, and the buckets' gradient buffers never move,
    so the views to count are chosen once, here; a step only reads them. Gradients that buckets hold as autograd
    produced them are new tensors every step: for those the ranges to count are chosen here.
    """

    def __init__(self, buckets: GradientBuckets, parallel_context: ParallelContext):
        coords, sizes = parallel_context.coordinates, parallel_context.sizes
        self.device = parallel_context.device
        self.buckets = buckets
        counted_pieces: list[torch.Tensor] = []
        self.held_ranges: list[tuple[str, slice]] = []  # (name, range of the flattened gradient)
        for name, values, split_axes, in_param in buckets.grad_pieces():
            param = buckets.params[name]
            placement = get_placement(param)
            if not placement.is_unique_copy(coords, split_axes):
                continue
            duplicates = placement.duplicate_rows(coords, sizes)
            parts = _counted(in_param, duplicates, param[0].numel()) if duplicates else [slice(None)]
            if values is None:
                self.held_ranges.extend((name, part) for part in parts)
            else:
                counted_pieces.extend(values[part] for part in parts)
        self.pieces = coalesced(counted_pieces)

    def _step_pieces(self) -> list[torch.Tensor]:
        return self.pieces + [self.buckets.gradient(name).view(-1)[part] for name, part in self.held_ranges]

    def __call__(self) -> torch.Tensor:
        # One reduction per coalesced piece reads every gradient once (a pow and a sum would write a squared copy).
        # ``vector_norm`` reads a bf16 buffer at 3.0 TB/s on an H200 where the multi-tensor norm reads it at 2.2
        # (``scripts/benchmark_gradient_passes.py``). The norms accumulate in fp32 whatever the gradients' dtype.
        # CUDA reduces each piece as a tree; torch's CPU norm adds sequentially, which in fp32 is off by ~1e-4 for a
        # million elements, so the CPU accumulates in fp64.
        accumulate = torch.float64 if self.device.type == "cpu" else torch.float32
        norms = [torch.linalg.vector_norm(piece, dtype=accumulate) for piece in self._step_pieces()]
        total = torch.stack(norms).pow(2).sum().float() if norms else torch.zeros((), device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(total)
        return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / norm): the factor that brings the gradients' norm down to ``max_norm`` (applied by the
    optimizer as it reads them, which saves a pass over all gradients)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
