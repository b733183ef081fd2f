"""FP8 matmuls for linear layers, forward and backward, plugged in through ``Linear.matmul``.

``y = x Wᵀ`` runs on FP8 operands: the activations and weights in e4m3, the output gradient in e5m2 (or e4m3), each
scaled from its current absolute maximum so that it fills the format's range (``fp8_max / amax``). The three
products (the output, and the input and weight gradients in the backward) are FP8 matmuls whose results are
dequantised to the input dtype; master weights, gradient accumulation and the optimizer never see FP8.

Scaling is per tensor (``tensorwise``) or per row of each operand along the reduced dimension (``rowwise``: one
scale per token and per output feature in the forward, re-derived along the other dimension for each backward
product, at the price of quantising from the high-precision tensors again). ``delayed`` scales per tensor from the
largest amax of the last ``amax_history_length`` optimizer steps (``AmaxHistory``, one per linear, saved in
checkpoints), as Transformer Engine does: each step records the amaxes it meets, and between steps the FP8 feature
(``features/fp8.py``) takes their maximum over the data- and tensor-parallel ranks (``parallel/statistics.py``)
before pushing it into the history, so every rank, and every layout, uses the same scales. Until an operand has a
history (its first step) the current amax is used. Which operands have one is known on the host
(``AmaxHistory.filled``), so that a scale from the history does not depend on the tensor it scales: the compiler
then casts in one pass over the tensor, recording its amax on the way, where a current amax needs a reduction before
the cast can start.

Under tensor parallelism a linear's operands are split over ranks (the weight along one feature dimension, the
input or the output gradient along the other). An amax taken along a split dimension (any, for a per-tensor scale;
the reduced one, for a per-row scale) is maximised over those ranks before it scales (``SplitFeatures``, one small
all-reduce per such cast), so that each rank scales its slice exactly as tp=1 scales the whole tensor. Scaled by
its own slice's amax, each rank would round its slice to other FP8 values than tp=1 does, and tp=2 would drift from
tp=1 by FP8's rounding error (2^-4 relative in e4m3) rather than by the reduction order's.

With ``fp8.log_out_of_range`` each converted linear also counts, per operand, the values its casts saturated (beyond
the format's largest finite value: only scales from a history can meet that) and flushed to zero (at most half the
format's smallest subnormal: small values next to a large amax), in ``FP8RangeCounts``; the FP8 feature reports
them as shares of all cast values after every step.

On a GPU with FP8 tensor cores (compute capability 8.9+) the products are ``torch._scaled_mm``. Elsewhere an
emulation quantises exactly the same way (the same scales, the same casts to the float8 dtypes) and multiplies the
dequantised values in fp32, so the CPU tests exercise the numerics of the GPU path. ``torch._scaled_mm`` needs
every dimension to be a multiple of 16; other products (MoE experts' token counts) are padded with zeros.

MoE experts (``FP8ExpertMatmul``) run their two products, gate|up then down, each as one grouped GEMM over all
experts (``torch._scaled_grouped_mm``: an sm_90 GPU; the CPU emulates it as above, from the same casts and scales),
with no loop over experts and no host sync. That op takes e4m3 operands and rowwise scales only, so the experts use
that recipe on every path, whatever ``fp8.recipe`` and ``fp8.gradient_format`` say for the linears: the forward
scales each token and each (expert, output row) along the input features; the input gradient each token of the
output gradient and each (expert, input column) of the weight along the output features; the weight gradient
``dW_e = g_eᵀ x_e`` sums over expert e's tokens only, so both operands are scaled per (expert, feature) over those
tokens (``quantize_per_group``): scaled over all tokens, one expert's large values would flush another's to zero.
Each expert's tokens are padded to a multiple of 16 rows (the weight gradient's reduced dimension must be 16-byte
aligned), in a buffer whose size depends on the token count only. On CUDA the backward casts each operand with two
Triton kernels (``cast_per_group``: the amaxes, then each tile read once and written in both layouts). Where the
grouped op does not run (other GPUs, widths not a multiple of 16) the experts take a loop of per-expert products
(``FP8Matmul``) with the same recipe.
Under the ``delayed`` recipe too the experts scale from the current amax: they keep no history.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanotron.nn.kernels import available, tl, triton, triton_op, wrap_triton

logger = logging.getLogger(__name__)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


@dataclass(frozen=True)
class FP8Recipe:
    gradient_dtype: torch.dtype = E5M2
    rowwise: bool = False
    delayed: bool = False


INPUT, WEIGHT, GRADIENT = range(3)  # the rows of an AmaxHistory and of FP8RangeCounts
OPERANDS = ("input", "weight", "gradient")
# The dimensions of the 2-D operands: x [tokens, in], W [out, in], the output gradient g [tokens, out].
OPERAND_DIMS = {INPUT: ("tokens", "in"), WEIGHT: ("out", "in"), GRADIENT: ("tokens", "out")}


@dataclass(frozen=True)
class SplitFeatures:
    """The feature dimension that tensor parallelism splits a linear's operands along: ``"out"`` (column-parallel:
    the weight's rows, the output gradient's columns) or ``"in"`` (row-parallel: the input's and the weight's
    columns); ``max_over_ranks`` maximises an amax over the ranks holding the other slices, in place (a collective
    from ``parallel/``). An amax taken along a split dimension is maximised over them, so that every rank scales its
    slice as the whole tensor is scaled at tp=1 (see the module's docstring)."""

    features: str
    max_over_ranks: Callable[[torch.Tensor], torch.Tensor]

    def splits(self, operand: int, dim: int | None = None) -> bool:
        """Whether ``operand``'s amax, over the whole tensor (``dim`` None) or along ``dim``, spans the split."""
        dims = OPERAND_DIMS[operand]
        return self.features in (dims if dim is None else (dims[dim],))


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest absolute value of ``x``, reduced along its rows first: the compiler then writes a reduction over
    contiguous rows, where a reduction of the flattened tensor is split at offsets that cut rows (on an H200 that
    made the amax of SwiGLU's output take 0.34 ms, three times a read of its input)."""
    magnitudes = x.abs()
    return (magnitudes.amax(dim=-1) if x.dim() > 1 else magnitudes).amax()


AMAX_HISTORY_SUFFIX = "fp8_amaxes.history"  # how the checkpoint key of every linear's history ends


class AmaxHistory(nn.Module):
    """One linear's amaxes of its input, weight and output gradient: over the last optimizer steps (``history``,
    newest first, saved) and over the micro-batches of the current step (``current``). ``filled`` says, per operand,
    whether the history holds an amax yet: host state, refreshed between steps (``refresh_filled_histories``)."""

    def __init__(self, length: int):
        super().__init__()
        self.register_buffer("history", torch.zeros(3, length))
        self.register_buffer("current", torch.zeros(3), persistent=False)
        self.filled = (False, False, False)

    def amax(self, row: int, x: torch.Tensor, split: SplitFeatures | None = None) -> torch.Tensor:
        """The amax to scale ``x`` by: the history's largest, or before there is one ``x``'s own (maximised over the
        ranks that ``split`` shares the tensor with); ``x``'s own is recorded for this step."""
        current = tensor_amax(x).float()
        self.record(row, current)
        recorded = self.recorded_amax(row)
        if recorded is not None:
            return recorded
        return current if split is None or not split.splits(row) else split.max_over_ranks(current.clone())

    def recorded_amax(self, row: int) -> torch.Tensor | None:
        """The history's largest amax, or None while it holds none."""
        return self.history[row].amax() if self.filled[row] else None

    def record(self, row: int, amax: torch.Tensor) -> None:
        self.current[row] = torch.maximum(self.current[row], amax.detach())


@torch.no_grad()
def refresh_filled_histories(model: nn.Module) -> None:
    """Read back which operands' histories hold an amax (one host sync): after the histories were loaded, and
    after steps that pushed them while some were empty. Once all are filled the flags stay set; a history empties
    only after its tensor was all zeros for the history's length, and then the flag is wrong for one step."""
    histories = [module for module in model.modules() if isinstance(module, AmaxHistory)]
    if histories:
        filled = torch.stack([h.history.amax(dim=1) > 0 for h in histories]).tolist()
        for h, rows in zip(histories, filled):
            h.filled = tuple(rows)


@torch.no_grad()
def advance_amax_histories(model: nn.Module, reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """After an optimizer step: push every linear's step amaxes, maximised over ranks by ``reduce_max``, into its
    history and start the next step from zero. One collective for all linears, and a host sync only while some
    history is empty."""
    histories = [module for module in model.modules() if isinstance(module, AmaxHistory)]
    if not histories:
        return
    step = reduce_max(torch.stack([h.current for h in histories]))
    for h, amaxes in zip(histories, step):
        h.history.copy_(torch.cat([amaxes[:, None], h.history[:, :-1]], dim=1))
        h.current.zero_()
    if not all(all(h.filled) for h in histories):
        refresh_filled_histories(model)


@torch.no_grad()
def discard_step_amaxes(model: nn.Module) -> None:
    """A skipped step's amaxes (possibly inf or NaN) must not reach the histories."""
    for module in model.modules():
        if isinstance(module, AmaxHistory):
            module.current.zero_()


class FP8RangeCounts(nn.Module):
    """One linear's count of cast values per operand (rows as ``AmaxHistory``'s) since the last report: saturated,
    flushed to zero, and all of them."""

    def __init__(self):
        super().__init__()
        self.register_buffer("counts", torch.zeros(3, 3, dtype=torch.int64), persistent=False)

    def record(self, row: int, x: torch.Tensor, scaled: torch.Tensor, dtype: torch.dtype) -> None:
        """Count ``x``'s values (scaled to the format, ``scaled``) that its cast to ``dtype`` saturates (more than
        half a step beyond the largest finite value, which rounding alone cannot explain) or flushes (at most half
        the smallest subnormal: it rounds to zero, a tie going to the even zero)."""
        finfo = torch.finfo(dtype)
        top_step = 2.0 ** math.floor(math.log2(finfo.max)) * finfo.eps  # the spacing of the largest binade
        saturated = (scaled.abs() > finfo.max + top_step / 2).sum()
        flushed = ((scaled.abs() <= finfo.tiny * finfo.eps / 2) & (x != 0)).sum()
        self.counts[row] += torch.stack([saturated, flushed, saturated.new_tensor(x.numel())])


def fp8_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The factor that scales values up to ``amax`` onto the float8 ``dtype``'s range."""
    return torch.finfo(dtype).max / amax.clamp(min=1e-12)


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
        out, out_t, seen = cast_both_layouts(x, scale, dtype, record_amax=from_history)
        return out, out_t, scale, seen if from_history else amax
    seen = tensor_amax(x).float()
    out, scale = quantize(x, dtype, amax=seen if amax is None else amax)
    return out, out.t().contiguous(), scale, seen


if triton is not None:
    # A tile of 32 rows × 128 columns on 4 warps: of eight tiles timed on an H200 at the 1B model's gradient shapes,
    # within 8% of the fastest at each shape in every run (docs/benchmarks.md; the tiles differ by microseconds).
    CAST_BLOCK_R, CAST_BLOCK_C, CAST_WARPS = 32, 128, 4

    @triton.jit
    def _cast_both_layouts_kernel(x_ptr, scale_ptr, out_ptr, out_t_ptr, amax_ptr, rows, columns,
                                  FP8_MAX: tl.constexpr, RECORD_AMAX: tl.constexpr, BLOCK_R: tl.constexpr,
                                  BLOCK_C: tl.constexpr):
        # FP8_MAX is a compile-time constant: torch.compile passes a Python float argument as fp64, and Triton
        # cannot lower an fp64 clamp followed by a cast to FP8.
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < rows) & (c[None, :] < columns)
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * columns + c[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.clamp(x * tl.load(scale_ptr), -FP8_MAX, FP8_MAX).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + r[:, None].to(tl.int64) * columns + c[None, :], y, mask=mask)
        tl.store(out_t_ptr + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(y), mask=tl.trans(mask))
        if RECORD_AMAX:
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))  # non-negative floats: order-free

    @triton_op("nanotron::fp8_cast_both_layouts", mutates_args={})
    def cast_both_layouts(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, record_amax: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [rows, columns] times ``scale``, clamped and cast to ``dtype``, row-major and transposed, and
        ``x``'s amax in fp32 (zero unless ``record_amax``)."""
        rows, columns = x.shape
        out = torch.empty((rows, columns), dtype=dtype, device=x.device)
        out_t = torch.empty((columns, rows), dtype=dtype, device=x.device)
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(rows, CAST_BLOCK_R), triton.cdiv(columns, CAST_BLOCK_C))
        wrap_triton(_cast_both_layouts_kernel)[grid](x.contiguous(), scale, out, out_t, amax, rows, columns,
                                                     FP8_MAX=torch.finfo(dtype).max, RECORD_AMAX=record_amax,
                                                     BLOCK_R=CAST_BLOCK_R, BLOCK_C=CAST_BLOCK_C, num_warps=CAST_WARPS)
        return out, out_t, amax


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


# --- MoE experts: the two products of all experts as grouped GEMMs ------------------------------------------------

GROUPED_ALIGNMENT = 16  # torch._scaled_grouped_mm: every feature dimension, and every group's rows, a multiple of it
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


if triton is not None:
    # Tiles of whole 16-row blocks: GROUPED_BLOCKS blocks of GROUPED_ALIGNMENT rows × GROUPED_BLOCK_C columns. Of the
    # seven tiles ``scripts/benchmark_fp8_cast.py --grouped`` sweeps, 128 × 64 on 4 warps was the fastest at every
    # mixtral shape on an H200 (benchmarks/results/kernels/2026-12-03-h200-fp8-grouped-cast.json).
    GROUPED_BLOCKS, GROUPED_BLOCK_C, GROUPED_WARPS = 8, 64, 4

    @triton.jit
    def _block_groups(first_rows, ends, groups):
        """The group of each 16-row block starting at ``first_rows``: how many of the groups' ``ends`` lie at or
        before its first row (``searchsorted(offsets, row, right=True)``), the last group for the blocks past the
        last end (none, where the last end is the last row, but the blocks past the rows: their values are masked to
        zeros). It takes the ends loaded, not their pointer: torch.compile's analysis takes a pointer passed to a
        function as written, and would copy the offsets before every call."""
        return tl.minimum(tl.sum((ends[None, :] <= first_rows[:, None]).to(tl.int32), axis=1), groups - 1)

    @triton.jit
    def _grouped_amax_kernel(x_ptr, offsets_ptr, group_amax_ptr, row_amax_ptr, rows, columns, groups,
                             ROW_AMAX: tl.constexpr, GROUPS: tl.constexpr, BLOCKS: tl.constexpr,
                             BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        # A tile [BLOCKS, BLOCK_ROWS, BLOCK_C] of matrix ``batch``: each 16-row block lies in one group, and the tile's
        # blocks may lie in several. Atomic max of non-negative floats: the order of the tiles does not matter.
        batch = tl.program_id(2).to(tl.int64)
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        r = block[:, None] * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[None, :]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, :, None] < rows) & (c[None, None, :] < columns)
        x = tl.load(x_ptr + (batch * rows + r[:, :, None]) * columns + c[None, None, :], mask=mask, other=0.0)
        magnitudes = tl.abs(x.to(tl.float32))
        ends = tl.load(offsets_ptr + tl.arange(0, GROUPS), mask=tl.arange(0, GROUPS) < groups, other=2**31 - 1)
        group = _block_groups(block * BLOCK_ROWS, ends, groups)
        block_amax = tl.max(magnitudes, axis=1)  # [BLOCKS, BLOCK_C]
        if tl.min(group, axis=0) == tl.max(group, axis=0):  # the usual tile, inside one group: one atomic per column
            tl.atomic_max(group_amax_ptr + (batch * groups + tl.min(group, axis=0)) * columns + c,
                          tl.max(block_amax, axis=0), mask=c < columns)
        else:
            tl.atomic_max(group_amax_ptr + (batch * groups + group[:, None]) * columns + c[None, :], block_amax,
                          mask=(c < columns)[None, :])
        if ROW_AMAX:
            tl.atomic_max(row_amax_ptr + batch * rows + r, tl.max(magnitudes, axis=2), mask=r < rows)

    @triton.jit
    def _grouped_cast_kernel(x_ptr, offsets_ptr, column_scale_ptr, row_scale_ptr, out_t_ptr, out_ptr, rows, columns,
                             groups, FP8_MAX: tl.constexpr, ROWWISE: tl.constexpr, GROUPS: tl.constexpr,
                             BLOCKS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        # FP8_MAX a compile-time constant, as in _cast_both_layouts_kernel. The tile is read once; its per-(group,
        # column) scales are loaded once per 16-row block.
        batch = tl.program_id(2).to(tl.int64)
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        r = block[:, None] * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[None, :]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, :, None] < rows) & (c[None, None, :] < columns)
        x = tl.load(x_ptr + (batch * rows + r[:, :, None]) * columns + c[None, None, :], mask=mask,
                    other=0.0).to(tl.float32)
        ends = tl.load(offsets_ptr + tl.arange(0, GROUPS), mask=tl.arange(0, GROUPS) < groups, other=2**31 - 1)
        group = _block_groups(block * BLOCK_ROWS, ends, groups)
        scale = tl.load(column_scale_ptr + (batch * groups + group[:, None]) * columns + c[None, :],
                        mask=(c < columns)[None, :], other=0.0)
        y = tl.clamp(x * scale[:, None, :], -FP8_MAX, FP8_MAX).to(out_t_ptr.dtype.element_ty)
        tl.store(out_t_ptr + (batch * columns + c[:, None, None]) * rows + r[None, :, :], tl.permute(y, (2, 0, 1)),
                 mask=tl.permute(mask, (2, 0, 1)))
        if ROWWISE:
            row_scale = tl.load(row_scale_ptr + batch * rows + r, mask=r < rows, other=0.0)
            y = tl.clamp(x * row_scale[:, :, None], -FP8_MAX, FP8_MAX).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + (batch * rows + r[:, :, None]) * columns + c[None, None, :], y, mask=mask)

    def _cast_per_group(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                        tile: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``cast_per_group``'s two passes at ``tile`` (16-row blocks, columns, warps; the benchmark sweeps it)."""
        batch, rows, columns = x.shape
        groups = offsets.shape[0]
        x = x.contiguous()
        blocks, block_c, warps = tile
        grid = (triton.cdiv(rows, blocks * GROUPED_ALIGNMENT), triton.cdiv(columns, block_c), batch)
        sizes = dict(GROUPS=triton.next_power_of_2(groups), BLOCKS=blocks, BLOCK_ROWS=GROUPED_ALIGNMENT,
                     BLOCK_C=block_c, num_warps=warps)
        group_amax = torch.zeros((batch, groups, columns), dtype=torch.float32, device=x.device)
        row_amax = torch.zeros((batch, rows) if rowwise else (0,), dtype=torch.float32, device=x.device)
        _grouped_amax_kernel[grid](x, offsets, group_amax, row_amax, rows, columns, groups, ROW_AMAX=rowwise, **sizes)
        column_scale, row_scale = fp8_scale(group_amax, dtype), fp8_scale(row_amax, dtype)
        out_t = torch.empty((batch, columns, rows), dtype=dtype, device=x.device)
        out = torch.empty((batch, rows, columns) if rowwise else (0,), dtype=dtype, device=x.device)
        _grouped_cast_kernel[grid](x, offsets, column_scale, row_scale, out_t, out, rows, columns, groups,
                                   FP8_MAX=torch.finfo(dtype).max, ROWWISE=rowwise, **sizes)
        return out_t, column_scale, out, row_scale

    @torch.library.custom_op("nanotron::fp8_cast_per_group", mutates_args=())
    def cast_per_group(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Matrices ``x`` [batch, rows, columns], their rows grouped by ``offsets`` (int32 cumulative ends, every
        group whole 16-row blocks, the last end ``rows``), cast to ``dtype`` as ``quantize_per_group`` casts each:
        returns them transposed [batch, columns, rows] with their scales [batch, groups, columns], and where
        ``rowwise`` also row-major with one scale per row, as ``quantize(x, dtype, -1)`` (scales [batch, rows]; else
        both empty). Two passes over ``x``: the amaxes (atomics), then the casts, each tile read once and written in
        both layouts.

        An opaque op, not a ``triton_op``: traced into a compiled backward as a ``triton_op``, the kernels' outputs
        came out wrong on an H200 (the input gradient of the compiled grouped linear was zero where eager was right),
        so the compiler calls the op as it runs eagerly, which the CUDA tests check against the plain casts."""
        return _cast_per_group(x, offsets, dtype, rowwise, (GROUPED_BLOCKS, GROUPED_BLOCK_C, GROUPED_WARPS))

    @cast_per_group.register_fake
    def _(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, rows, columns = x.shape
        return (x.new_empty((batch, columns, rows), dtype=dtype),
                x.new_empty((batch, offsets.shape[0], columns), dtype=torch.float32),
                x.new_empty((batch, rows, columns) if rowwise else (0,), dtype=dtype),
                x.new_empty((batch, rows) if rowwise else (0,), dtype=torch.float32))


def quantize_for_grouped_backward(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool = False
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``x`` [rows, features] (grouped by ``offsets``) cast as the grouped backward's products take it: per (group,
    feature) (``quantize_per_group``) and transposed, [features, rows] row-major (the weight gradient's product
    reduces over the rows), with scales [groups, features]; and where ``rowwise`` (the output gradient, an operand of
    the input gradient's product too) also per row over all features, row-major, with scales [rows] (else None).

    On CUDA ``cast_per_group`` reads ``x`` twice, for the amaxes and for both casts, where the compiled plain-torch
    casts ran about ten kernels with a gather and transposed copies."""
    if available(x.device):
        out_t, column_scale, out, row_scale = cast_per_group(x[None], offsets, dtype, rowwise)
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
        out_t, scale, _, _ = cast_per_group(weight, ends, dtype, False)
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


def fp8_converter(args):
    """A module converter (``build_model(converters=...)``) giving the decoder layers' linears FP8 matmuls.

    Every module with a swappable ``matmul`` inside ``layers`` is converted except those their parent module lists
    in ``keeps_model_dtype`` (MoE routers: their logits choose experts) and the names matching
    ``fp8.exclude_modules``; so are MoE experts (their ``expert_matmul``: ``FP8ExpertMatmul``, grouped products with
    rowwise scales from the current amax whatever the recipe, see the module's docstring). The embedding and the LM
    head are outside the decoder layers and stay in the model dtype. A tensor-parallel linear scales each operand as
    the whole tensor is scaled (``SplitFeatures``); MoE experts split over tensor-parallel ranks still scale each
    rank's slices on their own.
    """
    import re

    recipe = FP8Recipe(FORMATS[args.gradient_format], args.recipe == "rowwise", args.recipe == "delayed")
    excluded = [re.compile(pattern) for pattern in args.exclude_modules]

    def range_counts(module: nn.Module) -> FP8RangeCounts | None:
        if not args.log_out_of_range:
            return None
        module.fp8_ranges = FP8RangeCounts()  # a child module, so that it follows the model to its device
        return module.fp8_ranges

    def convert(model) -> None:
        modules = dict(model.named_modules())
        kept = {f"{name}.{child}" for name, module in modules.items()
                for child in getattr(module, "keeps_model_dtype", ())}
        for name, module in modules.items():
            if not name.startswith("layers.") or name in kept or any(pattern.search(name) for pattern in excluded):
                continue
            if hasattr(module, "expert_matmul"):
                module.expert_matmul = FP8ExpertMatmul(range_counts(module))
            elif hasattr(module, "matmul"):
                if recipe.delayed:  # a child module: its history is model state, saved and loaded by name
                    module.fp8_amaxes = AmaxHistory(args.amax_history_length)
                split = None
                if hasattr(module, "split_features"):  # a tensor-parallel linear (parallel/tensor_parallel.py)
                    split = SplitFeatures(module.split_features, module.max_over_ranks)
                module.matmul = FP8Matmul(recipe, module.fp8_amaxes if recipe.delayed else None, range_counts(module),
                                          split)

    return convert
