"""The step's objective and what it reports, as step terms: each one a contribution to the loss and named statistics.

A ``StepTerm`` says which statistics it reports (``template``: names and shapes), computes them and its contribution
to the loss from one stage's forward of one micro-batch (``compute``), and turns the step's sums of its statistics
into metrics.jsonl fields (``metrics``). Rules:

- the loss is the sum of the terms' contributions; each is already the micro-batch's share of the step value, so the
  schedule backpropagates them as they are (each a root of the stage's backward), and any split of the global batch
  over ranks and micro-batches gives the same gradients;
- the language-model loss (``LanguageModelLoss``) is every target token's loss times its weight: 1 over the step's
  count of target tokens (``MicroBatch.token_count``), or the batch's ``sample_weights`` where a feature trains on
  another objective (DoReMi); with the family's z-loss coefficient it adds the z-loss on the logits, whose per-token
  log-sum-exp the fused head already has;
- statistics are sums (``parallel/statistics.py``): over the step's micro-batches, then over stages and data- and
  context-parallel ranks; a rank that does not compute one of the template's counts zero for it;
- ``metrics`` is asked only of a step whose update was applied;
- a term whose gradient needs statistics of the whole step (the global batch's expert counts) names them
  (``pooled()``) and gets their sums over the step's micro-batches and the ranks that see other tokens (``pool``)
  after every forward of the step and before its first backward; the layout then runs every forward first.

Who hands in terms (``training/step.py`` puts them together, once per data stage): the run (the language-model loss,
and under document masking ``AttentionPairs``, the FLOPs of the attention MFU counts); the family
(``ModelSpec.step_terms``: a mixture of experts' router losses); the features (``Feature.step_terms``: DoReMi's excess
loss).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from nanotron.config import Config
from nanotron.data.batch import MicroBatch
from nanotron.layout import Group
from nanotron.models.spec import CausalLM, ModelCosts
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.cross_entropy import vocab_parallel_log_sum_exp, vocab_parallel_token_losses
from nanotron.parallel.linear_cross_entropy import LinearCrossEntropy, fusable_head
from nanotron.parallel.statistics import Statistics

logger = logging.getLogger("nanotron.trainer")

LOSS = "lm_loss"  # the statistic of the step's mean token loss, which every objective reports
ATTENTION_FLOPS = "attention_flops"  # the statistic MFU counts under document masking (``training/step_log.py``)


@dataclass
class StageOutputs:
    """What one stage's forward of one micro-batch produced, for the terms: the stage ``module`` that ran, its
    ``output`` (activations; on the last stage the logits, or the head's input where the head is fused with the
    loss), whether it is the ``last`` stage, and the per-token losses (no gradient) once the language-model loss has
    computed them, for the terms after it."""

    module: nn.Module
    output: torch.Tensor
    last: bool
    token_losses: torch.Tensor | None = None
    # (output, labels, token weights) -> (the weighted sum of the token losses, the token losses without gradient):
    # the language-model loss's head and cross-entropy on other outputs of the stage like ``output`` (the logits, or
    # the head's input where the head is fused with the loss), for terms that score them (multi-token prediction)
    score: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


class StepTerm(Protocol):
    def template(self) -> dict[str, tuple[int, ...]]:
        """The names and shapes of the statistics this term reports."""

    def compute(self, stage: StageOutputs, batch: MicroBatch) -> tuple[torch.Tensor | None, Statistics]:
        """This micro-batch's contribution to the loss on this stage (None: none) and its statistics."""

    def metrics(self, sums: Statistics) -> dict:
        """metrics.jsonl fields from the step's statistics (host copies)."""


# --- the language-model loss -----------------------------------------------------------------------------------------

def micro_batch_loss(logits: torch.Tensor, batch: MicroBatch, tp_group: dist.ProcessGroup, vocab_size: int,
                     num_domains: int) -> tuple[torch.Tensor, Statistics, torch.Tensor]:
    """This micro-batch's share of the objective from the logits, its statistics (``loss_and_statistics``) and the
    per-token losses; a module function, which ``LanguageModelLoss`` compiles with the model."""
    losses = vocab_parallel_token_losses(logits, batch.labels, tp_group, vocab_size)
    return *loss_and_statistics(losses, batch, num_domains), losses


def loss_and_statistics(losses: torch.Tensor, batch: MicroBatch, num_domains: int) -> tuple[torch.Tensor, Statistics]:
    """This micro-batch's share of the objective from its per-token losses, and its statistics: its share of the
    step's mean token loss (``LOSS``), and per domain the sums of the token losses and the token counts."""
    mask = batch.label_mask
    per_sample = torch.where(mask, losses, 0.0).sum(-1)
    mean = per_sample.sum() / batch.token_count
    loss = mean if batch.sample_weights is None else (per_sample * batch.sample_weights).sum()
    domain_loss_sum = per_domain_sums(per_sample, batch.domain_ids, num_domains)
    domain_tokens = per_domain_sums(mask.sum(-1).float(), batch.domain_ids, num_domains)
    return loss, {LOSS: mean, "domain_loss_sum": domain_loss_sum, "domain_tokens": domain_tokens}


def logit_z_loss(logits: torch.Tensor, batch: MicroBatch, tp_group: dist.ProcessGroup, vocab_size: int,
                 coefficient: float) -> torch.Tensor:
    """This micro-batch's share of the z-loss: ``coefficient`` times its sum over target tokens of
    ``logsumexp(logits)**2`` over the step's token count, so that the step's z-loss is the coefficient times the mean
    over the step's target tokens."""
    squares = vocab_parallel_log_sum_exp(logits, tp_group, vocab_size).square()
    return coefficient * torch.where(batch.label_mask, squares, 0.0).sum() / batch.token_count


def mean_weights(batch: MicroBatch) -> torch.Tensor:
    """The label mask over the step's token count: summed with these weights, per-token values give their mean over
    the step's target tokens (the language-model loss; the z-loss, whatever the objective's token weights)."""
    return batch.label_mask / batch.token_count


def token_weights(batch: MicroBatch) -> torch.Tensor:
    """Each token's weight in the objective, for the fused head: ``mean_weights``, or the batch's ``sample_weights``
    on its target tokens."""
    if batch.sample_weights is None:
        return mean_weights(batch)
    return torch.where(batch.label_mask, batch.sample_weights[:, None], 0.0)


def per_domain_sums(values: torch.Tensor, domains: torch.Tensor, num_domains: int) -> torch.Tensor:
    """The sums of per-sample ``values`` over the samples of each domain, through a one-hot mask rather than
    ``index_add_``: deterministic (no atomics on GPUs), and compiled alike on every device (the CPU compiler fails
    on an ``index_add_`` into a one-element tensor)."""
    in_domain = domains[:, None] == torch.arange(num_domains, device=values.device)
    return torch.where(in_domain, values[:, None], 0.0).sum(0)


class LanguageModelLoss:
    """The language-model loss of one data stage (whose ``domain_names`` the per-domain statistics follow), on the
    last stage: from the logits (``micro_batch_loss``, compiled with the model), or with ``head`` (the LM head fused
    with the loss, ``parallel/linear_cross_entropy.py``) from the head's input; plus ``z_loss`` times the z-loss."""

    def __init__(self, domain_names: list[str], tp_group: dist.ProcessGroup, vocab_size: int, z_loss: float = 0.0,
                 head: LinearCrossEntropy | None = None, compiled: bool = False):
        self.domain_names, self.tp_group, self.vocab_size = domain_names, tp_group, vocab_size
        self.z_loss, self.head = z_loss, head
        # Compiling the loss fuses the fp32 upcast of the logits into the softmax instead of materialising it.
        self.loss = torch.compile(micro_batch_loss) if compiled else micro_batch_loss
        self.logit_z_loss = torch.compile(logit_z_loss) if compiled else logit_z_loss

    def template(self) -> dict[str, tuple[int, ...]]:
        domains = (len(self.domain_names),)
        template = {LOSS: (), "domain_loss_sum": domains, "domain_tokens": domains}
        return template | {"z_loss": ()} if self.z_loss else template

    def score(self, module: nn.Module, output: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``StageOutputs.score`` on the stage ``module``: the token losses of ``output`` (as the stage returns it)
        against ``labels``, summed with ``weights``, and the token losses without gradient."""
        if self.head is None:
            losses = vocab_parallel_token_losses(output, labels, self.tp_group, self.vocab_size)
            return (losses * weights).sum(), losses.detach()
        loss, losses, _ = self.head(module.lm_head, output, labels, weights)
        return loss, losses

    def compute(self, stage: StageOutputs, batch: MicroBatch) -> tuple[torch.Tensor | None, Statistics]:
        if not stage.last:
            return None, {}
        stage.score = functools.partial(self.score, stage.module)
        if self.head is None:
            loss, statistics, losses = self.loss(stage.output, batch, self.tp_group, self.vocab_size,
                                                 len(self.domain_names))
            if self.z_loss:
                z_loss = self.logit_z_loss(stage.output, batch, self.tp_group, self.vocab_size, self.z_loss)
                loss, statistics = loss + z_loss, statistics | {"z_loss": z_loss.detach()}
            stage.token_losses = losses.detach()
            return loss, statistics
        z_weights = self.z_loss * mean_weights(batch) if self.z_loss else None
        loss, losses, log_sum_exp = self.head(stage.module.lm_head, stage.output, batch.labels, token_weights(batch),
                                              z_weights)
        statistics = loss_and_statistics(losses, batch, len(self.domain_names))[1]
        if self.z_loss:
            statistics["z_loss"] = (z_weights * log_sum_exp.square()).sum()
        stage.token_losses = losses
        return loss, statistics

    def metrics(self, sums: Statistics) -> dict:
        return {"z_loss": sums["z_loss"].item()} if self.z_loss else {}

    def domain_losses(self, sums: Statistics) -> dict[str, float]:
        """The mean token loss of each domain present in the step's batch."""
        totals, counts = sums["domain_loss_sum"].tolist(), sums["domain_tokens"].tolist()
        return {name: total / count for name, total, count in zip(self.domain_names, totals, counts) if count}


def fused_head_loss(config: Config, pc: ParallelContext, model: CausalLM) -> LinearCrossEntropy | None:
    """The LM head and the loss in one, chunk by chunk (``model.loss_chunk_tokens``), on the stage of the head; None:
    the model returns the logits and the loss function takes them."""
    chunk_tokens = config.model.loss_chunk_tokens
    if chunk_tokens == 0 or model.lm_head is None:
        return None
    if not fusable_head(model.lm_head):
        logger.warning("model.loss_chunk_tokens is ignored: a converter gave the LM head another matmul (or it "
                       "has a bias), which the fused loss would bypass; the logits are computed in full")
        return None
    return LinearCrossEntropy(pc.group(Group.TP), config.model.model_config.vocab_size, chunk_tokens,
                              compiled=config.model.compile)


# --- what MFU counts ------------------------------------------------------------------------------------------------

class AttentionPairs:
    """Under document masking, the training FLOPs of the attention the step computed (``ATTENTION_FLOPS``: the
    (query, key) pairs of each query's document, ``ModelCosts.document_attention_flops``), counted on the last stage
    over each rank's queries, so that summed over the ranks it is the step's; the step log reads it for MFU and
    TFLOP/s in place of causal attention over whole sequences. No contribution to the loss, no metric of its own."""

    def __init__(self, costs: ModelCosts):
        self.costs = costs

    def template(self) -> dict[str, tuple[int, ...]]:
        return {ATTENTION_FLOPS: ()}

    def compute(self, stage: StageOutputs, batch: MicroBatch) -> tuple[torch.Tensor | None, Statistics]:
        if not stage.last:
            return None, {}
        return None, {ATTENTION_FLOPS: self.costs.document_attention_flops(batch.position_ids)}

    def metrics(self, sums: Statistics) -> dict:
        return {}


class Objective:
    """The step terms of one data stage, in order: ``language_model`` first (its per-token losses are there for the
    terms after it), then ``terms``."""

    def __init__(self, language_model: LanguageModelLoss, terms: list[StepTerm]):
        self.language_model = language_model
        self.terms = [language_model, *terms]

    def template(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for term in self.terms for name, shape in term.template().items()}

    def compute(self, stage: StageOutputs, batch: MicroBatch) -> tuple[list[torch.Tensor], Statistics]:
        """Every term's contribution to the loss (those it has), in order, and their statistics."""
        losses, statistics = [], {}
        for term in self.terms:
            loss, term_statistics = term.compute(stage, batch)
            if loss is not None:
                losses.append(loss)
            statistics |= term_statistics
        return losses, statistics

    def metrics(self, sums: Statistics) -> dict:
        return {name: value for term in self.terms for name, value in term.metrics(sums).items()}

    def pooled(self) -> dict[str, tuple[int, ...]]:
        """The statistics (names and shapes) that terms need summed over the whole step before its first backward
        (a term's optional ``pooled()``)."""
        return {name: shape for term in self.terms if hasattr(term, "pool") for name, shape in term.pooled().items()}

    def pool(self, sums: Statistics) -> None:
        """Hand the pooling terms the step's sums of their ``pooled`` statistics."""
        for term in self.terms:
            if hasattr(term, "pool"):
                term.pool({name: sums[name] for name in term.pooled()})
