"""Cross-entropy on logits sharded over the vocabulary, without ever gathering them.

Each tensor-parallel rank holds the logits of a contiguous slice of the vocabulary. The softmax needs three
all-reduces of per-token scalars (the max, the sum of exponentials and the target logit), all in fp32:

    m = max_v z_v               z <- z - m
    loss = log(sum_v exp z_v) - z_target

The backward is local: softmax minus the one-hot target on this rank's slice.

``vocab_parallel_log_sum_exp`` gives each token's ``log(sum_v exp z_v)`` over the shards alike, differentiable, for
a z-loss on the logits (``c * lse**2``, which keeps them from drifting).

Columns past the real vocabulary (padding that makes the vocabulary split evenly) are excluded from the softmax, so
the amount of padding, which depends on the tensor-parallel size, never changes the loss: checkpoints resume exactly
at another TP size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron.nn.loss import token_losses
from nanotron.parallel.tp_collectives import reduce_from_tp


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup,
                vocab_size: int) -> torch.Tensor:
        ctx.dtype = logits.dtype
        local_vocab = logits.shape[-1]
        start = dist.get_rank(group) * local_vocab
        logits = logits.float()
        if start + local_vocab > vocab_size:  # known on the host: testing the mask's values would sync with the GPU
            padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
            logits = logits.masked_fill(padding, float("-inf"))

        maximum = logits.max(dim=-1).values
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - maximum.unsqueeze(-1)

        in_slice = (labels >= start) & (labels < start + local_vocab)
        local_labels = torch.where(in_slice, labels - start, 0)
        target = torch.where(in_slice, shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(target, group=group)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_labels, in_slice)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_labels, in_slice = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -in_slice.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_token_losses(logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup,
                                vocab_size: int) -> torch.Tensor:
    """Per-token cross-entropy [batch, seq] (fp32) from logits [batch, seq, padded vocab / tp] sharded over ``group``.

    Only the first ``vocab_size`` columns of the (logical) vocabulary take part in the softmax.
    """
    if dist.get_world_size(group) == 1:
        return token_losses(logits[..., :vocab_size], labels)
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_size)


def vocab_parallel_log_sum_exp(logits: torch.Tensor, group: dist.ProcessGroup, vocab_size: int) -> torch.Tensor:
    """Per-token ``logsumexp`` [batch, seq] (fp32, differentiable) of logits [batch, seq, padded vocab / tp] sharded
    over ``group``, over the first ``vocab_size`` columns of the logical vocabulary.

    The shards' sums of ``exp(z - max)`` are added by ``reduce_from_tp``, whose backward hands every rank the
    gradient of the whole sum, so each rank's logits get ``softmax * grad`` on their slice; the maximum only
    shifts the exponent and takes no gradient."""
    if dist.get_world_size(group) == 1:
        return logits[..., :vocab_size].float().logsumexp(-1)
    local_vocab = logits.shape[-1]
    start = dist.get_rank(group) * local_vocab
    z = logits.float()
    if start + local_vocab > vocab_size:
        z = z.masked_fill(torch.arange(start, start + local_vocab, device=z.device) >= vocab_size, float("-inf"))
    with torch.no_grad():
        maximum = z.amax(dim=-1)
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    return maximum + reduce_from_tp(torch.exp(z - maximum.unsqueeze(-1)).sum(dim=-1), group).log()
