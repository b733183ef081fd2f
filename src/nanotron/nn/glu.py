"""Gated feed-forward activations, ``act(gate) * up`` on the output of a fused gate|up projection: the MLP of
transformers' Llama, Qwen2, Qwen2-MoE and Mixtral with ``ACT2FN[hidden_act]``.

``silu`` is SwiGLU (``swiglu.py``, with its fused backward on CUDA). The other activations run in plain torch, with a
backward that keeps what SwiGLU's keeps, the gate|up output alone, and recomputes the activation from it: the memory
planner's count of a feed-forward block (``models/llama/costs.py``) holds for every activation.
"""

from __future__ import annotations

from typing import get_args

import torch
import torch.nn.functional as F

from nanotron.config.llama import HiddenAct
from nanotron.nn.swiglu import swiglu

# The activation of each ``hidden_act`` (transformers' ``ACT2FN``: ``gelu`` is the exact erf form,
# ``gelu_pytorch_tanh`` torch's tanh approximation) and its gradient with respect to its input, given the gradient of
# its output.
_FORWARD = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
_BACKWARD = {
    "gelu": lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="none"),
    "gelu_pytorch_tanh": lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh"),
    "relu": lambda grad, x: torch.ops.aten.threshold_backward(grad, x, 0),
}
assert set(_FORWARD) | {"silu"} == set(get_args(HiddenAct)), "every hidden_act of the config needs its activation"


def glu(gate_up: torch.Tensor, activation: HiddenAct) -> torch.Tensor:
    """``act(gate) * up`` where ``gate_up`` = [..., 2 * ffn] holds gate then up along its last dimension."""
    if activation == "silu":
        return swiglu(gate_up)
    return _PlainGLU.apply(gate_up, activation)


def glu_backward_reference(gate_up: torch.Tensor, grad: torch.Tensor, activation: str) -> torch.Tensor:
    """Gradient of ``glu`` (an activation other than silu) w.r.t. ``gate_up``, computed in fp32 (or wider) and rounded
    once to the input dtype, as SwiGLU's."""
    compute = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(compute).chunk(2, dim=-1)
    grad = grad.to(compute)
    d_gate = _BACKWARD[activation](grad * up, gate)
    d_up = grad * _FORWARD[activation](gate)
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


class _PlainGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.activation = activation
        gate, up = gate_up.chunk(2, dim=-1)
        return _FORWARD[activation](gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        return glu_backward_reference(gate_up, grad, ctx.activation), None
