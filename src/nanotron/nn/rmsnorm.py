"""Root-mean-square layer norm (Zhang & Sennrich, 2019), as in Llama."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x), computed in fp32 and cast back to the dtype of ``x``."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Normalises in fp32 whatever the activation dtype, then scales, like Hugging Face's Llama.

    Computing the statistics in fp32 keeps bf16 training stable; the cast back happens before the weight multiply so
    the result matches the reference implementation bit for bit in the same dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)
