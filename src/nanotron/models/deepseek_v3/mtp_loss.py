"""Multi-token prediction's part of the training step (``mtp.py``): the tokens ahead each micro-batch carries
(``MultiTokenBatches``, the family's batch transform) and the loss of the prediction depths (``MultiTokenLoss``, the
family's step term).

Rules:

- depth k (1..D) at position i reads token i + k and predicts token i + k + 1; with the next-token ``labels`` (label i
  is token i + 1) those are ``labels[i + k - 1]`` and ``labels[i + k]``. The transform cuts them from the whole
  sequences before context parallelism cuts the batch (``[batch, seq, D]`` extras, cut like every per-token tensor),
  so a rank's last positions read the next chunk's tokens without an exchange;
- a depth-k target counts where it lies inside the sequence (i + k < seq: k fewer targets per sequence than the
  next-token loss), where the batch counts the target ``labels[i + k]`` (``label_mask``) and, under document
  masking, where positions i and i + k are in one document (the target then is too);
- depth k's loss L_k is the sum of its token losses over the step's count of depth-k targets (every micro-batch,
  data- and context-parallel rank, ``MicroBatch.target_counts``), like the next-token loss: any split of the global
  batch gives the same gradients. The objective adds ``mtp_loss_scaling_factor / D * sum_k L_k``;
- metrics.jsonl records ``mtp_loss``, the mean of the L_k (unscaled, comparable with ``lm_loss``, which stays the
  next-token loss), and with D > 1 every depth's in ``mtp_depth_losses``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.data.batch import MicroBatch
from nanotron.parallel.statistics import Statistics

MTP_LOSS = "mtp_loss"


def shifted(values: torch.Tensor, by: int, fill: Any) -> torch.Tensor:
    """``values`` [batch, seq] moved ``by`` positions to the left along the sequence, ``fill`` in the last ones."""
    rows, sequence = values.shape
    tail = torch.full((rows, min(by, sequence)), fill, dtype=values.dtype, device=values.device)
    return torch.cat([values[:, by:], tail], dim=1)


def tokens_ahead(batch: MicroBatch, depths: int) -> dict[str, torch.Tensor]:
    """The extras of multi-token prediction for whole sequences (the module's rules): ``ahead_ids``,
    ``ahead_labels`` and ``ahead_label_mask``, each [batch, seq, depths]."""
    ids, labels, mask = [], [], []
    for k in range(1, depths + 1):
        ids.append(shifted(batch.labels, k - 1, 0))
        labels.append(shifted(batch.labels, k, 0))
        counted = shifted(batch.label_mask, k, False)
        if batch.document_ids is not None:
            counted = counted & (shifted(batch.document_ids, k, -1) == batch.document_ids)
        mask.append(counted)
    return {"ahead_ids": torch.stack(ids, -1), "ahead_labels": torch.stack(labels, -1),
            "ahead_label_mask": torch.stack(mask, -1)}


class MultiTokenBatches:
    """The family's batch transform: every micro-batch carries its tokens ahead (``tokens_ahead``), and the model
    is handed ``ahead_ids``."""

    def __init__(self, depths: int):
        self.depths = depths

    def prepare(self, batch: MicroBatch) -> MicroBatch:
        return dataclasses.replace(batch, extras=batch.extras | tokens_ahead(batch, self.depths))

    def model_inputs(self, batch: MicroBatch) -> dict[str, torch.Tensor]:
        return {"ahead_ids": batch.extras["ahead_ids"]}


class MultiTokenLoss:
    """The family's step term: on the stage of the head, each depth's recorded output scored by the language-model
    loss's head and cross-entropy (``StageOutputs.score``), weighted as the module's rules say."""

    def __init__(self, config: DeepseekV3Config):
        self.depths, self.scale = config.num_nextn_predict_layers, config.mtp_loss_scaling_factor

    def template(self) -> dict[str, tuple[int, ...]]:
        return {MTP_LOSS: (self.depths,)}

    def compute(self, stage, batch: MicroBatch) -> tuple[torch.Tensor | None, Statistics]:
        """``stage``: the stage's ``StageOutputs`` (its module's prediction modules hold their last outputs)."""
        if not stage.last:
            return None, {}
        mask, counts = batch.extras["ahead_label_mask"], batch.extras["ahead_token_counts"]
        depth_losses = []
        for k, output in enumerate(stage.module.mtp.take_record()):
            weights = mask[..., k] / counts[k]
            depth_losses.append(stage.score(output, batch.extras["ahead_labels"][..., k], weights)[0])
        losses = torch.stack(depth_losses)
        return self.scale / self.depths * losses.sum(), {MTP_LOSS: losses.detach()}

    def metrics(self, sums: Statistics) -> dict:
        losses = sums[MTP_LOSS].tolist()
        metrics = {MTP_LOSS: sum(losses) / len(losses)}
        return metrics | {"mtp_depth_losses": losses} if len(losses) > 1 else metrics


def mtp_batch_transforms(model_config: DeepseekV3Config) -> list[MultiTokenBatches]:
    depths = model_config.num_nextn_predict_layers
    return [MultiTokenBatches(depths)] if depths else []


def mtp_terms(config) -> list[MultiTokenLoss]:
    model_config = config.model.model_config
    return [MultiTokenLoss(model_config)] if model_config.num_nextn_predict_layers else []
