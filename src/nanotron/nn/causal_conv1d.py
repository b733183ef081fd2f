"""Mamba's depthwise causal convolution over time and the SiLU after it, on channels-last activations
[batch, length, channels].

``causal_conv1d_silu_reference`` is the definition in plain torch (every device; generation, which carries the last
inputs between calls; the tests): ``kernel_size`` shifted multiply-adds in fp32, the bias, SiLU, and one rounding to
the input's dtype. ``F.conv1d`` on the transposed input is what the tests compare it against.

On CUDA with Triton, a sequence that starts from nothing carried (training, a prompt without cache) runs Triton
kernels instead. The forward reads x where it lies (a strided half of in_proj's output) and treats the inputs before the
sequence as zeros through its masks, so no padded copy is made or kept for the backward. The backward recomputes the
convolution to write the gradient at the pre-activation (in x's dtype), sums its shifted rows into the input
gradient, and leaves the weight's and bias's sums over every step to the compiler, which makes one reduction kernel
of them. Compiled from plain torch, the same backward took four kernels and read the pre-activation gradient three
times in fp32 (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanotron.nn.kernels import available, tl, triton, triton_op, wrap_triton


class CausalConv1d(nn.Module):
    """Each channel's own ``kernel_size`` filter over its last inputs, then SiLU; ``weight`` [channels, 1,
    kernel_size] as ``nn.Conv1d(channels, channels, kernel_size, groups=channels)`` keeps it (and Hugging Face
    checkpoints)."""

    def __init__(self, channels: int, kernel_size: int, bias: bool):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    def forward(self, x: torch.Tensor, earlier: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(conv(x))`` [batch, length, channels] in x's dtype; ``earlier`` [batch, kernel_size - 1, channels]
        holds the inputs before x (None: zeros, the start of a sequence). Output t sees inputs t - kernel_size + 1
        .. t."""
        return causal_conv1d_silu(x, self.weight, self.bias, earlier)


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       earlier: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernels on CUDA when nothing is carried, the reference otherwise."""
    if available(x.device) and earlier is None:
        return conv_forward(x, weight, bias)
    return causal_conv1d_silu_reference(x, weight, bias, earlier)


def causal_conv1d_silu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 earlier: torch.Tensor | None = None) -> torch.Tensor:
    kernel_size, length = weight.shape[-1], x.shape[1]
    if earlier is None:
        earlier = x.new_zeros(x.shape[0], kernel_size - 1, x.shape[2])
    padded = torch.cat([earlier, x], dim=1)
    w = weight.float()
    out = sum(padded[:, k:k + length].float() * w[:, 0, k] for k in range(kernel_size))
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(x.dtype)


# Steps and channels per program, and warps: each tile row is 128 channels, 256 contiguous bytes in bf16. The
# fastest of nine settings timed on an H200 for the forward at the 130M shape (docs/benchmarks.md).
BLOCK_T, BLOCK_C, NUM_WARPS = 16, 128, 4

if triton is not None:
    # As in selective_scan.py, helpers that receive pointers return values, never addresses: torch.compile takes
    # every input that an address is derived from as written, and would copy it before each call.
    @triton.jit
    def _preactivation(x_ptr, weight_ptr, bias_ptr, x_row, t, c, c_mask, length, KERNEL: tl.constexpr,
                       HAS_BIAS: tl.constexpr):
        """conv(x) + bias in fp32 at steps ``t`` [BLOCK_T] and channels ``c`` [BLOCK_C] of one sequence (``x_ptr``
        at its first step, ``x_row`` elements between steps); inputs before the sequence are zeros."""
        out = tl.zeros([t.shape[0], c.shape[0]], tl.float32)
        for k in tl.static_range(KERNEL):
            source = t - (KERNEL - 1) + k
            inside = (source >= 0) & (source < length)
            inputs = tl.load(x_ptr + source[:, None] * x_row + c[None, :], mask=inside[:, None] & c_mask[None, :],
                             other=0.0).to(tl.float32)
            out += inputs * tl.load(weight_ptr + c * KERNEL + k, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        return out

    @triton.jit
    def _tile(length, channels, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """This program's sequence, steps and channels, and the offsets and mask of its [BLOCK_T, BLOCK_C] tile in a
        contiguous [batch, length, channels] tensor."""
        seq = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < channels
        td = seq * length * channels + t[:, None] * channels + c[None, :]
        return seq, t, c, c_mask, td, (t[:, None] < length) & c_mask[None, :]

    @triton.jit
    def _conv_forward_kernel(x_ptr, weight_ptr, bias_ptr, out_ptr, length, channels, x_seq, x_row, KERNEL: tl.constexpr,
                             HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        seq, t, c, c_mask, td, td_mask = _tile(length, channels, BLOCK_T, BLOCK_C)
        pre = _preactivation(x_ptr + seq * x_seq, weight_ptr, bias_ptr, x_row, t, c, c_mask, length, KERNEL,
                             HAS_BIAS)
        tl.store(out_ptr + td, (pre * tl.sigmoid(pre)).to(out_ptr.dtype.element_ty), mask=td_mask)

    @triton.jit
    def _preactivation_gradient_kernel(x_ptr, weight_ptr, bias_ptr, grad_ptr, dpre_ptr, length, channels, x_seq,
                                       x_row, KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                                       BLOCK_C: tl.constexpr):
        """The gradient at the pre-activation, ``dpre = grad · silu'(conv(x) + bias)``, in dpre's dtype."""
        seq, t, c, c_mask, td, td_mask = _tile(length, channels, BLOCK_T, BLOCK_C)
        pre = _preactivation(x_ptr + seq * x_seq, weight_ptr, bias_ptr, x_row, t, c, c_mask, length, KERNEL,
                             HAS_BIAS)
        grad = tl.load(grad_ptr + td, mask=td_mask, other=0.0).to(tl.float32)
        sigmoid = tl.sigmoid(pre)
        tl.store(dpre_ptr + td, (grad * sigmoid * (1 + pre * (1 - sigmoid))).to(dpre_ptr.dtype.element_ty),
                 mask=td_mask)

    @triton.jit
    def _input_gradient_kernel(dpre_ptr, weight_ptr, dx_ptr, length, channels, KERNEL: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """``dx[s] = Σ_k w[k] · dpre[s + KERNEL - 1 - k]``, from the pre-activation gradient's next steps."""
        seq, t, c, c_mask, td, td_mask = _tile(length, channels, BLOCK_T, BLOCK_C)
        dx = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for k in tl.static_range(KERNEL):
            shift = KERNEL - 1 - k
            dpre = tl.load(dpre_ptr + td + shift * channels, mask=((t[:, None] + shift) < length) & c_mask[None, :],
                           other=0.0)
            dx += dpre * tl.load(weight_ptr + c * KERNEL + k, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(dx_ptr + td, dx.to(dx_ptr.dtype.element_ty), mask=td_mask)

    def _grid(x: torch.Tensor) -> tuple[int, int, int]:
        return x.shape[0], triton.cdiv(x.shape[1], BLOCK_T), triton.cdiv(x.shape[2], BLOCK_C)

    def _rows(x: torch.Tensor) -> torch.Tensor:
        """x with unit stride over channels (in_proj's half already has it; anything else is copied)."""
        return x if x.stride(2) == 1 else x.contiguous()

    @triton_op("nanotron::causal_conv1d_silu_forward", mutates_args={})
    def conv_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = _rows(x)
        out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        wrap_triton(_conv_forward_kernel)[_grid(x)](
            x, weight, weight if bias is None else bias, out, x.shape[1], x.shape[2], x.stride(0), x.stride(1),
            KERNEL=weight.shape[-1], HAS_BIAS=bias is not None, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
            num_warps=NUM_WARPS)
        return out

    @triton_op("nanotron::causal_conv1d_silu_backward", mutates_args={})
    def conv_backward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of x (x's dtype, contiguous), the weight and the bias, in their dtypes (the bias's is the
        pre-activation gradient's sum, computed whether or not there is a bias)."""
        x, grad = _rows(x), grad.contiguous()
        length, channels, kernel_size, grid = x.shape[1], x.shape[2], weight.shape[-1], _grid(x)
        dpre = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        wrap_triton(_preactivation_gradient_kernel)[grid](
            x, weight, weight if bias is None else bias, grad, dpre, length, channels, x.stride(0), x.stride(1),
            KERNEL=kernel_size, HAS_BIAS=bias is not None, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
        dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        wrap_triton(_input_gradient_kernel)[grid](dpre, weight, dx, length, channels, KERNEL=kernel_size,
                                                  BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
        # Sums over every step, left to the compiler, which makes one reduction kernel of them: summed per tile in
        # the gradient kernel instead, they synchronised across warps and made it several times slower.
        dpre = dpre.float()
        padded = F.pad(x, (0, 0, kernel_size - 1, 0)).float()
        dweight = torch.stack([(dpre * padded[:, k:k + length]).sum((0, 1)) for k in range(kernel_size)], dim=-1)
        return (dx, dweight.reshape(weight.shape).to(weight.dtype),
                dpre.sum((0, 1)).to(weight.dtype if bias is None else bias.dtype))

    def _save_for_backward(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, bias)

    def _conv_gradients(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        dx, dweight, dbias = conv_backward(x, weight, bias, grad)
        return dx, dweight, dbias if ctx.has_bias else None

    conv_forward.register_autograd(_conv_gradients, setup_context=_save_for_backward)
