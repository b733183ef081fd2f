"""FP8 training as a feature (``fp8.enabled``): the model converter, the amax histories between steps, the
out-of-range statistics and the checkpoint check. The FP8 products themselves are ``nn/fp8/``.

The histories (delayed scaling) are model buffers, saved and loaded with the weights; this feature pushes each
step's amaxes into them after the update (maximised over ranks, so every rank and layout scales alike), drops a
skipped step's, and reads back which histories are filled once the loaded ones are in place.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from nanotron.checkpoint.logical_tensors import LogicalTensorReader
from nanotron.config import FP8Args
from nanotron.errors import CheckpointError
from nanotron.models.build import ModuleConverter
from nanotron.nn.fp8 import (
    AMAX_HISTORY_SUFFIX,
    OPERANDS,
    FP8RangeCounts,
    advance_amax_histories,
    discard_step_amaxes,
    fp8_converter,
    refresh_filled_histories,
    warn_if_emulated,
)
from nanotron.parallel.statistics import max_over_ranks, sum_over_all_ranks
from nanotron.training.hooks import Feature, Run


class FP8(Feature):
    """The decoder layers' linears on FP8 products (``fp8`` section)."""

    def __init__(self, args: FP8Args):
        self.args = args

    def converters(self, device: torch.device) -> tuple[ModuleConverter, ...]:
        warn_if_emulated(device)
        return (fp8_converter(self.args),)

    def check_checkpoint(self, checkpoint: Path, metadata: dict) -> None:
        """A history's length is fixed for a run (``fp8.amax_history_length``): one of another length is refused
        with the length to resume with, before the model is built."""
        reader = LogicalTensorReader(checkpoint / "model")
        for key in sorted(reader.names()):
            stored = reader.logical_shape(key)
            if key.endswith(AMAX_HISTORY_SUFFIX) and stored[-1] != self.args.amax_history_length:
                raise CheckpointError(
                    f"{key!r} in {reader.folder} holds {stored[-1]} steps of FP8 amax history but "
                    f"fp8.amax_history_length is {self.args.amax_history_length}: resume with "
                    f"fp8.amax_history_length: {stored[-1]} (the length is fixed for a run)")

    def start(self, run: Run) -> None:
        self.model, self.pc = run.model, run.pc
        refresh_filled_histories(self.model)  # loaded amax histories scale the first step

    def after_optimizer_step(self, skipped: bool) -> None:
        if skipped:  # its amaxes (possibly inf or NaN) must not reach the histories
            discard_step_amaxes(self.model)
        else:
            advance_amax_histories(self.model, lambda amaxes: max_over_ranks(amaxes, self.pc))

    def metrics(self) -> dict:
        """With ``fp8.log_out_of_range``, the step's shares of FP8-cast values saturated and flushed."""
        if not self.args.log_out_of_range:
            return {}
        return report_range_counts(self.model, lambda counts: sum_over_all_ranks(counts, self.pc), self.pc.device)


@torch.no_grad()
def report_range_counts(model: nn.Module, reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                        device: torch.device) -> dict:
    """The shares of cast values saturated and flushed since the last report, over every linear and, through
    ``reduce_sum`` (collective: every rank calls it, with counters or none), every rank, for all operands and per
    operand; the counts restart."""
    counters = [module for module in model.modules() if isinstance(module, FP8RangeCounts)]
    local = torch.zeros(3, 3, dtype=torch.float64, device=device)
    for counter in counters:
        local += counter.counts
    counts = reduce_sum(local).tolist()
    for counter in counters:
        counter.counts.zero_()
    totals = [sum(column) for column in zip(*counts)]

    def shares(saturated, flushed, cast):
        return {"saturated": saturated / max(cast, 1), "flushed": flushed / max(cast, 1)}

    overall = shares(*totals)
    return {"fp8_saturated": overall["saturated"], "fp8_flushed": overall["flushed"],
            "fp8_range": {operand: shares(*row) for operand, row in zip(OPERANDS, counts)}}
