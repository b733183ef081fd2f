"""FP8 MoE experts: their two products, gate|up then down, each as one grouped GEMM over all experts
(``torch._scaled_grouped_mm``), with no loop over experts and no host sync.

- The op runs on an sm_90 GPU and takes e4m3 operands with rowwise scales only: the experts use that recipe on
  every path (``FP8ExpertMatmul``), whatever ``fp8.recipe`` and ``fp8.gradient_format`` say for the linears, and
  scale from the current amax under ``delayed`` too (they keep no history). Elsewhere the CPU emulates it from the
  same casts and scales; other GPUs, and widths not a multiple of 16, take a loop of per-expert ``FP8Matmul``
  products with the same recipe.
- Each product is scaled along its reduced dimension: the forward per token and per (expert, output row); the input
  gradient per token of the output gradient and per (expert, input column) of the weight; the weight gradient
  ``dW_e = g_eᵀ x_e`` per (expert, feature) over expert e's tokens only (``quantize_per_group``): scaled over all
  tokens, one expert's large values would flush another's to zero.
- Each expert's tokens are padded to a multiple of 16 rows (the weight gradient's reduced dimension must be 16-byte
  aligned), in a buffer whose size depends on the token count only. On CUDA the backward's casts are Triton kernels
  (``cast_kernels.cast_per_group``).
"""

from __future__ import annotations

import torch

from nanotron.nn.fp8 import cast_kernels
from nanotron.nn.fp8.casts import quantize
from nanotron.nn.fp8.linear import FP8Matmul
from nanotron.nn.fp8.scaling import E4M3, GROUPED_ALIGNMENT, FP8RangeCounts, FP8Recipe, fp8_scale
from nanotron.nn.kernels import available

EXPERTS_RECIPE = FP8Recipe(E4M3, rowwise=True)  # the only scaling and format torch._scaled_grouped_mm takes


def _runs_scaled_grouped_mm(device: torch.device) -> bool:
    """Where ``torch._scaled_grouped_mm`` runs: an sm_90 GPU, and meta tensors (its shape and layout checks)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return device.type == "meta" or (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


def group_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each of ``rows`` rows, for the int32 cumulative group ends ``offsets`` (on the device)."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


@torch.library.custom_op("nanotron::fp8_grouped_mm_emulation", mutates_args=())
def _emulated_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_grouped_mm``'s products on dequantised fp32 operands, one group at a time in fp32, returned in
    bf16 as the op returns them: rows of ``a`` grouped against ``b`` [groups, K, N], or the reduced dimension grouped
    (``a`` [M, T], ``b`` [T, N]) giving [groups, M, N]. An opaque op, so that the compiler traces neither its loop nor
    its read of the offsets, and keeps the bf16 rounding (fused, a cast to bf16 and back is not rounded)."""
    ends = offsets.tolist()
    spans = list(zip([0, *ends[:-1]], ends))
    if b.dim() == 3:
        out = torch.cat([a[start:end] @ b[group] for group, (start, end) in enumerate(spans)])
    else:
        out = torch.stack([a[:, start:end] @ b[start:end] for start, end in spans])
    return out.to(torch.bfloat16)


@_emulated_grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1], dtype=torch.bfloat16)
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[-1], dtype=torch.bfloat16)


def fp8_grouped_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   offsets: torch.Tensor, out_dtype: torch.dtype, fast_accumulation: bool = False) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` with ``fp8_mm``'s conventions (scales multiply to quantise; the product is bf16,
    then cast to ``out_dtype``), for e4m3 operands in its layouts: ``a`` row-major, ``b`` column-major, ``offsets``
    the int32 cumulative ends of the groups, the last one covering every row. Two forms:

    - ``a`` [M, K] with its rows grouped, ``b`` [groups, K, N]; scales [M] and [groups, N]; gives [M, N];
    - ``a`` [M, T] and ``b`` [T, N] with T grouped; scales [groups * M] and [groups * N] (group-major), one per
      (group, row of ``a``) and (group, column of ``b``); gives [groups, M, N].

    The op runs on an sm_90 GPU, and on meta tensors (its shape, layout and dtype checks, which CPU tests use to
    check the calls made on the GPU). Elsewhere an emulation takes the same FP8 values and scales, dequantises them
    and multiplies each group in fp32, as ``fp8_mm``'s emulation does."""
    if _runs_scaled_grouped_mm(a.device):
        return torch._scaled_grouped_mm(a, b, a_scale.reciprocal(), b_scale.reciprocal(), offs=offsets,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast_accumulation).to(out_dtype)
    groups = offsets.shape[0]
    if b.dim() == 3:
        a32, b32 = a.float() / a_scale[:, None], b.float() / b_scale[:, None, :]
    else:
        group = group_of_rows(offsets, a.shape[1])
        a32 = a.float() / a_scale.view(groups, -1)[group].t()
        b32 = b.float() / b_scale.view(groups, -1)[group]
    return _emulated_grouped_mm(a32, b32, offsets).to(out_dtype)


def quantize_per_group(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, features] cast to ``dtype`` with one scale per (group, feature) from the amax over that group's
    rows only: the scaling of a product that sums over each group's rows (an expert's weight gradient sums over its
    tokens). Scaled over all rows, one expert's large values would push every other expert's towards FP8's
    subnormals and zero. Groups are whole blocks of ``GROUPED_ALIGNMENT`` rows: the amax is taken per block, then per
    group by one scatter, with no host sync. Returns the FP8 tensor and the scales [groups, features]."""
    rows, features = x.shape
    blocks = x.float().view(rows // GROUPED_ALIGNMENT, GROUPED_ALIGNMENT, features)
    block_group = group_of_rows(offsets, rows)[::GROUPED_ALIGNMENT]
    amax = blocks.new_zeros(offsets.shape[0], features).scatter_reduce(
        0, block_group[:, None].expand(-1, features), blocks.abs().amax(1), "amax")
    xq, _ = quantize(blocks, dtype, amax=amax[block_group][:, None])
    return xq.view(rows, features), fp8_scale(amax, dtype)


def quantize_for_grouped_backward(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool = False
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``x`` [rows, features] (grouped by ``offsets``) cast as the grouped backward's products take it: per (group,
    feature) (``quantize_per_group``) and transposed, [features, rows] row-major (the weight gradient's product
    reduces over the rows), with scales [groups, features]; and where ``rowwise`` (the output gradient, an operand of
    the input gradient's product too) also per row over all features, row-major, with scales [rows] (else None).

    On CUDA ``cast_per_group`` reads ``x`` twice, for the amaxes and for both casts, where the compiled plain-torch
    casts ran about ten kernels with a gather and transposed copies."""
    if available(x.device):
        out_t, column_scale, out, row_scale = cast_kernels.cast_per_group(x[None], offsets, dtype, rowwise)
        return out_t[0], column_scale[0], out[0] if rowwise else None, row_scale[0] if rowwise else None
    return quantize_for_grouped_backward_reference(x, offsets, dtype, rowwise)


def quantize_for_grouped_backward_reference(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype,
                                            rowwise: bool = False
                                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                       torch.Tensor | None]:
    """``quantize_for_grouped_backward``'s plain-torch casts, on every device (the kernels' reference)."""
    columns, column_scale = quantize_per_group(x, offsets, dtype)
    out = row_scale = None
    if rowwise:
        out, row_scale = quantize(x, dtype, -1)
        row_scale = row_scale.squeeze(-1)
    return columns.t().contiguous(), column_scale, out, row_scale


def quantize_weight_columns(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [groups, out, in] cast with one scale per (group, input column) over the output rows, written
    transposed, [groups, in, out] row-major (the input gradient's product takes it column-major), with scales
    [groups, in]. On CUDA by ``cast_per_group``, each group a matrix of one group of rows."""
    if available(weight.device):
        ends = torch.full((1,), weight.shape[1], dtype=torch.int32, device=weight.device)
        out_t, scale, _, _ = cast_kernels.cast_per_group(weight, ends, dtype, False)
        return out_t, scale[:, 0]
    return quantize_weight_columns_reference(weight, dtype)


def quantize_weight_columns_reference(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_weight_columns``'s plain-torch cast, on every device (the kernel's reference)."""
    wq, scale = quantize(weight.transpose(-2, -1), dtype, -1)
    return wq.contiguous(), scale.squeeze(-1)


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``y_g = x_g W_gᵀ`` for every group g of ``x``'s rows (an expert's tokens) at once, ``weight`` [groups, out,
    in], as three grouped FP8 products with rowwise scales along each product's reduced dimension: the forward's x
    per token and W per (expert, output row); the input gradient's g per token and W per (expert, input column); the
    weight gradient's g and x per (expert, feature) over the expert's own tokens (``quantize_per_group``). On CUDA
    the backward's casts are Triton kernels (``quantize_for_grouped_backward``, ``quantize_weight_columns``).

    The forward's casts are plain torch, which the compiler fuses with the ops before them; the product and the
    backward are opaque ops with the gradient registered, not an ``autograd.Function``: compiled on an H200 (torch
    2.11) that function's output came out detached from its backward, every expert's gradient zero. The CUDA tests
    check the compiled gradients against eager's."""
    xq, x_scale = quantize(x.detach(), E4M3, -1)
    wq, w_scale = quantize(weight.detach(), E4M3, -1)
    return _grouped_linear(x, weight, offsets, xq, x_scale.squeeze(-1), wq, w_scale.squeeze(-1))


def grouped_linear_product(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                           offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``fp8_grouped_linear``'s forward product of the cast ``x`` and ``weight`` (per row), on meta tensors too."""
    return fp8_grouped_mm(xq, x_scale, wq.transpose(-2, -1), w_scale, offsets, out_dtype, fast_accumulation=True)


def grouped_linear_gradient_products(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_grouped_linear``'s backward: the input and weight gradients' casts and grouped products."""
    g_cols_t, g_col_scale, g_rows, g_row_scale = quantize_for_grouped_backward(grad, offsets, E4M3, True)
    x_cols_t, x_col_scale, _, _ = quantize_for_grouped_backward(x, offsets, E4M3, False)
    w_cols_t, w_col_scale = quantize_weight_columns(weight, E4M3)
    # dx_g = g_g W_g: reduce over the output features.
    grad_input = fp8_grouped_mm(g_rows, g_row_scale, w_cols_t.transpose(-2, -1), w_col_scale, offsets, grad.dtype)
    # dW_g = g_gᵀ x_g: reduce over the group's tokens.
    grad_weight = fp8_grouped_mm(g_cols_t, g_col_scale.flatten(), x_cols_t.t(), x_col_scale.flatten(), offsets,
                                 grad.dtype)
    return grad_input, grad_weight


@torch.library.custom_op("nanotron::fp8_grouped_linear", mutates_args=())
def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, xq: torch.Tensor,
                    x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The forward product of ``x`` and ``weight`` cast (``xq``, ``wq`` and their scales), the gradient flowing to
    ``x`` and ``weight``."""
    return grouped_linear_product(xq, x_scale, wq, w_scale, offsets, x.dtype)


@_grouped_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, xq: torch.Tensor, x_scale: torch.Tensor,
      wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("nanotron::fp8_grouped_linear_backward", mutates_args=())
def _grouped_linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_linear_gradient_products(grad, x, weight, offsets)


@_grouped_linear_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _save_grouped_linear_inputs(ctx, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:3])  # x, weight, offsets: the backward casts them its own ways


def _grouped_linear_gradients(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return (*_grouped_linear_backward(grad, *ctx.saved_tensors), None, None, None, None, None)


_grouped_linear.register_autograd(_grouped_linear_gradients, setup_context=_save_grouped_linear_inputs)


class FP8ExpertMatmul(FP8Matmul):
    """MoE experts' ``expert_matmul``: rowwise scales and e4m3 gradients, whatever ``fp8.recipe`` and
    ``fp8.gradient_format`` say for the linears, because ``torch._scaled_grouped_mm`` takes only those; every path
    of the experts then rounds alike. ``grouped`` runs one product for all experts (``fp8_grouped_linear``) where
    ``groups`` says so; elsewhere the experts' loop calls it per expert (``FP8Matmul``: ``torch._scaled_mm``)."""

    token_alignment = GROUPED_ALIGNMENT

    def __init__(self, ranges: FP8RangeCounts | None = None):
        super().__init__(EXPERTS_RECIPE, ranges=ranges)

    def groups(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """Whether ``grouped`` runs for ``x`` and these [experts, out, in] weights: on a GPU with
        ``torch._scaled_grouped_mm`` (sm_90), on the CPU (its emulation) and on the meta device (its checks), with
        every feature dimension a multiple of ``GROUPED_ALIGNMENT`` (the op's demand; the loop pads the others).
        While ``ranges`` counts the casts' ranges (``fp8.log_out_of_range``, a diagnostic) the loop runs: it counts
        every cast of the same values, and the grouped op takes tensors only."""
        return (self.ranges is None and (x.device.type == "cpu" or _runs_scaled_grouped_mm(x.device))
                and all(d % GROUPED_ALIGNMENT == 0 for w in weights for d in w.shape[1:]))

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, in] grouped by ``offsets`` (int32 cumulative ends, each group a multiple of
        ``GROUPED_ALIGNMENT`` rows, the last ending at the last row) times each group's ``weight`` [out, in]ᵀ."""
        return fp8_grouped_linear(x, weight, offsets)
