"""The AdamW update of one flat shard: fp32 masters, moments and gradient in, the model's weights out.

Written once in plain torch, the same arithmetic as ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected
moments). On CUDA it is compiled into a single kernel per shard that also applies the clipping factor to the
gradient as it reads it and writes the model-dtype copy of the new master, so an update reads every fp32 tensor once
and writes the bf16 weights without another pass, where ``torch.optim.AdamW(fused=True)`` needs a separate copy and
a separate clipping pass (docs/benchmarks.md, "Where the step time went"). Elsewhere it runs as is.

The moments may be stored in bf16 (``optimizer.adam_moments_dtype``, as DeepSeek-V3 and Megatron-LM's
precision-aware optimizer do): the same function reads them into fp32, updates them in fp32 and rounds them once on
store, which saves 8 of the ~30 bytes an update moves per parameter. Stored in fp32 they are updated in place.

The masters are a tensor of their own, or the bf16 weights and their 16 remainder bits (``param_remainders.py``):
either way the update computes on fp32 masters. On CUDA the update of remainders is a Triton kernel of the same
arithmetic (``adamw_update_remainders_fused``), whose results may differ from the compiled update of fp32 copies in
the last bit, where the two contract multiplications and additions differently.

Hyperparameters arrive as 0-dim tensors on the shard's device: the learning rate changes every step, and a Python
float would either recompile the kernel or need a host-to-device copy that waits for the GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nanotron.nn.kernels import available, tl, triton
from nanotron.optim.param_remainders import HALF_UNIT, joined, split_


@dataclass
class AdamWHyperparameters:
    """Per-step scalars, as 0-dim fp32 tensors on the device of the shards."""

    lr: torch.Tensor
    beta1: torch.Tensor
    beta2: torch.Tensor
    eps: torch.Tensor
    weight_decay: torch.Tensor
    bias_correction1: torch.Tensor  # 1 - beta1^step
    bias_correction2_sqrt: torch.Tensor  # sqrt(1 - beta2^step)
    grad_multiplier: torch.Tensor  # the clipping factor (1 when not clipping)

    @classmethod
    def at_step(cls, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                grad_multiplier: torch.Tensor | None, device: torch.device) -> AdamWHyperparameters:
        def scalar(value: float) -> torch.Tensor:
            return torch.full((), value, dtype=torch.float32, device=device)  # a fill kernel, no host sync

        multiplier = grad_multiplier.float() if grad_multiplier is not None else scalar(1.0)
        return cls(scalar(lr), scalar(beta1), scalar(beta2), scalar(eps), scalar(weight_decay),
                   scalar(1 - beta1**step), scalar((1 - beta2**step) ** 0.5), multiplier)


def update_masters_(masters: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    h: AdamWHyperparameters) -> None:
    """One step of the fp32 ``masters``, ``exp_avg`` and ``exp_avg_sq``, in place. The arithmetic is fp32 whatever
    the dtype of the gradient and the moments. In place on purpose: computed out of place and copied back, the
    compiled update with fp32 moments moved its bytes at two thirds of the speed."""
    grad = grad.float() * h.grad_multiplier
    masters.mul_(1 - h.lr * h.weight_decay)
    first = exp_avg.float().lerp_(grad, 1 - h.beta1)  # fp32 moments: ``float()`` is the stored tensor itself
    second = exp_avg_sq.float().mul_(h.beta2).add_((1 - h.beta2) * grad * grad)
    denominator = second.sqrt() / h.bias_correction2_sqrt + h.eps
    masters.sub_(h.lr / h.bias_correction1 * first / denominator)
    exp_avg.copy_(first)  # bf16 moments: rounded on store; fp32 ones: already updated, a copy onto itself
    exp_avg_sq.copy_(second)


def adamw_update_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  weights: torch.Tensor, h: AdamWHyperparameters) -> None:
    """Update the fp32 ``master``, ``exp_avg`` and ``exp_avg_sq`` in place and copy the new master into
    ``weights``."""
    update_masters_(master, grad, exp_avg, exp_avg_sq, h)
    weights.copy_(master)


def adamw_update_remainders_(remainders: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                             exp_avg_sq: torch.Tensor, weights: torch.Tensor, h: AdamWHyperparameters) -> None:
    """The same update of masters held as bf16 ``weights`` and int16 ``remainders`` (``param_remainders.py``)."""
    masters = joined(weights, remainders)
    update_masters_(masters, grad, exp_avg, exp_avg_sq, h)
    split_(masters, weights, remainders)


@functools.cache
def _compiled_adamw_update():
    return torch.compile(adamw_update_, dynamic=True, fullgraph=True)


def adamw_update_function(device: torch.device, fused: bool, remainders: bool):
    """The update of masters held as remainders or as fp32 tensors: one kernel per shard on a CUDA device with Triton
    when ``fused`` (``adamw_update_remainders_fused``, or the compiler's kernel of ``adamw_update_``), else plain
    torch."""
    if fused and available(device):
        return adamw_update_remainders_fused if remainders else _compiled_adamw_update()
    return adamw_update_remainders_ if remainders else adamw_update_


# The update of remainders is a kernel of its own rather than the compiler's. Compiled, it had two launch
# configurations, one of which moved its bytes at a third of the other's bandwidth on an H200 (1.2 against 2.9 TB/s),
# and the pointwise autotuner, timing both on the first shard, picked that one in the trainer. This kernel runs at
# 3.8-3.9 TB/s there with blocks of 512 to 2048 elements and 4 or 8 warps.
REMAINDERS_BLOCK, REMAINDERS_WARPS = 1024, 4

if triton is not None:
    _HALF_UNIT = tl.constexpr(HALF_UNIT)

    @triton.jit
    def _adamw_remainders_kernel(weights_ptr, remainders_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, lr_ptr,
                                 beta1_ptr, beta2_ptr, eps_ptr, weight_decay_ptr, bias_correction1_ptr,
                                 bias_correction2_sqrt_ptr, grad_multiplier_ptr, numel, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        lr, beta1, beta2 = tl.load(lr_ptr), tl.load(beta1_ptr), tl.load(beta2_ptr)
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * tl.load(grad_multiplier_ptr)
        upper = tl.load(weights_ptr + offsets, mask=mask).to(tl.int16, bitcast=True).to(tl.int32) << 16
        masters = (upper + tl.load(remainders_ptr + offsets, mask=mask).to(tl.int32)).to(tl.float32, bitcast=True)
        masters = masters * (1 - lr * tl.load(weight_decay_ptr))
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
        weight = 1 - beta1  # torch.lerp's two forms, each exact at its end of the weight's range
        difference = grad - exp_avg
        first = tl.where(tl.abs(weight) < 0.5, exp_avg + weight * difference, grad - difference * (1 - weight))
        second = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32) * beta2 + (1 - beta2) * grad * grad
        denominator = tl.div_rn(tl.sqrt_rn(second), tl.load(bias_correction2_sqrt_ptr)) + tl.load(eps_ptr)
        masters -= tl.div_rn(tl.div_rn(lr, tl.load(bias_correction1_ptr)) * first, denominator)
        tl.store(exp_avg_ptr + offsets, first.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, second.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
        bits = masters.to(tl.int32, bitcast=True)
        upper = (bits + _HALF_UNIT) >> 16  # as ``split_``: the nearest bf16, ties away from zero
        tl.store(weights_ptr + offsets, upper.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(remainders_ptr + offsets, (bits - (upper << 16)).to(tl.int16), mask=mask)


def adamw_update_remainders_fused(remainders: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                                  exp_avg_sq: torch.Tensor, weights: torch.Tensor, h: AdamWHyperparameters) -> None:
    """``adamw_update_remainders_`` in one pass over contiguous shards, as a Triton kernel: each tensor is read once
    and written once."""
    numel = weights.numel()
    _adamw_remainders_kernel[(triton.cdiv(numel, REMAINDERS_BLOCK),)](
        weights, remainders, grad, exp_avg, exp_avg_sq, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
        h.bias_correction1, h.bias_correction2_sqrt, h.grad_multiplier, numel, BLOCK=REMAINDERS_BLOCK,
        num_warps=REMAINDERS_WARPS)
