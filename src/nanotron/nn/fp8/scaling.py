"""FP8 scaling: the formats, the recipes, and the amaxes each operand is scaled by.

- ``tensorwise`` scales each operand by its current absolute maximum (``fp8_max / amax``), ``rowwise`` by one amax
  per row along the product's reduced dimension (re-derived along the other dimension for each backward product,
  quantising from the high-precision tensors again), ``delayed`` per tensor by the largest amax of the last
  ``amax_history_length`` optimizer steps (``AmaxHistory``, one per linear, saved in checkpoints), as Transformer
  Engine does; until an operand has a history (its first step), by its current amax.
- Every rank, at every layout, scales alike. Between steps the FP8 feature maximises each step's amaxes over the
  data- and tensor-parallel ranks before pushing them into the histories (``advance_amax_histories``). Under tensor
  parallelism an amax taken along a split dimension (any, per tensor; the reduced one, per row) is maximised over
  the ranks holding the other slices (``SplitFeatures``), so that each rank scales its slice as tp=1 scales the
  whole tensor: scaled by its own slice, tp=2 would drift from tp=1 by FP8's rounding (2^-4 in e4m3) instead of the
  reduction order's.
- Which operands have a history is host state (``AmaxHistory.filled``): a scale from a history does not depend on
  the tensor it scales, so the compiler casts in one pass, recording the amax on the way.
- With ``fp8.log_out_of_range`` each converted linear counts, per operand, the values its casts saturate (only a
  history's scale can) and flush to zero (``FP8RangeCounts``); the FP8 feature reports their shares after every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
GROUPED_ALIGNMENT = 16  # torch._scaled_grouped_mm: every feature dimension, and every group's rows, a multiple of it


@dataclass(frozen=True)
class FP8Recipe:
    gradient_dtype: torch.dtype = E5M2
    rowwise: bool = False
    delayed: bool = False


INPUT, WEIGHT, GRADIENT = range(3)  # the rows of an AmaxHistory and of FP8RangeCounts
OPERANDS = ("input", "weight", "gradient")
# The dimensions of the 2-D operands: x [tokens, in], W [out, in], the output gradient g [tokens, out].
OPERAND_DIMS = {INPUT: ("tokens", "in"), WEIGHT: ("out", "in"), GRADIENT: ("tokens", "out")}


@dataclass(frozen=True)
class SplitFeatures:
    """The feature dimension that tensor parallelism splits a linear's operands along: ``"out"`` (column-parallel:
    the weight's rows, the output gradient's columns) or ``"in"`` (row-parallel: the input's and the weight's
    columns); ``max_over_ranks`` maximises an amax over the ranks holding the other slices, in place (a collective
    from ``parallel/``). An amax taken along a split dimension is maximised over them, so that every rank scales its
    slice as the whole tensor is scaled at tp=1 (see the module's docstring)."""

    features: str
    max_over_ranks: Callable[[torch.Tensor], torch.Tensor]

    def splits(self, operand: int, dim: int | None = None) -> bool:
        """Whether ``operand``'s amax, over the whole tensor (``dim`` None) or along ``dim``, spans the split."""
        dims = OPERAND_DIMS[operand]
        return self.features in (dims if dim is None else (dims[dim],))


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest absolute value of ``x``, reduced along its rows first: the compiler then writes a reduction over
    contiguous rows, where a reduction of the flattened tensor is split at offsets that cut rows (on an H200 that
    made the amax of SwiGLU's output take 0.34 ms, three times a read of its input)."""
    magnitudes = x.abs()
    return (magnitudes.amax(dim=-1) if x.dim() > 1 else magnitudes).amax()


AMAX_HISTORY_SUFFIX = "fp8_amaxes.history"  # how the checkpoint key of every linear's history ends


class AmaxHistory(nn.Module):
    """One linear's amaxes of its input, weight and output gradient: over the last optimizer steps (``history``,
    newest first, saved) and over the micro-batches of the current step (``current``). ``filled`` says, per operand,
    whether the history holds an amax yet: host state, refreshed between steps (``refresh_filled_histories``)."""

    def __init__(self, length: int):
        super().__init__()
        self.register_buffer("history", torch.zeros(3, length))
        self.register_buffer("current", torch.zeros(3), persistent=False)
        self.filled = (False, False, False)

    def amax(self, row: int, x: torch.Tensor, split: SplitFeatures | None = None) -> torch.Tensor:
        """The amax to scale ``x`` by: the history's largest, or before there is one ``x``'s own (maximised over the
        ranks that ``split`` shares the tensor with); ``x``'s own is recorded for this step."""
        current = tensor_amax(x).float()
        self.record(row, current)
        recorded = self.recorded_amax(row)
        if recorded is not None:
            return recorded
        return current if split is None or not split.splits(row) else split.max_over_ranks(current.clone())

    def recorded_amax(self, row: int) -> torch.Tensor | None:
        """The history's largest amax, or None while it holds none."""
        return self.history[row].amax() if self.filled[row] else None

    def record(self, row: int, amax: torch.Tensor) -> None:
        self.current[row] = torch.maximum(self.current[row], amax.detach())


@torch.no_grad()
def refresh_filled_histories(model: nn.Module) -> None:
    """Read back which operands' histories hold an amax (one host sync): after the histories were loaded, and
    after steps that pushed them while some were empty. Once all are filled the flags stay set; a history empties
    only after its tensor was all zeros for the history's length, and then the flag is wrong for one step."""
    histories = [module for module in model.modules() if isinstance(module, AmaxHistory)]
    if histories:
        filled = torch.stack([h.history.amax(dim=1) > 0 for h in histories]).tolist()
        for h, rows in zip(histories, filled):
            h.filled = tuple(rows)


@torch.no_grad()
def advance_amax_histories(model: nn.Module, reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """After an optimizer step: push every linear's step amaxes, maximised over ranks by ``reduce_max``, into its
    history and start the next step from zero. One collective for all linears, and a host sync only while some
    history is empty."""
    histories = [module for module in model.modules() if isinstance(module, AmaxHistory)]
    if not histories:
        return
    step = reduce_max(torch.stack([h.current for h in histories]))
    for h, amaxes in zip(histories, step):
        h.history.copy_(torch.cat([amaxes[:, None], h.history[:, :-1]], dim=1))
        h.current.zero_()
    if not all(all(h.filled) for h in histories):
        refresh_filled_histories(model)


@torch.no_grad()
def discard_step_amaxes(model: nn.Module) -> None:
    """A skipped step's amaxes (possibly inf or NaN) must not reach the histories."""
    for module in model.modules():
        if isinstance(module, AmaxHistory):
            module.current.zero_()


class FP8RangeCounts(nn.Module):
    """One linear's count of cast values per operand (rows as ``AmaxHistory``'s) since the last report: saturated,
    flushed to zero, and all of them."""

    def __init__(self):
        super().__init__()
        self.register_buffer("counts", torch.zeros(3, 3, dtype=torch.int64), persistent=False)

    def record(self, row: int, x: torch.Tensor, scaled: torch.Tensor, dtype: torch.dtype) -> None:
        """Count ``x``'s values (scaled to the format, ``scaled``) that its cast to ``dtype`` saturates (more than
        half a step beyond the largest finite value, which rounding alone cannot explain) or flushes (at most half
        the smallest subnormal: it rounds to zero, a tie going to the even zero)."""
        finfo = torch.finfo(dtype)
        top_step = 2.0 ** math.floor(math.log2(finfo.max)) * finfo.eps  # the spacing of the largest binade
        saturated = (scaled.abs() > finfo.max + top_step / 2).sum()
        flushed = ((scaled.abs() <= finfo.tiny * finfo.eps / 2) & (x != 0)).sum()
        self.counts[row] += torch.stack([saturated, flushed, saturated.new_tensor(x.numel())])


def fp8_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The factor that scales values up to ``amax`` onto the float8 ``dtype``'s range."""
    return torch.finfo(dtype).max / amax.clamp(min=1e-12)
