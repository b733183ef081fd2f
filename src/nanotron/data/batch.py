"""What one micro-batch carries from the loader through the step (``MicroBatch``), and what may change it on the way
(``BatchTransform``).

The loader (``data/loader.py``) writes the data fields; the step program (``training/step.py``) moves the batch to
the device, lets the batch transforms prepare it (context parallelism cuts it to the rank's tokens; a transform may
mask targets), adds the step's token count, and hands it to the stage forward and the step terms
(``training/objective.py``). Fields are read by name; only tensors that one feature or mechanism both writes and
reads go in ``extras``, under the keys its docstring lists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class MicroBatch:
    """``micro_batch_size`` samples of one data-parallel rank, as one forward and backward trains on them.

    Per-token tensors are ``[batch, seq]`` (``seq``: the rank's part of the sequence once context parallelism cut
    it); ``domain_ids`` and ``sample_weights`` are per sample. ``extras`` holds, by key:

    - ``reference_losses`` [batch, seq]: DoReMi's proxy (``features/doremi.py``), the reference model's loss of every
      token, on the last pipeline stage; its excess-loss term reads them;
    - ``key_document_ids`` [batch, seq]: context parallelism under document masking
      (``parallel/context_parallel.py``), the document of every token of the whole sequences, for the keys' side of
      the attention mask;
    - ``ahead_ids``, ``ahead_labels``, ``ahead_label_mask`` [batch, seq, D]: DeepSeek-V3's multi-token prediction
      (``models/deepseek_v3/mtp_loss.py``), for each depth k the token k ahead of every position, the token k + 1
      past its next one and whether that target counts; ``ahead_token_counts`` [D] the step's count of each depth's
      targets, set beside ``token_count`` (``target_counts``).
    """

    input_ids: torch.Tensor  # int64
    labels: torch.Tensor  # int64: the next token of every position
    label_mask: torch.Tensor  # bool: the targets the objective counts
    domain_ids: torch.Tensor  # int64 [batch]: each sample's domain among its data stage's
    # Under document masking (``data/loader.py``): each token's position in its document, and its document's index in
    # the sample; under context parallelism, positions in the whole sequence (``ContextParallelBatches``).
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    # The step's target tokens over every micro-batch and data- and context-parallel rank, at least 1 (set by the step
    # program before the forward): the language-model loss is each token's loss over it.
    token_count: torch.Tensor | None = None
    # float [batch]: the weight of each target token of a sample in the objective, where a feature trains on another
    # one than the mean token loss (DoReMi's per-domain weights); None: 1 / token_count.
    sample_weights: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> MicroBatch:
        """The batch on the training device. On CUDA through pinned memory: the driver stages a copy from pageable
        memory and can hold the host until the GPU reaches it, which would keep the host from queueing a step while
        the previous one runs."""
        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            if device.type != "cuda" or tensor.device.type != "cpu":
                return tensor.to(device)
            return tensor.pin_memory().to(device, non_blocking=True)

        tensors = {name: moved(getattr(self, name)) for name in self.tensor_fields()}
        return dataclasses.replace(self, **tensors, extras={key: moved(value) for key, value in self.extras.items()})

    def tensor_fields(self) -> tuple[str, ...]:
        """The names of the tensor fields (``extras`` aside)."""
        return tuple(f.name for f in dataclasses.fields(self) if f.name != "extras")

    def target_counts(self) -> torch.Tensor:
        """This batch's targets: the count of ``label_mask``, then of each column of ``extras["ahead_label_mask"]``
        where it has one (the step sums them over its micro-batches and ranks, ``set_token_counts``)."""
        counts = [self.label_mask.sum().reshape(1)]
        if "ahead_label_mask" in self.extras:
            counts.append(self.extras["ahead_label_mask"].sum((0, 1)))
        return torch.cat(counts)

    def set_token_counts(self, counts: torch.Tensor) -> None:
        """Hand the batch the step's sums of ``target_counts``: ``token_count`` and ``extras["ahead_token_counts"]``."""
        self.token_count = counts[0]
        if "ahead_label_mask" in self.extras:
            self.extras["ahead_token_counts"] = counts[1:]

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The positions and document ids the model takes, where the batch has them (every pipeline stage: its
        attention reads them)."""
        inputs = {"position_ids": self.position_ids, "document_ids": self.document_ids}
        return {name: value for name, value in inputs.items() if value is not None}


class BatchTransform(Protocol):
    """A change to every micro-batch of the step, by a parallel mechanism (context parallelism's split) or a feature;
    the step program applies the transforms in order."""

    def prepare(self, batch: MicroBatch) -> MicroBatch:
        """The micro-batch this rank trains on (on the device, before the step counts its target tokens: a transform
        may cut the batch or mask targets)."""

    def model_inputs(self, batch: MicroBatch) -> dict[str, Any]:
        """Keyword inputs of the model for a prepared micro-batch, beside its ids, positions and documents (on every
        pipeline stage)."""
