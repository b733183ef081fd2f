"""FP8 matmuls for linear layers and MoE experts, forward and backward, plugged in through ``Linear.matmul``.

- Each product (the output, and the input and weight gradients) runs on FP8 operands scaled to fill the format's
  range, and its result is dequantised to the input dtype; master weights, gradient accumulation and the optimizer
  never see FP8. The embedding and the LM head stay in the model dtype.
- Every rank scales as one process holding the whole tensors would, at any layout (``scaling``).
- Off a GPU with FP8 matmuls the products are emulated from the same casts and scales, so the CPU tests check the
  numerics of the GPU path.

One module per concern: ``scaling`` (formats, recipes, amax histories, range counts), ``casts`` (the casts to FP8,
in plain torch), ``cast_kernels`` (the same casts as Triton kernels, and their tiles), ``linear`` (the linear's
autograd function and the ``torch._scaled_mm`` seam), ``grouped`` (MoE experts' grouped GEMMs), ``convert`` (the
model converter). Measurements of the casts and products: docs/benchmarks.md.
"""

from nanotron.nn.fp8.casts import quantize
from nanotron.nn.fp8.convert import fp8_converter
from nanotron.nn.fp8.grouped import FP8ExpertMatmul, group_of_rows, quantize_per_group
from nanotron.nn.fp8.linear import FP8Matmul, warn_if_emulated
from nanotron.nn.fp8.scaling import (
    AMAX_HISTORY_SUFFIX,
    E4M3,
    E5M2,
    GRADIENT,
    GROUPED_ALIGNMENT,
    INPUT,
    OPERANDS,
    AmaxHistory,
    FP8RangeCounts,
    FP8Recipe,
    advance_amax_histories,
    discard_step_amaxes,
    refresh_filled_histories,
)

__all__ = [
    "AMAX_HISTORY_SUFFIX", "E4M3", "E5M2", "GRADIENT", "GROUPED_ALIGNMENT", "INPUT", "OPERANDS", "AmaxHistory",
    "FP8ExpertMatmul", "FP8Matmul", "FP8RangeCounts", "FP8Recipe", "advance_amax_histories", "discard_step_amaxes",
    "fp8_converter", "group_of_rows", "quantize", "quantize_per_group", "refresh_filled_histories",
    "warn_if_emulated",
]
