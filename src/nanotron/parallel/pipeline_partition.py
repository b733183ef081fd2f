"""Which decoder layers each model chunk owns, cutting a model down to one stage's chunks, and each chunk's view.

The decoder is cut into ``pp · v`` chunks (``v`` per stage, virtual stages: ``Layout.chunks``), which the schedule
places on the stages (``Layout.stage_of``). Chunk 0 always holds the token embedding and the last chunk the final norm
and LM head; decoder layers are split into contiguous, non-empty runs, one per chunk. By default the split balances
the compute per chunk, since the slowest stage sets the pace of the whole pipeline. Costs are the training FLOPs per
token that the model family reports (``ModelSpec.costs``): for Llama a decoder layer costs its matmuls plus attention
over the sequence, the LM head its ``vocab * hidden`` output matmul, and the embedding lookup nothing. With a 128k
vocabulary the head weighs as much as two to four decoder layers, so the last stage gets fewer layers (Llama 1B at pp=2:
10 + 6; docs/benchmarks.md times it against 8 + 8). Memory is not balanced: under 1F1B the first stage keeps the most
micro-batches in flight and holds the most activations; ``parallelism.pp_stage_layers`` overrides the split (one
count per chunk). The split minimises the most expensive chunk exactly (dynamic programming over the contiguous
splits).

A stage's model holds the layers of all its chunks (keyed by their global index, so parameter names do not depend on
the split) and is what checkpoints, the optimizer and features see; each chunk is a view of it (``chunk_view``): the
same modules, only the chunk's layers, the embedding only in chunk 0 and the head only in the last chunk.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Collection
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
    """Global layer indices of every chunk (``stages`` of them), from an explicit list of counts or the split
    balancing ``layer_costs`` (one per decoder layer) and the LM head's ``head_cost`` on the last chunk."""
    num_layers = len(layer_costs)
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
            raise PartitionError(
                f"parallelism.pp_stage_layers {counts} must give pp x virtual_pipeline_size ({stages}) counts >= 1 "
                f"that add up to num_hidden_layers ({num_layers})"
            )
    else:
        counts = balanced_partition(layer_costs, stages, first_extra=0.0, last_extra=head_cost)
    starts = [sum(counts[:i]) for i in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def keep_stage(model: nn.Module, layers: Collection[int], is_first: bool, is_last: bool) -> None:
    """Delete every part of ``model`` that this stage does not own (call on the meta device)."""
    for index in list(model.layers.keys()):
        if int(index) not in layers:
            del model.layers[index]
    if not is_first:
        model.embed_tokens = None
    if not is_last:
        drop_head(model)


def head_modules(model: nn.Module) -> tuple[str, ...]:
    """The modules of the model's last chunk besides its layers: the final norm, the LM head, and those a family
    keeps beside the head (``head_modules``: DeepSeek-V3's multi-token prediction)."""
    return getattr(model, "head_modules", ("norm", "lm_head"))


def drop_head(model: nn.Module) -> None:
    for name in head_modules(model):
        setattr(model, name, None)


def mark_tied_embedding_copies(model: nn.Module, last_stage: int) -> None:
    """Name the LM head's stage's copy after the embedding it is tied to (or that modules beside the head read: any
    ``embed_tokens`` under them), and record both copies' stages.

    With tied embeddings split over the first and last chunk on two stages (0 and ``last_stage``), each holds its own
    tensor. Giving both the logical name ``embed_tokens.weight`` makes them start identical (initial weights depend on
    the name), be stored once, and be counted once in the gradient norm; their gradients are summed over
    ``pipeline_ends`` so they stay identical. (Where one stage holds both chunks, as under ZBV, they are one tensor.)
    """
    copies = (0, last_stage)
    if model.embed_tokens is not None:
        placement = get_placement(model.embed_tokens.weight)
        set_placement(model.embed_tokens.weight, replace(placement, pipeline_copies=copies))
    if model.lm_head is not None and model.config.tie_word_embeddings:
        placement = get_placement(model.lm_head.weight)
        set_placement(model.lm_head.weight, replace(placement, name="embed_tokens.weight", pipeline_copies=copies))
    for name, module in model.named_modules():
        if name.endswith(".embed_tokens") and module is not model.embed_tokens:
            placement = get_placement(module.weight)
            set_placement(module.weight, replace(placement, name="embed_tokens.weight", pipeline_copies=copies))


def chunk_view(model: nn.Module, layers: range, is_first: bool, is_last: bool) -> nn.Module:
    """Chunk ``layers`` of a stage's ``model``: a shallow copy sharing every module and parameter, holding only these
    layers (and the embedding if ``is_first``, the final norm and LM head if ``is_last``), so that the model's own
    forward runs exactly the chunk."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view.layers = nn.ModuleDict({str(index): model.layers[str(index)] for index in layers})
    if not is_first:
        view.embed_tokens = None
    if not is_last:
        drop_head(view)
    return view


def held_layers(model: nn.Module) -> list[int]:
    """Global indices of the decoder layers a (stage's) model holds, in order."""
    return sorted(int(index) for index in model.layers)


def describe_layers(layers: list[int]) -> str:
    """Layer indices as runs: ``0-1, 4-5``."""
    runs: list[list[int]] = []
    for index in layers:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def log_stages(model: nn.Module, stage: int) -> None:
    parameters = sum(p.numel() for p in model.parameters())
    parts = ["embedding"] if model.embed_tokens is not None else []
    parts += [f"layers {describe_layers(held_layers(model))}"]
    parts += ["final norm + LM head"] if model.lm_head is not None else []
    logger.info(f"pipeline stage {stage}: {', '.join(parts)}; {parameters / 1e6:.2f}M parameters on this rank")
