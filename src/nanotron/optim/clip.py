"""Global gradient norm and clipping over the whole model, whatever its layout.

The norm must equal the single-process norm. Each rank sums the squares of the gradients it holds, but counts a
replicated parameter only on one rank of each axis it is replicated over (``Placement.is_unique_copy``); the partial
sums are then added over the ranks of one model replica. Without that rule a TP-replicated norm weight would be
counted tp times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron.parallel.context import ParallelContext
from nanotron.parallel.placement import get_placement


def global_grad_norm(
    grads: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter], parallel_context: ParallelContext
) -> torch.Tensor:
    coords = parallel_context.coordinates
    squares = [g.float().pow(2).sum() for name, g in grads.items() if get_placement(params[name]).is_unique_copy(coords)]
    device = next(iter(grads.values())).device
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if parallel_context.size("model") > 1:
        dist.all_reduce(total, group=parallel_context.groups["model"])
    return total.sqrt()


@torch.no_grad()
def clip_gradients(grads: dict[str, torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale all gradients by min(1, max_norm / norm); a no-op when the norm is already small enough."""
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(list(grads.values()), scale)
