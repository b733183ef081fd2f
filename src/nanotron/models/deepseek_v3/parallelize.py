"""How DeepSeek-V3 is parallelised: LlaMoE's plan for the MLPs and mixtures of experts (``moe_plan``, and its expert
parallelism), and multi-head latent attention split by heads.

- ``q_proj`` (or ``q_b_proj``) and ``kv_b_proj`` are column-parallel: each rank computes whole heads (their rows are
  each head's features side by side), ``o_proj`` row-parallel;
- the down projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and the latents' norms stay whole on every rank (their
  placement is replicated): in all-reduce mode every rank computes them on the whole input, and the column-parallel
  up projections sum their gradient over the ranks' heads; in sequence-parallel mode they see the rank's part of
  the sequence (the up projections gather the latents), so their weights' gradients are summed over TP
  (``LatentProjection``, ``SequenceParallelNorm``);
- the rotary key every head shares is made the whole sequence's on every rank, its gradient summed over the ranks'
  heads (``SharedRotaryKey``);
- the multi-token prediction modules' decoder layers follow the same plan (their experts split as a whole block
  each, like the main layers'); their ``eh_proj`` stays whole on every rank like the latents' down projections (a
  replicated 2 * hidden -> hidden matrix: splitting it would gather its output for the layer's norm), and their
  input norms like every norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.models.moe.parallelize import MixtureOfExperts, moe_plan
from nanotron.parallel.tensor_parallel import (
    REDUCE_SCATTER,
    Column,
    GradientSummedLinear,
    Row,
    SequenceParallelNorm,
    Style,
)
from nanotron.parallel.tp_collectives import copy_to_tp, gather_sequence


class TensorParallelSharedKey(nn.Module):
    """The shared rotary key of the whole sequence on every TP rank (gathered in sequence-parallel mode), whose
    gradient, each rank's heads' part, is summed over TP."""

    def __init__(self, group: dist.ProcessGroup, mode: str):
        super().__init__()
        self.group, self.mode = group, mode

    def forward(self, key: torch.Tensor) -> torch.Tensor:
        return gather_sequence(key, self.group) if self.mode == REDUCE_SCATTER else copy_to_tp(key, self.group)


@dataclass(frozen=True)
class SharedRotaryKey(Style):
    def parallelize(self, module, group, mode, overlap):
        return TensorParallelSharedKey(group, mode)


@dataclass(frozen=True)
class LatentProjection(Style):
    """A down projection replicated over TP: swapped only in sequence-parallel mode, where it sees a sequence shard
    and its gradient is summed."""

    def parallelize(self, module, group, mode, overlap):
        if mode != REDUCE_SCATTER:
            return None
        return GradientSummedLinear(module.in_features, module.out_features, group)


def deepseek_v3_plan(config: DeepseekV3Config) -> dict[str, Style]:
    first = config.num_hidden_layers
    prediction = {f"mtp.depths.{index}.layer.mlp": MixtureOfExperts() for index in range(
        config.num_nextn_predict_layers) if config.is_moe_layer(first + index)}
    prediction |= {"eh_proj": LatentProjection(), "enorm": SequenceParallelNorm(), "hnorm": SequenceParallelNorm()}
    return moe_plan(config) | prediction | {
        "attn.q_proj": Column(), "attn.q_b_proj": Column(), "attn.kv_b_proj": Column(), "attn.o_proj": Row(),
        "attn.q_a_proj": LatentProjection(), "attn.kv_a_proj_with_mqa": LatentProjection(),
        "attn.q_a_layernorm": SequenceParallelNorm(), "attn.kv_a_layernorm": SequenceParallelNorm(),
        "attn.shared_key": SharedRotaryKey(),
    }
