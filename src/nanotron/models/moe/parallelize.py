"""How the mixture-of-experts models (LlaMoE, Qwen2 with a ``moe_config``) are parallelised: Llama's tensor-parallel
plan with every MoE block split as a whole, and the routed experts split over the expert-parallel ranks
(``parallel/expert_parallel.py`` moves the tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nanotron.config import LlamaConfig
from nanotron.config.llama import HiddenAct
from nanotron.layout import Axis
from nanotron.models.llama.parallelize import llama_plan
from nanotron.models.moe.model import GroupedExperts, MoEFeedForward
from nanotron.parallel.expert_parallel import ExpertExchange
from nanotron.parallel.placement import Shard
from nanotron.parallel.tensor_parallel import REDUCE_SCATTER, GradientSummedLinear, Style
from nanotron.parallel.tp_collectives import copy_to_tp, gather_sequence, reduce_from_tp, reduce_scatter_sequence


class ShardedExperts(GroupedExperts):
    """This rank's experts (``num_experts / ep`` of them) and slice of their feed-forward width (``ffn / tp``, gate
    and up rows split alike), with the placements that say so."""

    def __init__(self, num_experts: int, hidden_size: int, ffn: int, ep: int, tp: int, activation: HiddenAct):
        super().__init__(num_experts // ep, hidden_size, ffn // tp, activation)
        self.logical_experts, self.logical_ffn, self.ep, self.tp = num_experts, ffn, ep, tp
        by_expert = (Shard(Axis.EP, 0),) if ep > 1 else ()
        self.parameter_shards = {
            "gate_up_proj": ((num_experts, 2 * ffn, hidden_size),
                             by_expert + ((Shard(Axis.TP, 1, chunks=(ffn, ffn)),) if tp > 1 else ())),
            "down_proj": ((num_experts, hidden_size, ffn), by_expert + ((Shard(Axis.TP, 2),) if tp > 1 else ())),
        }

    @classmethod
    def resharded(cls, experts: GroupedExperts, ep: int | None = None, tp: int | None = None) -> ShardedExperts:
        """``experts`` (plain or already sharded) split over ``ep`` and ``tp`` ranks (None: as they are)."""
        num_experts = getattr(experts, "logical_experts", experts.num_experts)
        ffn = getattr(experts, "logical_ffn", experts.ffn)
        return cls(num_experts, experts.hidden_size, ffn, ep or getattr(experts, "ep", 1),
                   tp or getattr(experts, "tp", 1), experts.activation)


class TensorParallelMoE(MoEFeedForward):
    """A mixture-of-experts block split over TP like a dense MLP: each expert's feed-forward width is sharded
    (gate and up column-wise, down row-wise), the shared expert's too, and the block's output is summed over TP.

    Every rank routes all the block's tokens (the sequence is gathered first in sequence-parallel mode), so routing
    is identical everywhere. The expert outputs a rank combines are partial sums, so the gradients of the routing
    weights are partial too: the router's weight gradient is summed over TP, and so is the input's (the
    entry's backward), which carries both. The shared expert's gate, whole on every rank, weighs a partial output
    likewise: its gradient is summed over TP. The auxiliary losses, computed in full on every rank, are therefore
    backpropagated with a 1/tp share each.
    """

    def __init__(self, block: MoEFeedForward, group: dist.ProcessGroup, mode: str):
        super().__init__(block.config)
        tp = group.size()
        self.group, self.mode = group, mode
        self.router = GradientSummedLinear(block.router.in_features, block.router.out_features, group)
        self.experts = ShardedExperts.resharded(block.experts, tp=tp)
        if block.shared_expert is not None:
            self.shared_expert = ShardedExperts.resharded(block.shared_expert, tp=tp)
        if block.shared_expert_gate is not None:
            self.shared_expert_gate = GradientSummedLinear(block.shared_expert_gate.in_features, 1, group)
        self.auxiliary_share = 1.0 / tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_sequence(x, self.group) if self.mode == REDUCE_SCATTER else copy_to_tp(x, self.group)
        y = super().forward(x)
        return reduce_scatter_sequence(y, self.group) if self.mode == REDUCE_SCATTER else reduce_from_tp(y, self.group)


@dataclass(frozen=True)
class MixtureOfExperts(Style):
    def parallelize(self, module, group, mode, overlap):
        return TensorParallelMoE(module, group, mode)


def moe_plan(config: LlamaConfig) -> dict[str, Style]:
    """Llama's plan (the dense layers' MLPs included); each MoE block is split as a whole (``TensorParallelMoE``)."""
    layers = config.moe.layers if config.moe is not None else ()
    return llama_plan(config) | {f"layers.{i}.mlp": MixtureOfExperts() for i in layers}


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Split the routed experts of every MoE block over the ranks of ``group`` and route tokens to them by
    all-to-all (a shared expert stays whole on every rank). Call on the meta device, after tensor parallelism."""
    ep = group.size()
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.experts = ShardedExperts.resharded(module.experts, ep=ep)
            module.exchange = ExpertExchange(group, module.settings.num_experts)
