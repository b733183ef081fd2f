"""Language-modelling loss, normalised by the global number of target tokens.

The loss of one micro-batch is ``sum of token losses / global token count``, where the count spans every
micro-batch and data-parallel rank of the optimizer step. Summing these partial losses (backward of each micro-batch,
SUM-reduction over data-parallel ranks) then yields exactly the mean over the global batch, whatever the split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy in fp32, shape [batch, seq]."""
    flat = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return flat.view_as(labels)


def masked_sum(losses: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """Sum of the token losses that count (``label_mask`` True); a fully masked batch contributes exactly 0."""
    return torch.where(label_mask, losses, 0.0).sum()
