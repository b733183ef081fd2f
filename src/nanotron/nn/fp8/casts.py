"""The casts to FP8 that the products take, in plain torch on every device: ``quantize`` scales a tensor (per tensor,
per slice along a dimension, or by a given amax) and casts it. On CUDA the output gradient's cast in both layouts is
one Triton kernel (``cast_kernels.cast_both_layouts``), bit for bit the plain cast, which stays its reference."""

from __future__ import annotations

import torch

from nanotron.nn.fp8 import cast_kernels
from nanotron.nn.fp8.scaling import INPUT, FP8RangeCounts, fp8_scale, tensor_amax
from nanotron.nn.kernels import available


def quantize(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None, amax: torch.Tensor | None = None,
             ranges: FP8RangeCounts | None = None, operand: int = INPUT) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to the float8 ``dtype`` after scaling by ``fp8_max / amax`` (over the whole tensor, or along
    ``dim`` with one scale per slice; or the given ``amax``: values beyond it saturate); returns the FP8 tensor and
    the fp32 scale (kept dims for ``dim``); ``ranges`` records the cast in its ``operand``'s row."""
    x32 = x.float()
    if amax is None:
        amax = tensor_amax(x32) if dim is None else x32.abs().amax(dim=dim, keepdim=True)
    finfo = torch.finfo(dtype)
    scale = fp8_scale(amax, dtype)
    scaled = x32 * scale
    if ranges is not None:
        ranges.record(operand, x32, scaled, dtype)
    return scaled.clamp(finfo.min, finfo.max).to(dtype), scale


def quantize_both_layouts(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize`` per tensor of a 2-D ``x``, in both layouts: returns the FP8 tensor, the same transposed (row-major:
    the weight gradient's product needs the tokens contiguous), the scale, and ``x``'s own amax (to record when the
    scale came from a given ``amax``: a history's, or one maximised over tensor-parallel ranks). On CUDA one Triton
    kernel reads each tile of ``x`` once and writes both layouts from it, where the compiler's kernel with a
    transposed store ran at 60% of the bandwidth (docs/benchmarks.md)."""
    if available(x.device):
        from_history = amax is not None  # else the amax is reduced first, and the kernel need not record it again
        if not from_history:
            amax = tensor_amax(x).float()
        scale = torch.finfo(dtype).max / amax.clamp(min=1e-12)
        out, out_t, seen = cast_kernels.cast_both_layouts(x, scale, dtype, record_amax=from_history)
        return out, out_t, scale, seen if from_history else amax
    seen = tensor_amax(x).float()
    out, scale = quantize(x, dtype, amax=seen if amax is None else amax)
    return out, out.t().contiguous(), scale, seen
