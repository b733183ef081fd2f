"""The FP8 linear: ``FP8Matmul``, a ``Linear.matmul`` whose forward and two backward products run on FP8 operands
(the activations and weights in e4m3, the output gradient in e5m2 or e4m3), each dequantised to the input dtype;
master weights, gradient accumulation and the optimizer never see FP8.

- On a GPU with FP8 tensor cores (compute capability 8.9+) the products are ``torch._scaled_mm``
  (``fp8_mm``); elsewhere an emulation takes the same casts and scales and multiplies in fp32, so the CPU tests check
  the GPU path's numerics. A GPU without FP8 matmuls is told once that FP8 is emulated (``warn_if_emulated``).
- ``torch._scaled_mm`` needs every dimension a multiple of 16: other operands are padded with zeros.
- With per-row scales it gives only a bf16 output on Ada and sm_100+ GPUs: those products are made in bf16, then
  cast, on every device.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from nanotron.nn.fp8.casts import quantize, quantize_both_layouts
from nanotron.nn.fp8.scaling import (
    E4M3,
    E5M2,
    GRADIENT,
    INPUT,
    WEIGHT,
    AmaxHistory,
    FP8RangeCounts,
    FP8Recipe,
    SplitFeatures,
    tensor_amax,
)

logger = logging.getLogger(__name__)


def _has_fp8_matmuls(device: torch.device) -> bool:
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def warn_if_emulated(device: torch.device) -> None:
    """On a GPU without FP8 matmuls the products run the fp32 emulation: slower than the model dtype and without
    its memory saving, so the user is told. CPUs run the emulation by design (tests, debugging): nothing to say."""
    if device.type == "cuda" and not _has_fp8_matmuls(device):
        major, minor = torch.cuda.get_device_capability(device)
        logger.warning(f"fp8.enabled on {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}), "
                       "which has no FP8 matmuls (8.9+ needed): FP8 is emulated in fp32, slower than model.dtype; "
                       "set fp8.enabled: false on this GPU")


SCALED_MM_ALIGNMENT = 16  # torch._scaled_mm's requirement on the dimensions of its operands


def _padded(x: torch.Tensor, rows: int, columns: int, value: float = 0.0) -> torch.Tensor:
    """A 2-D ``x`` padded at its end to [rows, columns] with ``value`` (FP8 tensors with zeros, through a byte view:
    the float8 dtypes have no padding kernels, and zero is the all-zero byte in both formats)."""
    pad = (0, columns - x.shape[1], 0, rows - x.shape[0])
    if not any(pad):
        return x
    if x.dtype in (E4M3, E5M2):
        return nn.functional.pad(x.view(torch.uint8), pad).view(x.dtype)
    return nn.functional.pad(x, pad, value=value)


def fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
           out_dtype: torch.dtype, fast_accumulation: bool = False) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` for FP8 ``a`` [M, K] and ``b`` [K, N] with scales of shape [] or [M, 1]
    and [] or [1, N]. ``fast_accumulation`` lets the GPU accumulate in lower precision (the forward product only,
    as is usual: gradients keep the full fp32 accumulation).

    ``torch._scaled_mm`` wants every dimension a multiple of 16; other operands are padded with zeros (their scales
    with ones), which adds nothing to the product, and the result is cut back to [M, N]. (MoE experts align their
    token groups before the products: ``FP8Matmul.token_alignment``.) With per-row scales it takes only a bf16
    output on Ada and sm_100+ GPUs (an fp32 one only on sm_90, from cuBLAS 12.9): those products are made in bf16
    and upcast to ``out_dtype``, on every device, the emulation included."""
    product_dtype = torch.bfloat16 if a_scale.dim() or b_scale.dim() else out_dtype
    if not _has_fp8_matmuls(a.device):
        return ((a.float() / a_scale) @ (b.float() / b_scale)).to(product_dtype).to(out_dtype)
    (m, k), n = a.shape, b.shape[1]
    rows, inner, columns = (-(-d // SCALED_MM_ALIGNMENT) * SCALED_MM_ALIGNMENT for d in (m, k, n))
    # _scaled_mm takes a row-major and b column-major, and the dequantising (inverse) scales.
    a = _padded(a.contiguous(), rows, inner)
    b = _padded(b.t().contiguous(), columns, inner).t()
    a_scale = _padded(a_scale, rows, 1, 1.0) if a_scale.dim() else a_scale
    b_scale = _padded(b_scale, 1, columns, 1.0) if b_scale.dim() else b_scale
    out = torch._scaled_mm(a, b, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                           out_dtype=product_dtype, use_fast_accum=fast_accumulation)
    return out[:m, :n].to(out_dtype).contiguous()


def _scaling_amax(x: torch.Tensor, operand: int, dim: int | None, amaxes: AmaxHistory | None,
                  split: SplitFeatures | None) -> torch.Tensor | None:
    """The amax to scale ``x`` (the ``operand``, per tensor or along ``dim``) by; None where ``quantize`` may take
    ``x``'s own: the history's (``amaxes``, per tensor), or ``x``'s own maximised over the ranks ``split`` shares
    the tensor with when it spans the split."""
    if amaxes is not None:
        return amaxes.amax(operand, x, split)
    if split is None or not split.splits(operand, dim):
        return None
    own = tensor_amax(x) if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return split.max_over_ranks(own.float())


def _asked_for(ctx, index: int) -> bool:
    """Whether the running backward asks for the gradient of input ``index`` (one of the first, tensor, inputs): a
    backward split into the input's and the weights' parts (``parallel/split_backward.py``) asks for one at a time.
    A compiled layer's backward is traced whole, never split (asking the engine there would break the graph)."""
    if not ctx.needs_input_grad[index] or torch.compiler.is_compiling():
        return ctx.needs_input_grad[index]
    node = ctx.next_functions[index][0]
    return node is not None and torch._C._will_engine_execute_node(node)


class _FP8Linear(torch.autograd.Function):
    """The three FP8 products of a linear. Its backward computes only the gradients asked for (the input's, the
    weight's and bias's, or all), so that a split backward defers the weight's (``splits_weight_gradients``); a cast
    shared by both halves counts its range once, in the input's half where the input needs a gradient at all."""

    splits_weight_gradients = True

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: FP8Recipe,
                amaxes: AmaxHistory | None, ranges: FP8RangeCounts | None, split: SplitFeatures | None):
        ctx.recipe, ctx.has_bias, ctx.input_shape, ctx.amaxes = recipe, bias is not None, x.shape, amaxes
        ctx.ranges, ctx.split = ranges, split
        x2 = x.reshape(-1, x.shape[-1])
        dim = -1 if recipe.rowwise else None
        xq, x_scale = quantize(x2, E4M3, dim, _scaling_amax(x2, INPUT, dim, amaxes, split), ranges, INPUT)
        wq, w_scale = quantize(weight, E4M3, dim, _scaling_amax(weight, WEIGHT, dim, amaxes, split), ranges, WEIGHT)
        y = fp8_mm(xq, x_scale, wq.t(), w_scale.t(), x.dtype, fast_accumulation=True)
        if recipe.rowwise:  # the backward products reduce over other dims: quantise again from these
            ctx.save_for_backward(x2, weight)
        else:
            ctx.save_for_backward(xq, x_scale, wq, w_scale)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recipe, ranges, split = ctx.recipe, ctx.ranges, ctx.split
        g2 = grad.reshape(-1, grad.shape[-1])
        wants_input, wants_weight = _asked_for(ctx, 0), _asked_for(ctx, 1)
        grad_input = grad_weight = None
        if recipe.rowwise:
            x2, weight = ctx.saved_tensors

            def along(t: torch.Tensor, dtype: torch.dtype, dim: int, operand: int):
                return quantize(t, dtype, dim, _scaling_amax(t, operand, dim, None, split), ranges, operand)

            if wants_input:  # dx = g W: reduce over out features
                g_rows, g_row_scale = along(g2, recipe.gradient_dtype, -1, GRADIENT)
                w_cols, w_col_scale = along(weight, E4M3, 0, WEIGHT)
                grad_input = fp8_mm(g_rows, g_row_scale, w_cols, w_col_scale, grad.dtype)
            if wants_weight:  # dW = gᵀ x: reduce over tokens
                g_cols, g_col_scale = along(g2, recipe.gradient_dtype, 0, GRADIENT)
                x_cols, x_col_scale = along(x2, E4M3, 0, INPUT)
                grad_weight = fp8_mm(g_cols.t(), g_col_scale.t(), x_cols, x_col_scale, grad.dtype)
        else:
            xq, x_scale, wq, w_scale = ctx.saved_tensors
            amaxes = ctx.amaxes
            if wants_weight and not wants_input and ctx.needs_input_grad[0]:
                ranges = None  # the input's half counted this cast
            if ranges is None:  # both layouts in one pass (counting the cast's range needs the scaled tensor)
                amax = None if amaxes is None else amaxes.recorded_amax(GRADIENT)
                if amax is None:
                    amax = _scaling_amax(g2, GRADIENT, None, None, split)
                gq, gq_t, g_scale, seen = quantize_both_layouts(g2, recipe.gradient_dtype, amax)
                if amaxes is not None:
                    amaxes.record(GRADIENT, seen)
            else:
                amax = _scaling_amax(g2, GRADIENT, None, amaxes, split)
                gq, g_scale = quantize(g2, recipe.gradient_dtype, None, amax, ranges, GRADIENT)
                gq_t = gq.t()
            if wants_input:
                grad_input = fp8_mm(gq, g_scale, wq, w_scale, grad.dtype)
            if wants_weight:
                grad_weight = fp8_mm(gq_t, g_scale, xq, x_scale, grad.dtype)
        grad_bias = g2.sum(0) if ctx.has_bias and _asked_for(ctx, 2) else None
        grad_input = None if grad_input is None else grad_input.view(ctx.input_shape)
        return grad_input, grad_weight, grad_bias, None, None, None, None


class FP8Matmul:
    """A ``Linear.matmul``: ``F.linear``'s signature, FP8 products inside; ``amaxes`` for delayed scaling,
    ``ranges`` to count the casts' saturated and flushed values, ``split`` for a tensor-parallel linear's slices.
    ``token_alignment`` asks MoE experts to pad each expert's tokens to a multiple of ``torch._scaled_mm``'s
    alignment (``GroupedExperts``)."""

    token_alignment = SCALED_MM_ALIGNMENT

    def __init__(self, recipe: FP8Recipe, amaxes: AmaxHistory | None = None, ranges: FP8RangeCounts | None = None,
                 split: SplitFeatures | None = None):
        self.recipe, self.amaxes, self.ranges, self.split = recipe, amaxes, ranges, split

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() == 0:  # an expert without tokens: nothing to scale
            return torch.nn.functional.linear(x, weight, bias)
        return _FP8Linear.apply(x, weight, bias, self.recipe, self.amaxes, self.ranges, self.split)
