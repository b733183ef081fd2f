"""Build a model for this rank: construct on the meta device, place, materialise, initialise."""

from __future__ import annotations

import torch
from torch import nn

from nanotron.config import Config, LlamaConfig
from nanotron.models.init import init_parameters
from nanotron.models.llama import LlamaForCausalLM
from nanotron.nn.recompute import recompute_in_backward
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.pipeline_partition import keep_stage, log_stages, mark_tied_embedding_copies, stage_layers
from nanotron.parallel.placement import annotate_placements
from nanotron.parallel.plans import TENSOR_PARALLEL_PLANS
from nanotron.parallel.tensor_parallel import apply_tensor_parallel

MODEL_CLASSES: dict[type, type[nn.Module]] = {LlamaConfig: LlamaForCausalLM}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up so it splits evenly over TP ranks (and kernels like the multiple)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def materialize(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace meta parameters by empty ones on ``device``; a parameter shared by two modules stays shared."""
    created: dict[int, nn.Parameter] = {}
    for submodule in module.modules():
        for key, param in submodule._parameters.items():
            if param is None:
                continue
            if id(param) not in created:
                created[id(param)] = nn.Parameter(
                    torch.empty(param.shape, device=device, dtype=dtype), requires_grad=param.requires_grad
                )
            submodule._parameters[key] = created[id(param)]


def build_model(config: Config, parallel_context: ParallelContext) -> nn.Module:
    """The model of this rank, with placements on every parameter and random initial weights.

    Weights loaded from a checkpoint overwrite these afterwards; initialising anyway keeps one code path.
    """
    model_config = config.model.model_config
    vocab = padded_vocab_size(
        model_config.vocab_size, config.model.make_vocab_size_divisible_by, parallel_context.size("tp")
    )
    pc, stages = parallel_context, parallel_context.size("pp")
    with torch.device("meta"):
        model = MODEL_CLASSES[type(model_config)](model_config, vocab)
        if pc.size("tp") > 1:
            plan = TENSOR_PARALLEL_PLANS[type(model_config)](model_config)
            apply_tensor_parallel(model, plan, pc.groups["tp"], config.parallelism.tp_mode,
                                  config.parallelism.tp_linear_async_communication)
            model.tie_weights()
        if stages > 1:
            layers = pipeline_stage_layers(config)[pc.coord("pp")]
            keep_stage(model, layers, pc.is_first_stage, pc.is_last_stage)
    materialize(model, pc.device, config.model.torch_dtype())
    annotate_placements(model)
    if stages > 1:
        if model_config.tie_word_embeddings:
            mark_tied_embedding_copies(model, stages)
        log_stages(model, pc.coord("pp"), layers)
    std = getattr(config.model.init_method, "std", model_config.initializer_range)
    init_parameters(model, config.general.seed, std, pc.coordinates, pc.sizes)
    if config.parallelism.recompute_layer:  # before compiling, so that the compiled forward recomputes too
        for layer in model.layers.values():
            recompute_in_backward(layer)
    if config.model.compile:
        for layer in model.layers.values():
            layer.compile()
    return model


def pipeline_stage_layers(config: Config) -> list[range]:
    """Decoder layers of every pipeline stage, from ``parallelism.pp_stage_layers`` or balanced by compute."""
    c, tokens = config.model.model_config, config.tokens
    layer = LlamaForCausalLM.layer_parameters(c) + tokens.sequence_length * c.hidden_size
    return stage_layers(c.num_hidden_layers, config.parallelism.pp, config.parallelism.pp_stage_layers, layer,
                        head_cost=c.vocab_size * c.hidden_size)
