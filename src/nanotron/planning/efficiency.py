"""The measured compute speed the planner assumes: effective hardware TFLOP/s per family and shape, from the single-GPU
records in ``benchmarks/results`` (``efficiency.json``, written by ``scripts/planner_efficiency.py``, which names
each entry's record).

The compute model of the configs no kernel table prices (``kernels.py`` says which): a rank's micro-batch computes
its hardware FLOPs (``hardware_flops``) at the speed of the entry nearest to its shape (``Efficiency``).

An entry's speed is its hardware FLOPs per step (the model's training FLOPs with recomputation's extra forward,
``hardware_flops``) over its step time less the modeled update (``step_time.update_bytes``): what the GPU
computed per second while it ran the forwards and backwards, kernels and overheads together. A rank's speed is that
of the entry nearest to its shape: the same family (any, when the family has none), the same precision, then the
closest matmul width (hidden size / tp), sequence and micro-batch tokens on a log scale, the same recomputation
preferred. Speeds scale with the GPU's peak (the records' H100 and H200 share 989 TFLOP/s).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nanotron.config import Config
from nanotron.layout import Layout
from nanotron.models.build import padded_vocab_size
from nanotron.models.registry import spec_for_config
from nanotron.planning.cluster import TB

TABLE = Path(__file__).with_name("efficiency.json")
RECORDED_PEAK_TFLOPS = 989.0  # the H100 and H200 of the records
RECOMPUTE_MISMATCH = 0.5  # a different recomputation weighs as a shape 1.65x away


@dataclass(frozen=True)
class Entry:
    family: str
    precision: str  # bf16 | fp8
    hidden_size: int
    sequence_length: int
    micro_batch_size: int
    recompute: str
    gpu: str
    step_time_s: float
    tflops: float  # effective hardware TFLOP/s of the forwards and backwards
    source: str  # the record, under benchmarks/results


def entries() -> list[Entry]:
    return [Entry(**entry) for entry in json.loads(TABLE.read_text())["entries"]]


def nearest(config: Config, layout: Layout, table: list[Entry] | None = None) -> Entry:
    """The entry whose shape is nearest to a rank's of ``config`` split as ``layout`` (the module's rule)."""
    table = entries() if table is None else table
    family = spec_for_config(config.model.model_config).name
    precision = "fp8" if config.fp8 is not None and config.fp8.enabled else "bf16"
    candidates = ([e for e in table if e.family == family] or table)
    candidates = [e for e in candidates if e.precision == precision] or candidates
    width = config.model.model_config.hidden_size / layout.tp
    recompute = config.parallelism.recompute

    def distance(e: Entry) -> float:
        return (abs(math.log(width / e.hidden_size)) + abs(math.log(layout.rank_sequence_length / e.sequence_length))
                + abs(math.log(layout.rank_tokens / (e.micro_batch_size * e.sequence_length)))
                + (RECOMPUTE_MISMATCH if e.recompute != recompute else 0.0))

    return min(candidates, key=distance)


@dataclass(frozen=True)
class Efficiency:
    """The compute model of the nearest entry of ``table`` (by default ``efficiency.json``'s) on a GPU of
    ``peak_tflops``."""

    peak_tflops: float
    table: tuple[Entry, ...] | None = None
    source = "efficiency.json (the nearest recorded shape's speed)"

    def micro_batch(self, config: Config, layout: Layout, layers: Sequence[int], head: bool) -> tuple[float, float]:
        """(compute, attention) seconds of one micro-batch on a rank holding ``layers`` (and the head)."""
        flops, attention = hardware_flops(config, layout, layers, head)
        entry = nearest(config, layout, None if self.table is None else list(self.table))
        speed = entry.tflops * self.peak_tflops / RECORDED_PEAK_TFLOPS * TB
        return flops / speed, attention / speed


def hardware_flops(config: Config, layout: Layout, layers: Sequence[int], head: bool) -> tuple[float, float]:
    """(all, attention) hardware FLOPs of one micro-batch on a rank holding ``layers`` (and the LM head): the
    family's training FLOPs per token with recomputation's extra forward, times the rank's tokens, over tp."""
    model_config = config.model.model_config
    vocab = padded_vocab_size(model_config.vocab_size, config.model.make_vocab_size_divisible_by, layout.tp)
    costs = spec_for_config(model_config).costs(model_config, vocab, layout.sequence_length)
    recompute = config.parallelism.recompute
    attention = costs.attention_flops or (0.0,) * len(costs.layer_flops)
    per_token = attention_per_token = 0.0
    for index in layers:
        layer, kernels = costs.layer_flops[index], attention[index]
        extra = layer / 3 if recompute == "full" else (layer - kernels) / 3 if recompute == "selective" else 0.0
        per_token += layer + extra
        attention_per_token += kernels * (4 / 3 if recompute == "full" else 1.0)
    per_token += costs.head_flops if head else 0.0
    scale = layout.rank_tokens / layout.tp
    return per_token * scale, attention_per_token * scale
