"""Rotary position embedding (RoPE) in the Hugging Face, non-interleaved convention, with optional scaling.

Each head vector of size d is split into two halves; position p rotates the pair (x[i], x[i + d/2]) by the angle
p * inv_freq[i], inv_freq[i] = theta^(-2i/d). Checkpoints converted to or from Hugging Face Llama need exactly this
convention. Scaling (``rope_scaling``, for longer contexts) rescales inv_freq the way ``transformers`` does, so that
converted Llama 3.1+ checkpoints compute the same angles: ``linear`` divides every frequency by ``factor``, ``llama3``
only those whose wavelength exceeds the pretraining context / low_freq_factor, keeps those below context /
high_freq_factor and blends the band in between; ``yarn`` (DeepSeek-V3) blends interpolated and original
frequencies over the dimensions between ``beta_fast`` and ``beta_slow`` rotations of the pretraining context and
multiplies the tables by YaRN's attention factor (``yarn_attention_factor``), as transformers does.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict | None) -> float:
    """What the cos/sin tables are multiplied by: YaRN's mscale (the ratio of ``mscale``'s to ``mscale_all_dim``'s
    where both are set, as DeepSeek's models write them); 1 for every other scaling."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    factor, mscale, mscale_all_dim = scaling["factor"], scaling["mscale"], scaling["mscale_all_dim"]
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_inv_freq(inv_freq: torch.Tensor, theta: float, scaling: dict) -> torch.Tensor:
    """Each frequency between its interpolation (``/ factor``) and itself: dimensions that turn fewer than
    ``beta_slow`` times over the pretraining context are interpolated, more than ``beta_fast`` kept, a linear ramp
    between (the bounds floored and ceiled, as transformers' default ``truncate``)."""
    dim = 2 * inv_freq.shape[0]
    context = scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dimension(scaling["beta_fast"])), 0)
    high = min(math.ceil(dimension(scaling["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low if high != low else 0.001)).clamp(0, 1)
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1 - ramp)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict | None, theta: float = 10000.0) -> torch.Tensor:
    """``inv_freq`` (of base ``theta``) rescaled by a validated ``rope_scaling`` dict (None: unchanged)."""
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(inv_freq, theta, scaling)
    context = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)  # 0 at the low-frequency edge, 1 at the high one
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    in_band = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Computes the cos/sin tables for given positions; holds no trainable state. The tables of a sequence that
    starts at position 0 (every training step's) are kept per length and device (``first_positions``)."""

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self._first_positions: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def first_positions(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of positions 0 .. ``length`` - 1, computed on the first call for this length and device and
        kept: every training forward asks for the same ones. Made outside inference mode, so that a table first
        asked for by an evaluation can serve a training step's autograd."""
        key = (length, torch.device(device))
        if key not in self._first_positions:
            with torch.inference_mode(False), torch.no_grad():
                self._first_positions[key] = self(torch.arange(length, device=device))
        return self._first_positions[key]

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin of shape [batch, seq, head_dim] (or [seq, head_dim] for 1-D positions)."""
        exponent = torch.arange(0, self.head_dim, 2, device=position_ids.device, dtype=torch.float32) / self.head_dim
        inv_freq = scaled_inv_freq(1.0 / (self.theta**exponent), self.scaling, self.theta)
        angles = position_ids.float()[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        factor = yarn_attention_factor(self.scaling)
        if factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * factor, angles.sin() * factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [batch, heads, seq, head_dim]; cos/sin broadcast over heads."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin
