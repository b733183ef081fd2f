"""Expert parallelism: the experts of every MoE block are split over the ``ep`` ranks, tokens travel to them and
back by all-to-all.

Every rank of an expert-parallel group reads different samples (data is sharded over dp × ep) and holds
``E / ep`` whole experts: rank ``r`` holds experts ``[r * E/ep, (r + 1) * E/ep)``, so a batch sorted by expert is
also sorted by destination rank. One block's exchange (``ExpertExchange``):

1. an all-to-all of the per-expert token counts tells every rank how many tokens it will receive from each other
   rank for each of its experts; the split sizes go to the host (the only sync: all-to-all needs them there);
2. the tokens, grouped by expert, go to the ranks that hold their experts (``all_to_all_single`` with variable
   splits); they arrive grouped by source rank, then by local expert, and are reordered to be grouped by expert;
3. the local experts run on them, the outputs are put back in arrival order and return by the inverse
   all-to-all; the block then weights and adds them to their tokens as without parallelism.

The all-to-alls are autograd functions whose backward is the opposite exchange, so gradients of the expert inputs
flow back to the ranks whose tokens they were. Expert weights carry a ``Shard(Axis.EP, 0)`` placement: their gradients
are summed over the data-parallel ranks that hold the same experts (``dp``), the router and every dense weight over
``dp`` × ``ep`` (``Placement.gradient_axes``). Tensor parallelism composes: each expert's feed-forward width is
split over ``tp`` as in a dense MLP, and ranks exchange tokens with the ranks of the same tensor-parallel coordinate.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with variable splits; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


class ExpertExchange:
    """Runs a block's experts on tokens grouped by expert when the experts live on the ranks of ``group``."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.size = group.size()
        self.local_experts = num_experts // self.size

    def __call__(self, experts: nn.Module, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        received_counts = torch.empty_like(tokens_per_expert)  # [source rank * local expert]
        dist.all_to_all_single(received_counts, tokens_per_expert, group=self.group)
        received_counts = received_counts.view(self.size, self.local_experts)
        send_splits = tokens_per_expert.view(self.size, self.local_experts).sum(1).tolist()
        receive_splits = received_counts.sum(1).tolist()

        received = _AllToAll.apply(tokens, receive_splits, send_splits, self.group)
        # Arrival order is (source rank, local expert); the experts need (local expert, source rank).
        segment = torch.arange(received_counts.numel(), device=tokens.device).repeat_interleave(
            received_counts.reshape(-1))
        by_expert = ((segment % self.local_experts) * self.size + segment // self.local_experts).argsort(stable=True)
        outputs = experts(received[by_expert], received_counts.sum(0))
        arrival_order = outputs[by_expert.argsort()]
        return _AllToAll.apply(arrival_order, send_splits, receive_splits, self.group)


