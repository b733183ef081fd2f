"""The step's objective on the last pipeline stage: each micro-batch's share of the step loss, and its statistics.

Loss = sum of the token losses over the global count of target tokens (all micro-batches, all data-parallel ranks),
which travels with every micro-batch as ``token_count``; the statistics are that share and, per domain, the sums of
the token losses and the token counts (``parallel/statistics.py`` sums them over micro-batches and ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron.parallel.cross_entropy import vocab_parallel_log_sum_exp, vocab_parallel_token_losses
from nanotron.parallel.statistics import Statistics


def micro_batch_loss(logits: torch.Tensor, micro_batch: dict[str, torch.Tensor], tp_group: dist.ProcessGroup,
                     vocab_size: int, num_domains: int) -> tuple[torch.Tensor, Statistics]:
    """This micro-batch's share of the step loss (its token-loss sum over the global token count, which travels
    with the batch as ``token_count``) and its statistics: that share, and per-domain loss sums and token counts."""
    losses = vocab_parallel_token_losses(logits, micro_batch["labels"], tp_group, vocab_size)
    return loss_and_statistics(losses, micro_batch, num_domains)


def loss_and_statistics(losses: torch.Tensor, micro_batch: dict[str, torch.Tensor],
                        num_domains: int) -> tuple[torch.Tensor, Statistics]:
    """``micro_batch_loss`` from the per-token losses."""
    mask = micro_batch["label_mask"]
    per_sample = torch.where(mask, losses, 0.0).sum(-1)
    loss = per_sample.sum() / micro_batch["token_count"]
    domains = micro_batch["domain_ids"]
    domain_loss_sum = per_domain_sums(per_sample, domains, num_domains)
    domain_tokens = per_domain_sums(mask.sum(-1).float(), domains, num_domains)
    return loss, {"lm_loss": loss, "domain_loss_sum": domain_loss_sum, "domain_tokens": domain_tokens}


def logit_z_loss(logits: torch.Tensor, micro_batch: dict[str, torch.Tensor], tp_group: dist.ProcessGroup,
                 vocab_size: int, coefficient: float) -> torch.Tensor:
    """This micro-batch's share of the z-loss: ``coefficient`` times its sum over target tokens of
    ``logsumexp(logits)**2`` over the step's token count, so that the step's z-loss is the coefficient times the mean
    over the step's target tokens."""
    squares = vocab_parallel_log_sum_exp(logits, tp_group, vocab_size).square()
    return coefficient * torch.where(micro_batch["label_mask"], squares, 0.0).sum() / micro_batch["token_count"]


def mean_weights(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The label mask over the step's token count: summed with these weights, per-token values give their mean over
    the step's target tokens (the language-model loss; the z-loss, whatever the objective's token weights)."""
    return micro_batch["label_mask"] / micro_batch["token_count"]


def per_domain_sums(values: torch.Tensor, domains: torch.Tensor, num_domains: int) -> torch.Tensor:
    """The sums of per-sample ``values`` over the samples of each domain, through a one-hot mask rather than
    ``index_add_``: deterministic (no atomics on GPUs), and compiled alike on every device (the CPU compiler fails
    on an ``index_add_`` into a one-element tensor)."""
    in_domain = domains[:, None] == torch.arange(num_domains, device=values.device)
    return torch.where(in_domain, values[:, None], 0.0).sum(0)


class StepLoss:
    """The objective, computed one of two ways on the last stage: from the logits by ``function`` (a module function,
    which the trainer compiles with the model), or, with the fused LM head + loss, from each token's weight in the
    objective (``token_weights``: ``loss = sum(weights * token losses)``) and the per-token losses it returns
    (``statistics``). A feature training on another objective (``Feature.loss``) gives a subclass."""

    function = staticmethod(micro_batch_loss)

    def token_weights(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The label mask over the step's token count, so that the fused objective is ``micro_batch_loss``'s."""
        return mean_weights(micro_batch)

    def statistics(self, losses: torch.Tensor, micro_batch: dict[str, torch.Tensor], num_domains: int) -> Statistics:
        """The statistics of a micro-batch from its per-token losses."""
        return loss_and_statistics(losses, micro_batch, num_domains)[1]

    def template(self, num_domains: int) -> dict[str, tuple[int, ...]]:
        """The shapes of the statistics (``parallel/statistics.py`` sums them over stages and ranks)."""
        return {"lm_loss": (), "domain_loss_sum": (num_domains,), "domain_tokens": (num_domains,)}
