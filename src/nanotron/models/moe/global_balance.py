"""The load-balancing loss over the global batch (``balance_scope: global_batch``; Qwen3-MoE's training, Megatron's
``global_aux_loss``): each MoE layer's loss is ``E * sum_e f_e * P_e`` with ``f_e`` the share of the step's
(token, slot) assignments routed to expert ``e`` over the whole global batch (every micro-batch of every rank that
sees other tokens) and ``P_e`` the mean router probability of expert ``e`` over the global batch's ``T`` tokens.

``f`` is a constant of the step (no gradient), so the loss is linear in the probability sums: a micro-batch's share
is ``sum_e w_e * p_e``, ``p_e`` its tokens' probabilities of ``e`` summed, ``w_e = E * f_e / T``. Summed over the
step's micro-batches and ranks it is the layer's loss, so every split of the global batch gives the same gradients.
The weights are known only once every micro-batch has been routed: the forward attaches the share through
``_PooledBalance``, whose backward reads them from the step's ``GlobalBalance``, which the step program fills from
the pooled expert counts after the step's forwards and before its first backward (``training/step.py``; pooling is
a reduction, so no model code runs it). The logged loss is computed from the step's sums (``balance_from_sums``).
"""

from __future__ import annotations

import torch

from nanotron.config.moe import MoESettings


def balance_weights(counts: torch.Tensor, settings: MoESettings) -> torch.Tensor:
    """``E * f_e / T`` per layer from ``counts`` [layers, E], each layer's assignments per expert over the global
    batch (``T * top_k`` of them; a layer of another pipeline stage, counted zero here, gets zeros)."""
    assignments = counts.sum(-1, keepdim=True).clamp(min=1.0)
    return settings.num_experts * settings.top_k * counts / assignments.square()


def balance_from_sums(counts: torch.Tensor, probabilities: torch.Tensor, settings: MoESettings) -> torch.Tensor:
    """Each layer's loss ``E * sum_e f_e * P_e`` from the step's counts and probability sums [layers, E]."""
    return (balance_weights(counts, settings) * probabilities).sum(-1)


class GlobalBalance:
    """The step's weights ``E * f_e / T`` of every MoE layer (``pool``), read by the backward of each micro-batch's
    share of the loss (``loss``)."""

    def __init__(self, settings: MoESettings):
        self.settings = settings
        self.weights: torch.Tensor | None = None  # [layers, E], set before the step's first backward

    def pool(self, counts: torch.Tensor) -> None:
        """``counts`` [layers, E]: the global batch's assignments per expert of each layer."""
        self.weights = balance_weights(counts, self.settings)

    def loss(self, probabilities: torch.Tensor, row: int) -> torch.Tensor:
        """The share of layer ``row``'s loss of the tokens whose probability sums are ``probabilities`` [E]: a
        scalar whose value is 0 (the weights are not known yet) and whose gradient is the weights'."""
        return _PooledBalance.apply(probabilities, self, row)


class _PooledBalance(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probabilities: torch.Tensor, balance: GlobalBalance, row: int) -> torch.Tensor:
        ctx.balance, ctx.row = balance, row
        return probabilities.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights = ctx.balance.weights
        if weights is None:
            raise RuntimeError("the global-batch load-balancing loss was backpropagated before the step's expert "
                               "counts were pooled: the schedule must run every forward of the step first")
        return grad * weights[ctx.row].to(grad.dtype), None, None
