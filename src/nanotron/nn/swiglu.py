"""SwiGLU, ``silu(gate) * up``, on the output of a fused gate|up projection, with a fused backward on CUDA.

The forward is plain torch (the compiler fuses it into one pass). The backward needs both halves of the gradient of
``gate_up`` from the same three inputs (gate, up, the output's gradient). Left to autograd and the compiler, it is a
single kernel that concatenates the two halves, which reads its inputs twice and ran at half the memory bandwidth
(docs/benchmarks.md, "Where the step time went"). With Triton available on a CUDA device, one kernel reads each
input once and writes both halves; everywhere else ``swiglu_backward_reference`` computes the same values in plain
torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanotron.nn.kernels import available, tl, triton, triton_op, wrap_triton


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` = [..., 2 * ffn] holds gate then up along its last dimension."""
    return _SwiGLU.apply(gate_up)


def swiglu_backward_reference(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of ``swiglu`` w.r.t. ``gate_up``, computed in fp32 (or wider) and rounded once to the input dtype."""
    compute = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(compute).chunk(2, dim=-1)
    grad = grad.to(compute)
    sigmoid = torch.sigmoid(gate)
    d_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
    d_up = grad * gate * sigmoid
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        if available(gate_up.device):
            return swiglu_backward_fused(gate_up.contiguous(), grad.contiguous())
        return swiglu_backward_reference(gate_up, grad)


if triton is not None:

    @triton.jit
    def _swiglu_backward_kernel(gate_up_ptr, grad_ptr, out_ptr, ffn, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = columns < ffn
        gate_at, grad_at = gate_up_ptr + row * 2 * ffn + columns, grad_ptr + row * ffn + columns
        gate = tl.load(gate_at, mask=mask).to(tl.float32)
        up = tl.load(gate_at + ffn, mask=mask).to(tl.float32)
        grad = tl.load(grad_at, mask=mask).to(tl.float32)
        sigmoid = tl.sigmoid(gate)
        d_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
        d_up = grad * gate * sigmoid
        out_at = out_ptr + row * 2 * ffn + columns
        tl.store(out_at, d_gate.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_at + ffn, d_up.to(out_ptr.dtype.element_ty), mask=mask)

    @triton_op("nanotron::swiglu_backward", mutates_args={})
    def swiglu_backward_fused(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``swiglu_backward_reference`` in one pass: each input element is read once, both halves written."""
        out = torch.empty_like(gate_up)
        ffn = gate_up.shape[-1] // 2
        rows = gate_up.numel() // gate_up.shape[-1]
        block = 1024
        wrap_triton(_swiglu_backward_kernel)[(rows, triton.cdiv(ffn, block))](gate_up, grad, out, ffn, BLOCK=block)
        return out
