"""The AdamW update of one flat shard: fp32 masters, moments and gradient in, the model's weights out.

Written once in plain torch, the same arithmetic as ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected
moments). On CUDA it is compiled into a single kernel per shard that also applies the clipping factor to the
gradient as it reads it and writes the model-dtype copy of the new master, so an update reads every fp32 tensor once
and writes the bf16 weights without another pass (``torch.optim.AdamW(fused=True)`` plus a separate copy and a
separate clipping pass cost ~4.5 ms more per step for a 1.2B model on an H200). Elsewhere it runs as is.

The moments may be stored in bf16 (``optimizer.adam_moments_dtype``, as DeepSeek-V3 and Megatron-LM's
precision-aware optimizer do): the same function reads them into fp32, updates them in fp32 and rounds them once on
store, which saves 8 of the ~30 bytes an update moves per parameter. Stored in fp32 they are updated in place.

The masters are a tensor of their own, or the bf16 weights and their 16 remainder bits (``param_remainders.py``):
either way the update computes on the same fp32 numbers.

Hyperparameters arrive as 0-dim tensors on the shard's device: the learning rate changes every step, and a Python
float would either recompile the kernel or need a host-to-device copy that waits for the GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nanotron.optim.param_remainders import joined, split_


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


# Compiled in the trainer, the update of remainders ran at a third of the bandwidth it reached when compiled in the
# optimizer benchmark: the same kernel source, so the likely cause is which of its two launch configurations the
# pointwise autotuner picked. Without autotuning it takes the first, 8 elements a thread.
COMPILE_OPTIONS = {adamw_update_: {}, adamw_update_remainders_: {"triton.autotune_pointwise": False}}


@functools.cache
def _compiled(update):
    return torch.compile(update, dynamic=True, fullgraph=True, options=COMPILE_OPTIONS[update])


def adamw_update_function(device: torch.device, fused: bool, remainders: bool):
    """The update of masters held as remainders or as fp32 tensors: compiled into one kernel on CUDA when
    ``fused``, else plain torch."""
    update = adamw_update_remainders_ if remainders else adamw_update_
    return _compiled(update) if fused and device.type == "cuda" else update
