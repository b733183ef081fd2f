"""The training step's forward and backward: the ``StepProgram``, built once per run from what the parts of the run hand
in, and run on every step's micro-batches.

One step, on every rank:

1. each micro-batch goes to the device and through the batch transforms (``data/batch.py``), in order: context
   parallelism cuts it to the rank's tokens; then the features' ``before_forward_backward`` adds what their terms read;
2. the target tokens of the whole global batch (every micro-batch of every data- and context-parallel rank) are
   counted, and every micro-batch carries the count (``MicroBatch.token_count``);
3. the pipeline schedule (``parallel/pipeline_parallel.py``) runs every micro-batch's forward through this stage's
   model chunks (``stage_forward``: the chunk, then the data stage's step terms, ``training/objective.py``) and its
   backward, in the order of the layout's schedule, and sums the terms' statistics over the micro-batches; before
   the first backward, the statistics a term pools (the expert counts of a global-batch balance loss) are summed
   over the ranks that see other tokens and handed to it, once every forward has run;
   data-parallel gradient reduction starts once the remaining gradients are the last micro-batch's and finishes
   after them, and the copies of tied weights are synchronised;
4. the statistics are summed over stages and ranks: every rank returns the step's.

Because the loss is each target token's loss over the global count (1, 2), every split of the global batch into ranks
and micro-batches gives the same gradients. Who hands in what:

- the run: the language-model loss of each data stage (with the family's z-loss coefficient; fused with the LM head
  where ``model.loss_chunk_tokens`` says so), and under document masking the attention pairs that MFU counts;
- the family: ``ModelSpec.step_terms`` (a mixture of experts' router losses, multi-token prediction's loss) and
  ``ModelSpec.batch_transforms``, first (multi-token prediction's tokens ahead, which context parallelism then cuts);
- the features: ``Feature.step_terms`` and ``Feature.batch_transforms`` (DoReMi's excess loss);
- the parallel layout: its batch transforms (context parallelism's ``ContextParallelBatches``).

The trainer calls ``run`` and reads the step's report (``report``); it names no term and no transform.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from nanotron.config import Config
from nanotron.data.batch import BatchTransform, MicroBatch
from nanotron.data.dataset import SampleSource
from nanotron.layout import Axis, Group
from nanotron.models.build import stage_chunks
from nanotron.models.registry import spec_for_config
from nanotron.models.spec import CausalLM, ModelCosts
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.context_parallel import ContextParallelBatches
from nanotron.parallel.data_parallel import GradientBuckets, sync_tied_copies
from nanotron.parallel.pipeline_parallel import Chunk, StageOutput
from nanotron.parallel.statistics import Statistics, sum_over_replicas
from nanotron.training.build import pipeline_schedule
from nanotron.training.objective import AttentionPairs, LanguageModelLoss, Objective, StageOutputs, fused_head_loss

if TYPE_CHECKING:
    from nanotron.training.hooks import Feature


class StepProgram:
    """Runs the forward and backward of a step's micro-batches on this rank (``run``) with the step terms of its data
    stage (``objectives``, by stage name) and the batch ``transforms``; the last stage's model returns the logits
    (``logits``) or the LM head's input, for a loss fused with the head."""

    def __init__(self, config: Config, pc: ParallelContext, model: CausalLM, buckets: GradientBuckets,
                 objectives: dict[str, Objective], transforms: Sequence[BatchTransform], features: Sequence[Feature],
                 logits: bool = True):
        self.config, self.pc, self.model, self.buckets = config, pc, model, buckets
        self.objectives, self.transforms, self.features = objectives, list(transforms), list(features)
        self.logits = logits
        self.objective = next(iter(objectives.values()))  # the terms of the step that runs (``run`` sets them)
        chunks = [Chunk(functools.partial(self.stage_forward, view), list(view.parameters()))
                  for view in stage_chunks(model)]
        self.schedule = pipeline_schedule(config, pc, chunks, self._before_last_backward, self._before_first_backward)

    @classmethod
    def build(cls, config: Config, pc: ParallelContext, model: CausalLM, buckets: GradientBuckets,
              datasets: dict[str, SampleSource], features: Sequence[Feature], costs: ModelCosts) -> StepProgram:
        """The program of a run whose data stages read ``datasets`` (by stage name), with its terms and transforms
        from the run, the family, the parallel layout and the ``features``."""
        model_config = config.model.model_config
        spec = spec_for_config(model_config)
        terms = spec.step_terms(config)
        if model_config.document_masking:
            terms.append(AttentionPairs(costs))
        terms += [term for feature in features for term in feature.step_terms()]
        head = fused_head_loss(config, pc, model)

        def language_model(dataset: SampleSource) -> LanguageModelLoss:
            return LanguageModelLoss(dataset.domain_names, pc.group(Group.TP), model_config.vocab_size,
                                     model_config.logit_z_loss, head, config.model.compile)

        objectives = {stage: Objective(language_model(dataset), terms) for stage, dataset in datasets.items()}
        transforms = spec.batch_transforms(model_config)
        if pc.size(Axis.CP) > 1:
            flash = getattr(model, "flash_attention", False)
            transforms.append(ContextParallelBatches(pc.coord(Axis.CP), pc.size(Axis.CP), flash))
        transforms += [transform for feature in features for transform in feature.batch_transforms()]
        return cls(config, pc, model, buckets, objectives, transforms, features, logits=head is None)

    def objective_at(self, step: int) -> Objective:
        """The step terms of optimizer step ``step`` (those of its data stage)."""
        return self.objectives[self.config.data_stage_at(step).name]

    def run(self, micro_batches: list[MicroBatch], step: int) -> Statistics:
        """The statistics of optimizer step ``step`` (``training/objective.py``'s ``LOSS`` is its mean token loss), the
        same on every rank; gradients end in the buckets, summed over replicas and tied copies."""
        self.objective = self.objective_at(step)
        batches = [batch.to(self.pc.device) for batch in micro_batches]
        for transform in self.transforms:
            batches = [transform.prepare(batch) for batch in batches]
        for feature in self.features:
            feature.before_forward_backward(batches)
        counts = torch.stack([batch.target_counts() for batch in batches]).sum(0).float()
        dist.all_reduce(counts, group=self.pc.group(Group.DENSE_REPLICAS))
        counts = counts.clamp(min=1.0)
        for batch in batches:
            batch.set_token_counts(counts)

        statistics = self.schedule.run(batches, step)
        self.buckets.finish_reduction()
        if self.pc.pipeline_ends is not None:
            sync_tied_copies(self.buckets, self.pc.pipeline_ends)
        return sum_over_replicas(statistics, self.objective.template() | self.schedule.template(), self.pc)

    def stage_forward(self, module: nn.Module, batch: MicroBatch, hidden_states: torch.Tensor | None) -> StageOutput:
        """The forward of model chunk ``module`` on one micro-batch (``hidden_states``: the previous chunk's
        activations), and the step terms on its outputs: their contributions to the loss and their statistics."""
        # A later stage takes the ids too, for the sequence's length (its rotary tables), not for their values; every
        # stage takes the tokens' positions and documents where the batch has them, and the transforms' inputs.
        inputs = batch.model_inputs()
        for transform in self.transforms:
            inputs |= transform.model_inputs(batch)
        last = module.lm_head is not None
        output = module(input_ids=batch.input_ids, hidden_states=hidden_states, head=self.logits, **inputs)
        losses, statistics = self.objective.compute(StageOutputs(module, output, last), batch)
        return StageOutput(None if last else output, statistics, tuple(losses))

    def report(self, step: int, sums: Statistics, skipped: bool) -> tuple[dict[str, float] | None, dict]:
        """What the step's record shows of its statistics (host copies): each domain's mean token loss (None for a
        data stage of one domain; none for a skipped step), and the terms' metrics (none for a skipped step)."""
        objective = self.objective_at(step)
        language_model = objective.language_model
        if len(language_model.domain_names) == 1:
            domain_losses = None
        else:
            domain_losses = {} if skipped else language_model.domain_losses(sums)
        return domain_losses, {} if skipped else objective.metrics(sums) | self.schedule.metrics(sums)

    def _before_first_backward(self, statistics: Statistics) -> None:
        """Every forward of the step has run where a term pools statistics (``Objective.pooled``; the layout then
        runs every forward first): hand it their sums over the step's micro-batches and the ranks of this stage that
        see other tokens (data, context and expert parallel)."""
        template = self.objective.pooled()
        if template:
            self.objective.pool(sum_over_replicas(statistics, template, self.pc, Group.DENSE_REPLICAS))

    def _before_last_backward(self) -> None:
        """Gradients of the last micro-batch complete the step: buckets may now be reduced as they fill up."""
        self.buckets.final_micro_batch = True
