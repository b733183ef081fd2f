"""The model converter that gives a model's decoder layers FP8 matmuls (``fp8.enabled``)."""

from __future__ import annotations

from torch import nn

from nanotron.nn.fp8.grouped import FP8ExpertMatmul
from nanotron.nn.fp8.linear import FP8Matmul
from nanotron.nn.fp8.scaling import FORMATS, AmaxHistory, FP8RangeCounts, FP8Recipe, SplitFeatures


def fp8_converter(args):
    """A module converter (``build_model(converters=...)``) giving the decoder layers' linears FP8 matmuls.

    Every module with a swappable ``matmul`` inside ``layers`` is converted except those their parent module lists
    in ``keeps_model_dtype`` (MoE routers: their logits choose experts) and the names matching
    ``fp8.exclude_modules``; so are MoE experts (their ``expert_matmul``: ``FP8ExpertMatmul``, grouped products with
    rowwise scales from the current amax whatever the recipe, see the module's docstring). The embedding and the LM
    head are outside the decoder layers and stay in the model dtype. A tensor-parallel linear scales each operand as
    the whole tensor is scaled (``SplitFeatures``); MoE experts split over tensor-parallel ranks still scale each
    rank's slices on their own.
    """
    import re

    recipe = FP8Recipe(FORMATS[args.gradient_format], args.recipe == "rowwise", args.recipe == "delayed")
    excluded = [re.compile(pattern) for pattern in args.exclude_modules]

    def range_counts(module: nn.Module) -> FP8RangeCounts | None:
        if not args.log_out_of_range:
            return None
        module.fp8_ranges = FP8RangeCounts()  # a child module, so that it follows the model to its device
        return module.fp8_ranges

    def convert(model) -> None:
        modules = dict(model.named_modules())
        kept = {f"{name}.{child}" for name, module in modules.items()
                for child in getattr(module, "keeps_model_dtype", ())}
        for name, module in modules.items():
            if not name.startswith("layers.") or name in kept or any(pattern.search(name) for pattern in excluded):
                continue
            if hasattr(module, "expert_matmul"):
                module.expert_matmul = FP8ExpertMatmul(range_counts(module))
            elif hasattr(module, "matmul"):
                if recipe.delayed:  # a child module: its history is model state, saved and loaded by name
                    module.fp8_amaxes = AmaxHistory(args.amax_history_length)
                split = None
                if hasattr(module, "split_features"):  # a tensor-parallel linear (parallel/tensor_parallel.py)
                    split = SplitFeatures(module.split_features, module.max_over_ranks)
                module.matmul = FP8Matmul(recipe, module.fp8_amaxes if recipe.delayed else None, range_counts(module),
                                          split)

    return convert
