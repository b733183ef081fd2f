"""The step-hook interface: what a training feature (FP8, DoReMi) may add to a run, and when the trainer calls it.

A feature is an object whose hooks the trainer calls at fixed points; every hook does nothing by default, so a
feature writes only the ones it needs. In the order of a run:

- build: ``sampling_weights`` (the data mixture of a stage), ``converters`` (module converters run before the
  weights exist), ``step_terms`` (terms of the step's objective and reports, ``training/objective.py``) and
  ``batch_transforms`` (changes to every micro-batch before the step counts its tokens, ``data/batch.py``);
- resume, before the model exists: ``check_checkpoint`` (any checkpoint weights are loaded from) and
  ``load_state_dict`` (the checkpoint the run continues from; the feature's own entries are in its metadata);
- ``start``, once the run is built and its state loaded: the feature gets the ``Run`` (model, process grid, config,
  progress, run folder);
- every step: ``before_forward_backward`` (the step's micro-batches, on the device), then
  ``after_optimizer_step`` (the update applied, or skipped as a bad step), then ``after_step`` (the step judged;
  its statistics), then ``metrics`` (extra fields of the step's metrics.jsonl record, a collective where the feature
  needs one: every rank calls it);
- every checkpoint: ``state_dict`` (entries of checkpoint.json, JSON values);
- ``after_training``, when the loop ends, normally or not.

The features of a run are ``features_for(config)`` (``features/__init__.py``); the trainer knows none of them by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanotron.checkpoint.manager import TrainingProgress
    from nanotron.config import Config, DatasetStageArgs
    from nanotron.data.batch import BatchTransform, MicroBatch
    from nanotron.models.build import ModuleConverter
    from nanotron.models.spec import CausalLM
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.statistics import Statistics
    from nanotron.training.objective import StepTerm


@dataclass(frozen=True)
class Run:
    """What a feature reaches of the run it is part of (``Feature.start``)."""

    model: CausalLM  # this rank's pipeline stage
    pc: ParallelContext
    config: Config
    progress: TrainingProgress  # the step the run stands at, updated as it trains
    folder: Path  # the run folder (``checkpoints.checkpoints_path``)


class Feature:
    """A part of training that is not the loop itself; subclasses override the hooks they need."""

    def sampling_weights(self, stage: DatasetStageArgs, weights: list[float] | None) -> list[float] | None:
        """The stage's sampling mixture, given the one so far (``dataset_weights``; None: the token shares)."""
        return weights

    def domain_names(self, stage: DatasetStageArgs, names: list[str]) -> list[str]:
        """The names of the stage's domains (metrics, per-domain losses), given those of its folders."""
        return names

    def converters(self, device: torch.device) -> tuple[ModuleConverter, ...]:
        """Module converters for the model (``build_model(converters=...)``) on ``device``."""
        return ()

    def step_terms(self) -> list[StepTerm]:
        """Terms this feature adds to the step (``training/objective.py``): a contribution to the loss, statistics
        (``after_step`` reads their step sums), metrics.jsonl fields."""
        return []

    def batch_transforms(self) -> list[BatchTransform]:
        """Transforms of every micro-batch of the step (``data/batch.py``), after those of the parallel layout."""
        return []

    def check_checkpoint(self, checkpoint: Path, metadata: dict) -> None:
        """Refuse, before the model exists, a checkpoint whose weights this feature could not load."""

    def load_state_dict(self, checkpoint: Path, metadata: dict) -> None:
        """Take this feature's state from the checkpoint the run resumes from (``metadata``: its checkpoint.json)."""

    def start(self, run: Run) -> None:
        """The run is built and its initial state loaded; the first step comes next."""

    def before_forward_backward(self, micro_batches: list[MicroBatch]) -> None:
        """Add to the step's micro-batches (on the device, transformed) what this feature's terms read: the objective's
        ``sample_weights``, tensors of its own in ``extras``."""

    def after_optimizer_step(self, skipped: bool) -> None:
        """The update was applied, or (``skipped``) a bad step's gradients were dropped."""

    def after_step(self, step: int, statistics: Statistics, skipped: bool) -> None:
        """Step ``step`` is over and judged; ``statistics`` are its step statistics (the same on every rank)."""

    def metrics(self) -> dict:
        """Extra fields of the step's metrics record; every rank calls it, every step."""
        return {}

    def state_dict(self) -> dict:
        """Entries of checkpoint.json (top-level keys, JSON values) that ``load_state_dict`` reads back."""
        return {}

    def after_training(self) -> None:
        """The training loop ended (finished, stopped or failed)."""
