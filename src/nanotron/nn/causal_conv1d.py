"""Mamba's depthwise causal convolution over time, on channels-last activations [batch, length, channels].

Written as ``kernel_size`` shifted multiply-adds in fp32 rather than ``F.conv1d``: the mixer's activations are
channels-last on both sides of the convolution, so this needs no transposes, and under ``torch.compile`` the
shifts, bias, the mixer's SiLU and its masking fuse into one kernel each way, where cuDNN's depthwise convolution
runs as separate kernels around two transposed copies. ``F.conv1d`` on the transposed input is the reference the
tests compare against.
"""

from __future__ import annotations

import torch
from torch import nn


class CausalConv1d(nn.Module):
    """Each channel's own ``kernel_size`` filter over its last inputs; ``weight`` [channels, 1, kernel_size] as
    ``nn.Conv1d(channels, channels, kernel_size, groups=channels)`` keeps it (and Hugging Face checkpoints)."""

    def __init__(self, channels: int, kernel_size: int, bias: bool):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    def forward(self, padded: torch.Tensor) -> torch.Tensor:
        """``padded`` [batch, kernel_size - 1 + length, channels]: the inputs preceded by the ``kernel_size - 1``
        before them (zeros at the start of a sequence). Output t sees inputs t - kernel_size + 1 .. t."""
        length = padded.shape[1] - (self.kernel_size - 1)
        weight = self.weight.float()
        out = sum(padded[:, k:k + length].float() * weight[:, 0, k] for k in range(self.kernel_size))
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(padded.dtype)
