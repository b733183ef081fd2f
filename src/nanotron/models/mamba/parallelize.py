"""How Mamba is parallelised: every mixer split over tensor-parallel ranks by channels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nanotron.config import MambaConfig
from nanotron.layout import Axis
from nanotron.models.mamba.model import MambaMixer
from nanotron.nn.causal_conv1d import CausalConv1d
from nanotron.parallel.placement import Shard
from nanotron.parallel.tensor_parallel import (
    ALL_REDUCE,
    Column,
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelNorm,
    Style,
    VocabEmbedding,
)


class _ChannelShardedConv1d(CausalConv1d):
    """A depthwise convolution over this rank's channels (each channel has its own kernel and bias)."""

    def __init__(self, channels: int, kernel_size: int, bias: bool, tp: int):
        super().__init__(channels // tp, kernel_size, bias)
        self.parameter_shards = {"weight": ((channels, 1, kernel_size), (Shard(Axis.TP, 0),))}
        if bias:
            self.parameter_shards["bias"] = ((channels,), (Shard(Axis.TP, 0),))


class TensorParallelMambaMixer(MambaMixer):
    """A Mamba mixer split over TP by channels, every channel's state on one rank (as Megatron-LM splits Mamba).

    in_proj is column-parallel (each rank's slice of x and of the gate z, the sequence gathered first in
    sequence-parallel mode); conv1d, dt_proj's outputs, A_log and D are this rank's channels; x_proj is
    row-parallel and always all-reduced, since every rank's scan needs the whole dt, B and C; out_proj is
    row-parallel like an attention output (reduce-scattered to a sequence shard in sequence-parallel mode).
    """

    def __init__(self, mixer: MambaMixer, group: dist.ProcessGroup, mode: str):
        nn.Module.__init__(self)
        tp = group.size()
        self.d_state, self.d_conv, self.dt_rank = mixer.d_state, mixer.d_conv, mixer.dt_rank
        d_model, d_inner = mixer.in_proj.in_features, mixer.D.shape[0]
        if mixer.in_proj.bias is not None or mixer.out_proj.bias is not None:
            raise ValueError("tensor parallelism of a Mamba mixer with in_proj/out_proj biases is not supported")
        self.in_proj = ColumnParallelLinear(d_model, 2 * d_inner, group, mode, chunks=(d_inner, d_inner))
        self.conv1d = _ChannelShardedConv1d(d_inner, self.d_conv, mixer.conv1d.bias is not None, tp)
        self.x_proj = RowParallelLinear(d_inner, mixer.x_proj.out_features, group, ALL_REDUCE)
        self.dt_proj = ColumnParallelLinear(self.dt_rank, d_inner, group, ALL_REDUCE, bias=True)
        self.A_log = nn.Parameter(torch.empty(d_inner // tp, self.d_state))
        self.D = nn.Parameter(torch.empty(d_inner // tp))
        self.parameter_shards = {"A_log": ((d_inner, self.d_state), (Shard(Axis.TP, 0),)),
                                 "D": ((d_inner,), (Shard(Axis.TP, 0),))}
        self.out_proj = RowParallelLinear(d_inner, d_model, group, mode)


@dataclass(frozen=True)
class SelectiveStateSpace(Style):
    def parallelize(self, module, group, mode, overlap):
        return TensorParallelMambaMixer(module, group, mode)


def mamba_plan(config: MambaConfig) -> dict[str, Style]:
    """Every mixer split by channels (``TensorParallelMambaMixer``); the block norms and the final norm see sequence
    shards in sequence-parallel mode."""
    return {"embed_tokens": VocabEmbedding(), "mixer": SelectiveStateSpace(), "norm": SequenceParallelNorm(),
            "lm_head": Column()}
