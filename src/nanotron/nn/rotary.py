"""Rotary position embedding (RoPE) in the Hugging Face, non-interleaved convention.

Each head vector of size d is split into two halves; position p rotates the pair (x[i], x[i + d/2]) by the angle
p * theta^(-2i/d). Checkpoints converted to or from Hugging Face Llama need exactly this convention.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Computes the cos/sin tables for given positions; holds no trainable state."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin of shape [batch, seq, head_dim] (or [seq, head_dim] for 1-D positions)."""
        exponent = torch.arange(0, self.head_dim, 2, device=position_ids.device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)
        angles = position_ids.float()[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [batch, heads, seq, head_dim]; cos/sin broadcast over heads."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin
