"""DoReMi's proxy training: the trainer with a frozen reference model, weighted domain losses and domain weights
that change every step (``doremi/weights.py``).

Every step, on the same global batch at any layout:

1. the batch is drawn uniformly over the domains (or by ``dataset_weights``), as in any run, so that every domain
   is in every batch and has its excess loss measured: drawing batches by the learned weights instead let one
   domain take whole batches within 200 steps on the demo corpus, after which the others were never measured
   again and their weights could not recover;
2. the reference model (any checkpoint: it is rebuilt at this run's tp/pp, without autograd) gives every token's
   loss ``ℓ_ref``;
3. the proxy minimises ``Σ_i α_i · mean loss of domain i`` (the DRO objective; each domain's mean is over its
   tokens in the global batch, whose counts are summed over data-parallel ranks first, so the gradients do not
   depend on the split over ranks and micro-batches);
4. the per-domain sums of ``max(ℓ - ℓ_ref, 0)`` and token counts travel as step statistics (summed over
   micro-batches, stages and data-parallel ranks), and update ``α`` for the next step.

The weights are saved in every checkpoint (``domain_weights``), so a resumed run continues the same trajectory;
the weights of every step go to ``domain_weights.jsonl`` in ``checkpoints_path`` and to metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from nanotron.checkpoint.integrity import read_metadata
from nanotron.checkpoint.run_folder import resolve_checkpoint
from nanotron.config import Config, ConfigError
from nanotron.doremi.weights import HISTORY_FILE, WeightHistory, updated_weights
from nanotron.generation.generate import forward_logits, load_model
from nanotron.parallel.cross_entropy import vocab_parallel_token_losses
from nanotron.parallel.statistics import Statistics
from nanotron.trainer import StepResult, Trainer, loss_and_statistics, per_domain_sums


def reference_checkpoint(config: Config) -> Path:
    """The reference model's checkpoint, checked before anything is allocated: present and of the same vocabulary."""
    if config.doremi is None or config.doremi.ref_model_resume_checkpoint_path is None:
        raise ConfigError("doremi.ref_model_resume_checkpoint_path is not set; point it at the reference model "
                          "trained with examples/doremi/train_reference.py")
    if len(config.data_stages) != 1:
        raise ConfigError(f"DoReMi proxy training takes one data stage (its domains); data_stages has "
                          f"{len(config.data_stages)}")
    path = Path(config.doremi.ref_model_resume_checkpoint_path)
    if not path.exists():
        raise ConfigError(f"doremi.ref_model_resume_checkpoint_path {path} does not exist; train the reference "
                          "first (examples/doremi/train_reference.py) or fix the path")
    checkpoint = resolve_checkpoint(path)
    vocab = read_metadata(checkpoint)["model"]["vocab_size"]
    if vocab != config.model.model_config.vocab_size:
        raise ConfigError(f"the reference {checkpoint} has a vocabulary of {vocab} but model.model_config.vocab_size "
                          f"is {config.model.model_config.vocab_size}: reference and proxy must share a tokenizer")
    return checkpoint


def weighted_micro_batch_loss(logits: torch.Tensor, micro_batch: dict[str, torch.Tensor],
                              tp_group: dist.ProcessGroup, vocab_size: int,
                              num_domains: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The proxy's loss, ``Σ_i α_i · mean loss of domain i`` (each token weighted by its domain's
    ``domain_token_weights``), with the step statistics and each domain's excess loss over the reference."""
    losses = vocab_parallel_token_losses(logits, micro_batch["labels"], tp_group, vocab_size)
    _, statistics = loss_and_statistics(losses, micro_batch, num_domains)
    mask, domains = micro_batch["label_mask"], micro_batch["domain_ids"]
    per_sample = torch.where(mask, losses, 0.0).sum(-1)
    loss = (per_sample * micro_batch["domain_token_weights"][domains]).sum()
    excess = torch.where(mask, (losses - micro_batch["reference_losses"]).clamp(min=0.0), 0.0).sum(-1)
    statistics["excess_loss_sum"] = per_domain_sums(excess.detach(), domains, num_domains)
    return loss, statistics


class DoReMiTrainer(Trainer):
    """Trains the proxy model of a DoReMi run (``doremi`` section with a reference checkpoint)."""

    loss_function = staticmethod(weighted_micro_batch_loss)

    def __init__(self, config: Config, converters=()):
        reference = reference_checkpoint(config)
        super().__init__(config, converters)
        try:
            self.reference, _ = load_model(reference, self.pc)
            self.reference.requires_grad_(False)
        except BaseException:
            self.pc.destroy()
            raise
        domains = len(self.config.data_stages[0].data.dataset.dataset_folder)
        saved, doremi = self.progress.domain_weights, self.config.doremi
        if saved is not None:
            self.weights = list(saved)
        elif doremi.domain_weights is not None:
            self.weights = list(doremi.domain_weights)
        else:
            self.weights = [1.0 / domains] * domains
        self.history = None
        if self.pc.rank == 0:
            self.history = WeightHistory(Path(self.config.checkpoints.checkpoints_path) / HISTORY_FILE,
                                         self.progress.step)

    def _sampling_weights(self, stage) -> list[float]:
        """Uniform over the domains unless ``dataset_weights`` say otherwise: ``doremi.domain_weights`` are the
        proxy's starting loss weights, not its sampling mixture."""
        return stage.data.dataset.dataset_weights or [1.0] * len(stage.data.dataset.dataset_folder)

    def _statistics_template(self) -> dict[str, tuple[int, ...]]:
        return super()._statistics_template() | {"excess_loss_sum": (self._num_domains,)}

    @torch.no_grad()
    def _reference_losses(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        logits = forward_logits(self.reference, self.pc, micro_batch["input_ids"], None, None, None,
                                last_only=False, gather=False)
        if logits is None:  # not the last pipeline stage
            return None
        return vocab_parallel_token_losses(logits, micro_batch["labels"], self.pc.groups["tp"],
                                           self.reference.config.vocab_size)

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> Statistics:
        """Each micro-batch also carries its reference losses and the loss weight of a token of each domain:
        ``α_i`` over domain ``i``'s token count in the global batch (0 for a domain absent from it)."""
        device = self.pc.device
        batches = [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches]
        tokens = sum(per_domain_sums(mb["label_mask"].sum(-1).float(), mb["domain_ids"], self._num_domains)
                     for mb in batches)
        dist.all_reduce(tokens, group=self.pc.groups["dp_ep"])
        weights = torch.tensor(self.weights, device=device, dtype=torch.float32)
        per_token = torch.where(tokens > 0, weights / tokens.clamp(min=1.0), 0.0)
        for mb in batches:
            mb["domain_token_weights"] = per_token
            reference = self._reference_losses(mb)
            if reference is not None:
                mb["reference_losses"] = reference
        self._step_statistics = super().forward_backward(batches)
        return self._step_statistics

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], lr: float) -> StepResult:
        """The step with this step's weights, then the weights of the next one."""
        result = super().train_step(micro_batches, lr)
        used, doremi, statistics = self.weights, self.config.doremi, self._step_statistics
        if not result.skipped:
            self.weights = updated_weights(used, statistics["excess_loss_sum"].tolist(),
                                           statistics["domain_tokens"].tolist(), doremi.step_size,
                                           doremi.smoothing_param)
        self.progress.domain_weights = self.weights
        result.model_metrics = result.model_metrics | {"domain_weights": dict(zip(self._domain_names, used))}
        if self.history is not None:
            self.history.write(self.progress.step + 1, self._domain_names, used)
        return result

    def train(self) -> None:
        try:
            super().train()
        finally:
            if self.history is not None:
                self.history.close()
