"""Which decoder layers each pipeline stage owns, and cutting a model down to one stage.

Stage 0 always holds the token embedding and the last stage the final norm and LM head; decoder layers are split
into contiguous, non-empty runs. By default the split balances the compute per stage, since the slowest stage sets
the pace of the whole pipeline. Costs are the training FLOPs per token that the model family reports
(``ModelSpec.costs``): for Llama a decoder layer costs its matmuls plus attention over the sequence, the LM head its
``vocab * hidden`` output matmul, and the embedding lookup nothing. With a 128k vocabulary
the head weighs as much as two to four decoder layers, so the last stage gets fewer layers (Llama 1B at pp=2:
10 + 6; docs/benchmarks.md times it against 8 + 8). Memory is not balanced: under 1F1B the first stage keeps the most
micro-batches in flight and holds the most activations; ``parallelism.pp_stage_layers`` overrides the split. The
split minimises the most expensive stage exactly (dynamic programming over the contiguous splits).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

from torch import nn

from nanotron.parallel.placement import get_placement, set_placement

logger = logging.getLogger(__name__)


class PartitionError(ValueError):
    """The requested pipeline split is impossible."""


def balanced_partition(layer_costs: list[float], stages: int, first_extra: float, last_extra: float) -> list[int]:
    """Layers per stage (each >= 1) minimising the largest stage cost; stage 0 and the last stage carry extras."""
    n = len(layer_costs)
    if not 1 <= stages <= n:
        raise PartitionError(f"cannot split {n} decoder layers over {stages} pipeline stages (need 1 <= pp <= layers)")
    prefix = [0.0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    @functools.cache
    def best(start: int, stage: int) -> tuple[float, tuple[int, ...]]:
        """Smallest max-cost of splitting layers[start:] over stages stage..stages-1."""
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == stages - 1 else 0.0)
        if stage == stages - 1:
            return prefix[n] - prefix[start] + extra, (n - start,)
        result = (float("inf"), ())
        for end in range(start + 1, n - (stages - stage - 1) + 1):
            here = prefix[end] - prefix[start] + extra
            rest, counts = best(end, stage + 1)
            result = min(result, (max(here, rest), (end - start, *counts)))
        return result

    return list(best(0, 0)[1])


def stage_layers(layer_costs: list[float], stages: int, explicit: list[int] | None, head_cost: float) -> list[range]:
    """Global layer indices of every stage, from an explicit list of counts or the split balancing ``layer_costs``
    (one per decoder layer) and the LM head's ``head_cost`` on the last stage."""
    num_layers = len(layer_costs)
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
            raise PartitionError(
                f"parallelism.pp_stage_layers {counts} must give pp ({stages}) counts >= 1 that add up to "
                f"num_hidden_layers ({num_layers})"
            )
    else:
        counts = balanced_partition(layer_costs, stages, first_extra=0.0, last_extra=head_cost)
    starts = [sum(counts[:i]) for i in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def keep_stage(model: nn.Module, layers: range, is_first: bool, is_last: bool) -> None:
    """Delete every part of ``model`` that this stage does not own (call on the meta device)."""
    for index in list(model.layers.keys()):
        if int(index) not in layers:
            del model.layers[index]
    if not is_first:
        model.embed_tokens = None
    if not is_last:
        model.norm = None
        model.lm_head = None


def mark_tied_embedding_copies(model: nn.Module, stages: int) -> None:
    """Name the last stage's LM head after the embedding it is tied to, and record both copies' stages.

    With tied embeddings split over the first and last stage, each holds its own tensor. Giving both the logical
    name ``embed_tokens.weight`` makes them start identical (initial weights depend on the name), be stored once, and
    be counted once in the gradient norm; their gradients are summed over ``pipeline_ends`` so they stay identical.
    """
    copies = (0, stages - 1)
    if model.embed_tokens is not None:
        placement = get_placement(model.embed_tokens.weight)
        set_placement(model.embed_tokens.weight, replace(placement, pipeline_copies=copies))
    if model.lm_head is not None:
        placement = get_placement(model.lm_head.weight)
        set_placement(model.lm_head.weight, replace(placement, name="embed_tokens.weight", pipeline_copies=copies))


def held_layers(model: nn.Module) -> range:
    """Global indices of the decoder layers a (stage's) model holds."""
    indices = [int(index) for index in model.layers]
    return range(indices[0], indices[-1] + 1)


def log_stages(model: nn.Module, stage: int) -> None:
    layers = held_layers(model)
    parameters = sum(p.numel() for p in model.parameters())
    parts = (["embedding"] if model.embed_tokens is not None else []) + [f"layers {layers.start}-{layers.stop - 1}"]
    parts += ["final norm + LM head"] if model.lm_head is not None else []
    logger.info(f"pipeline stage {stage}: {', '.join(parts)}; {parameters / 1e6:.2f}M parameters on this rank")
