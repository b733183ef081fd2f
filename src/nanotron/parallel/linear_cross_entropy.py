"""The LM head's matmul fused with the cross-entropy, chunk by chunk over tokens: the logits never exist in full.

At the Llama 1B shape (vocabulary 128256, 4 sequences of 4096 tokens) the logits of one micro-batch are 4.2 GB in
bf16, and the unfused loss keeps them (or their fp32 softmax) from the forward to the backward. Here, as in
Liger-Kernel's fused linear cross-entropy, each chunk of tokens is taken through the head, the loss and the gradients
at once, in the forward. With ``h`` the head's input (after the final norm and the head's tensor-parallel gather),
``W`` this rank's rows of the head, and ``w`` the per-token weights of the objective ``sum(w * token_loss)``:

    z = h W^T                                             [chunk, vocab / tp], model dtype (fp32 accumulation)
    m, s, t = max z, sum exp(z - m), z[target] (0 when the target is on another rank)        per token, fp32
    all-gather (m, s, t) over TP;   lse = M + log(sum_r s_r exp(m_r - M)) with M = max_r m_r
    loss = lse - sum_r t_r
    g = w * (softmax(z) - onehot(target))                 the gradient of sum(w * loss) with respect to z
    grad_h[chunk] = g W,   grad_W += g^T h                (grad_W summed over chunks in fp32)

The weights are known in the forward (the label mask over the step's token count, or DoReMi's per-domain weights),
so the backward only scales the saved ``grad_h`` and ``grad_W`` by the incoming gradient of the scalar. One
all-gather of three fp32 numbers per token combines the vocabulary shards (the log-sum-exp of the shards' own
log-sum-exps), where ``cross_entropy.py`` needs three all-reduces. Columns past ``vocab_size`` (padding that
makes the vocabulary split evenly) are excluded from the softmax and get no gradient, as there.

A z-loss on the logits adds ``sum(u * lse**2)`` to the objective, with per-token weights ``u`` (its coefficient
times the label mask over the token count), and ``2 * u * lse * softmax(z)`` to ``g``; each token's ``lse`` comes
back with its loss, for the statistics.

Each chunk's elementwise work is two plain-torch passes, ``softmax_statistics`` and ``loss_and_logit_gradient``;
compiled (``model.compile``) each is one kernel that reads the model-dtype logits, and the second writes ``g`` in
the model dtype: no fp32 copy of a chunk's logits is stored. The chunks' shares of ``grad_W`` are summed in fp32 and
rounded once (``sum_in_fp32``), and the backward scales both gradients by the scalar's (``scale_``): compiled, each is
one vectorised pass, where eager torch ran four (an fp32 copy, the sum, the rounding, and a scaling by a 0-dim fp32
tensor that takes a slow mixed-dtype path).

On CUDA with Triton the statistics are one kernel that reads each logit once, keeping a running maximum and a sum
of exponentials rescaled to it (online softmax). The compiler's version of ``softmax_statistics_reference`` reads
the chunk twice (the maximum, then the sum), whether it splits the reduction or not (timings in
docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanotron.nn.kernels import available, tl, triton, triton_op, wrap_triton


def _real_columns(z: torch.Tensor, valid_columns: int) -> torch.Tensor:
    """``z`` with the padding columns (this rank's columns from ``valid_columns`` on) at -inf."""
    if valid_columns == z.shape[-1]:
        return z
    return z.masked_fill(torch.arange(z.shape[-1], device=z.device) >= valid_columns, float("-inf"))


def softmax_statistics(logits: torch.Tensor, local_labels: torch.Tensor, valid_columns: int) -> torch.Tensor:
    """[3, tokens] fp32: each token's largest logit on this rank, its sum of ``exp(z - max)``, and its target logit
    (0 where ``local_labels`` is -1: the target is on another rank). A rank holding only padding columns reports a
    maximum of -inf and a sum of 0, which the combination ignores. One Triton kernel on CUDA, else
    ``softmax_statistics_reference``."""
    if available(logits.device):
        return softmax_statistics_fused(logits.contiguous(), local_labels.contiguous(), valid_columns)
    return softmax_statistics_reference(logits, local_labels, valid_columns)


def softmax_statistics_reference(logits: torch.Tensor, local_labels: torch.Tensor,
                                 valid_columns: int) -> torch.Tensor:
    """``softmax_statistics`` in plain torch."""
    z = _real_columns(logits.float(), valid_columns)
    maximum = z.amax(dim=-1)
    shift = maximum.masked_fill(maximum == float("-inf"), 0.0)
    sum_exp = torch.exp(z - shift[:, None]).sum(dim=-1)
    target = z.gather(-1, local_labels.clamp(min=0)[:, None]).squeeze(-1)
    return torch.stack([maximum, sum_exp, torch.where(local_labels >= 0, target, 0.0)])


if triton is not None:

    @triton.jit
    def _softmax_statistics_kernel(logits_ptr, labels_ptr, out_ptr, tokens, row_length, valid_columns,
                                   BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start_of_row = logits_ptr + row * row_length
        maximum = tl.full((), float("-inf"), tl.float32)
        sum_exp = tl.zeros((), tl.float32)
        for start in range(0, valid_columns, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            z = tl.load(start_of_row + columns, mask=columns < valid_columns, other=float("-inf")).to(tl.float32)
            new_maximum = tl.maximum(maximum, tl.max(z, axis=0))
            shift = tl.where(new_maximum == float("-inf"), 0.0, new_maximum)  # a row of -inf sums to 0, not NaN
            sum_exp = sum_exp * tl.exp(maximum - shift) + tl.sum(tl.exp(z - shift), axis=0)
            maximum = new_maximum
        label = tl.load(labels_ptr + row)
        target = tl.load(start_of_row + tl.maximum(label, 0)).to(tl.float32)
        tl.store(out_ptr + row, maximum)
        tl.store(out_ptr + tokens + row, sum_exp)
        tl.store(out_ptr + 2 * tokens + row, tl.where(label >= 0, target, 0.0))

    @triton_op("nanotron::softmax_statistics", mutates_args={})
    def softmax_statistics_fused(logits: torch.Tensor, local_labels: torch.Tensor, valid_columns: int,
                                 block: int = 4096) -> torch.Tensor:
        """``softmax_statistics_reference`` in one read of the [tokens, columns] contiguous ``logits``: a program
        per token, over ``block`` columns at a time."""
        tokens = logits.shape[0]
        out = torch.empty(3, tokens, dtype=torch.float32, device=logits.device)
        wrap_triton(_softmax_statistics_kernel)[(tokens,)](logits, local_labels, out, tokens, logits.shape[1],
                                                           valid_columns, BLOCK=block, num_warps=8)
        return out


def loss_and_logit_gradient(logits: torch.Tensor, statistics: torch.Tensor, local_labels: torch.Tensor,
                            token_weights: torch.Tensor, z_weights: torch.Tensor | None,
                            valid_columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of ``sum(token_weights * loss) + sum(z_weights * lse**2)`` (no z-loss when ``z_weights`` is None)
    with respect to this rank's logits (model dtype), the per-token losses and log-sum-exps (fp32), from every
    rank's ``softmax_statistics`` ([ranks, 3, tokens])."""
    maximum, sum_exp, target = statistics.unbind(1)
    top = maximum.amax(dim=0)
    log_sum_exp = top + torch.log((sum_exp * torch.exp(maximum - top)).sum(dim=0))
    losses = log_sum_exp - target.sum(dim=0)
    softmax = torch.exp(_real_columns(logits.float(), valid_columns) - log_sum_exp[:, None])
    is_target = torch.arange(logits.shape[-1], device=logits.device) == local_labels[:, None]
    gradient = token_weights[:, None] * torch.where(is_target, softmax - 1.0, softmax)
    if z_weights is not None:
        gradient = gradient + (2.0 * z_weights * log_sum_exp)[:, None] * softmax
    return gradient.to(logits.dtype), losses, log_sum_exp


def sum_in_fp32(total: torch.Tensor, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``total + partial`` computed in fp32 and returned in ``dtype`` (fp32 while chunks remain, the model dtype
    after the last); an fp32 ``total`` is summed into in place."""
    return total.float().add_(partial).to(dtype)


def scale_(gradient: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``gradient`` multiplied in place by the 0-dim ``factor``, in fp32 and rounded once."""
    return gradient.mul_(factor)


@dataclass(frozen=True)
class ChunkPasses:
    """The elementwise passes of the fused loss: two over a chunk's logits, the sum of the chunks' ``grad_W`` and the
    backward's scaling; plain or compiled."""

    statistics: Callable = softmax_statistics
    gradient: Callable = loss_and_logit_gradient
    sum_in_fp32: Callable = sum_in_fp32
    scale_: Callable = scale_

    @classmethod
    def compiled(cls) -> ChunkPasses:
        # Static shapes: a micro-batch has at most two chunk sizes (full chunks and the rest), each its own kernel.
        return cls(*(torch.compile(function, dynamic=False)
                     for function in (softmax_statistics, loss_and_logit_gradient, sum_in_fp32, scale_)))


def _through_chunk(h: torch.Tensor, weight: torch.Tensor, local_labels: torch.Tensor, token_weights: torch.Tensor,
                   z_weights: torch.Tensor | None, group: dist.ProcessGroup, valid_columns: int, passes: ChunkPasses,
                   grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: its token losses and log-sum-exps and its share of ``grad_W`` (``g^T h``, model dtype), ``g W``
    written into ``grad_h``. The chunk's logits and ``g`` die when it returns."""
    ranks = dist.get_world_size(group)
    logits = h @ weight.t()
    statistics = passes.statistics(logits, local_labels, valid_columns)
    if ranks > 1:
        gathered = statistics.new_empty((ranks * statistics.shape[0], statistics.shape[1]))
        dist.all_gather_into_tensor(gathered, statistics, group=group)
        statistics = gathered
    grad_logits, losses, log_sum_exp = passes.gradient(logits, statistics.view(ranks, 3, -1), local_labels,
                                                       token_weights, z_weights, valid_columns)
    del logits
    torch.mm(grad_logits, weight, out=grad_h)
    return losses, log_sum_exp, grad_logits.t() @ h


class _LinearCrossEntropy(torch.autograd.Function):
    """(objective, per-token losses, per-token log-sum-exps) from the head's input [tokens, hidden] and weight shard
    [vocab / tp, hidden]: the objective is the sum of weighted token losses, plus the weighted squared log-sum-exps
    with ``z_weights``; the per-token values carry no gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor,
                z_weights: torch.Tensor | None, group: dist.ProcessGroup, vocab_size: int, chunk_tokens: int,
                passes: ChunkPasses) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        local_vocab = weight.shape[0]
        start = dist.get_rank(group) * local_vocab
        valid_columns = min(max(vocab_size - start, 0), local_vocab)
        in_slice = (labels >= start) & (labels < start + valid_columns)
        local_labels = torch.where(in_slice, labels - start, -1)

        token_losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        log_sum_exp = torch.empty_like(token_losses)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = None
        starts = range(0, hidden.shape[0], chunk_tokens)
        for begin in starts:
            chunk = slice(begin, begin + chunk_tokens)
            token_losses[chunk], log_sum_exp[chunk], partial = _through_chunk(
                hidden[chunk], weight, local_labels[chunk], token_weights[chunk],
                None if z_weights is None else z_weights[chunk], group, valid_columns, passes, grad_hidden[chunk])
            # The first chunk's product as it is (one chunk: no fp32 copy); later ones summed in fp32.
            if grad_weight is None:
                grad_weight = partial
            else:
                grad_weight = passes.sum_in_fp32(grad_weight, partial,
                                                 weight.dtype if begin == starts[-1] else torch.float32)
            del partial
        ctx.grad_hidden, ctx.grad_weight, ctx.scale_ = grad_hidden, grad_weight, passes.scale_
        ctx.mark_non_differentiable(token_losses, log_sum_exp)
        objective = (token_weights * token_losses).sum()
        if z_weights is not None:
            objective = objective + (z_weights * log_sum_exp.square()).sum()
        return objective, token_losses, log_sum_exp

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, *_: torch.Tensor):
        # Scaled in place and released: the gradients are this function's outputs, used once.
        grad_hidden, grad_weight = ctx.scale_(ctx.grad_hidden, grad_loss), ctx.scale_(ctx.grad_weight, grad_loss)
        del ctx.grad_hidden, ctx.grad_weight
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         token_weights: torch.Tensor, group: dist.ProcessGroup, vocab_size: int, chunk_tokens: int,
                         passes: ChunkPasses = ChunkPasses(), z_weights: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum(token_weights * losses) [+ sum(z_weights * lse**2)], losses, lse)`` of the logits
    ``hidden @ weight.T``, never materialised beyond ``chunk_tokens`` tokens at a time. ``hidden`` [..., hidden
    size]; ``weight`` [padded vocab / tp, hidden size], the rank's contiguous vocabulary slice in ``group``;
    ``labels``, ``token_weights`` and ``z_weights`` (None: no z-loss) shaped like ``hidden`` without its last
    dimension. ``losses`` and ``lse`` (fp32, no gradient) are the per-token cross-entropy and log-sum-exp over the
    first ``vocab_size`` columns of the logical vocabulary; the scalar backpropagates into ``hidden`` and
    ``weight``."""
    flat_z = None if z_weights is None else z_weights.reshape(-1).float()
    loss, losses, lse = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                                  token_weights.reshape(-1).float(), flat_z, group, vocab_size,
                                                  chunk_tokens, passes)
    return loss, losses.view(labels.shape), lse.view(labels.shape)


def fusable_head(head: nn.Module) -> bool:
    """Whether the head computes plain ``F.linear`` without a bias (a converter may have given it another
    matmul, which the fused loss would bypass)."""
    return head.matmul is F.linear and head.bias is None


class LinearCrossEntropy:
    """The last stage's LM head and loss in one, configured once: ``(head, head input, labels, token weights,
    z-loss weights or None)`` -> ``linear_cross_entropy``'s ``(objective, losses, lse)``. The head
    (``nn.linear.Linear`` or a column-parallel one) supplies the operands of its matmul, its tensor-parallel gather
    included, so the hidden states' gradient flows back through that gather's backward."""

    def __init__(self, group: dist.ProcessGroup, vocab_size: int, chunk_tokens: int, compiled: bool):
        self.group, self.vocab_size, self.chunk_tokens = group, vocab_size, chunk_tokens
        self.passes = ChunkPasses.compiled() if compiled else ChunkPasses()

    def __call__(self, head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor,
                 z_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, weight, _ = head.operands(hidden)
        return linear_cross_entropy(x, weight, labels, token_weights, self.group, self.vocab_size,
                                    self.chunk_tokens, self.passes, z_weights)
