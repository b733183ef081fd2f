"""Sums over a sequence's tokens, completed over every rank that holds tokens of the sequence.

A statistic summed over each sequence's tokens (how often a router chose each expert in it) is complete on a rank
that holds whole sequences. Under context parallelism each rank holds part of every sequence, so such a sum must be
completed over the ranks that share the sequences before it is used. ``SequenceSum`` is that step as a child module
without parameters: here, where sequences are whole, it returns its input; ``parallel/context_parallel.py`` swaps it
for a sum over the context-parallel group, so that the model itself never calls a collective (as ``AttentionCore``
for the keys and values).
"""

from __future__ import annotations

import torch
from torch import nn


class SequenceSum(nn.Module):
    """``sums`` [sequences, ...], each row this rank's sum over its tokens of one sequence -> the whole sequence's."""

    def forward(self, sums: torch.Tensor) -> torch.Tensor:
        return sums
