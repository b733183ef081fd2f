"""Build a model for this rank: construct on the meta device, place, materialise, initialise."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanotron.config import Config, SpectralMupInit
from nanotron.layout import Axis, Group
from nanotron.models.init import init_parameters
from nanotron.models.mup import learning_rate_scales, spectral_init_rule
from nanotron.models.registry import spec_for_config
from nanotron.models.spec import CausalLM, Initializer
from nanotron.nn.flash_attention import use_flash_attention
from nanotron.nn.recompute import compile_layer, recompute_in_backward
from nanotron.parallel.context import GridPosition, ParallelContext
from nanotron.parallel.context_parallel import apply_context_parallel
from nanotron.parallel.pipeline_partition import (
    chunk_view,
    keep_stage,
    log_stages,
    mark_tied_embedding_copies,
    stage_layers,
)
from nanotron.parallel.placement import annotate_placements, logical_parameters
from nanotron.parallel.tensor_parallel import ALL_REDUCE, apply_tensor_parallel

META = torch.device("meta")
# Changes the model on the meta device after parallelism is applied, before weights exist (e.g. swaps linears).
ModuleConverter = Callable[[nn.Module], None]


@dataclass(frozen=True)
class BuildOptions:
    """How to build a model, apart from its architecture; ``from_config`` reads them from a training config."""

    dtype: torch.dtype
    seed: int = 0
    init_std: float = 0.02
    vocab_multiple: int = 1  # model.make_vocab_size_divisible_by
    tp_mode: str = ALL_REDUCE
    tp_overlap: bool = False  # parallelism.tp_linear_async_communication
    tp_sums_in_fp32: bool = False  # parallelism.tp_partial_sums_in_fp32
    pp_stage_layers: list[int] | None = None
    sequence_length: int = 2048  # weighs attention in the pipeline split
    recompute: str = "none"  # parallelism.recompute: none | full | selective | pointwise
    compile: bool = False
    attention_backend: str = "auto"  # model.attention_backend: auto | torch | fa4
    init_method: Any = None  # model.init_method: another initialisation than normal(0, init_std) (µP, Mamba's)

    @classmethod
    def from_config(cls, config: Config) -> BuildOptions:
        model, p = config.model, config.parallelism
        return cls(
            dtype=model.torch_dtype(), seed=config.general.seed,
            init_std=getattr(model.init_method, "std", model.model_config.initializer_range),
            vocab_multiple=model.make_vocab_size_divisible_by, tp_mode=p.tp_mode,
            tp_overlap=p.tp_linear_async_communication, tp_sums_in_fp32=p.tp_partial_sums_in_fp32,
            pp_stage_layers=p.pp_stage_layers,
            sequence_length=config.tokens.sequence_length, recompute=p.recompute, compile=model.compile,
            attention_backend=model.attention_backend, init_method=model.init_method,
        )


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up so it splits evenly over TP ranks (and kernels like the multiple)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def materialize(module: nn.Module, device: torch.device, dtype: torch.dtype, placeholders: bool = False) -> None:
    """Replace meta parameters by empty ones on ``device`` and meta buffers by zeros.

    Parameters take ``dtype`` unless their module lists them in ``fp32_parameters`` (state a family keeps in fp32
    whatever the training dtype); a parameter shared by two modules stays shared. With ``placeholders`` a parameter
    keeps no storage (its shape and dtype only): whoever holds it gives it storage and values (ZeRO-3's buckets).
    """
    created: dict[int, nn.Parameter] = {}
    for submodule in module.modules():
        keep_fp32 = getattr(submodule, "fp32_parameters", ())
        for key, param in submodule._parameters.items():
            if param is None:
                continue
            if id(param) not in created:
                param_dtype = torch.float32 if key in keep_fp32 else dtype
                created[id(param)] = nn.Parameter(
                    torch.empty(param.shape, device=device, dtype=param_dtype), requires_grad=param.requires_grad
                )
                if placeholders:
                    created[id(param)].untyped_storage().resize_(0)
            submodule._parameters[key] = created[id(param)]
        for key, buffer in submodule._buffers.items():
            if buffer is not None and buffer.is_meta:
                submodule._buffers[key] = torch.zeros(buffer.shape, device=device, dtype=buffer.dtype)


def pipeline_stage_layers(model_config, options: BuildOptions, chunks: int, tp: int = 1) -> list[range]:
    """Decoder layers of every model chunk (one per stage without virtual stages), from
    ``parallelism.pp_stage_layers`` or balanced by compute."""
    vocab = padded_vocab_size(model_config.vocab_size, options.vocab_multiple, tp)
    costs = spec_for_config(model_config).costs(model_config, vocab, options.sequence_length)
    return stage_layers(list(costs.layer_flops), chunks, options.pp_stage_layers, head_cost=costs.head_flops)


def stage_chunks(model: CausalLM) -> list[CausalLM]:
    """The model chunks of a stage's ``model`` (``build_stage``), in model order: views of it, each running its
    chunk's layers, the first chunk's embedding and the last chunk's head (torchtitan's model parts)."""
    layers, last = model.chunk_layers, model.chunk_count - 1
    if len(layers) == 1:
        return [model]
    return [chunk_view(model, layers[chunk], chunk == 0, chunk == last) for chunk in sorted(layers)]


def build_stage(model_config, grid: ParallelContext | GridPosition, options: BuildOptions,
                converters: Sequence[ModuleConverter] = (), device: torch.device = META,
                placeholders: bool = False) -> CausalLM:
    """The part of the model that the rank at ``grid``'s coordinates holds, with placements on every parameter and
    no initial values: constructed on the meta device, split by the family's tensor-parallel plan, expert
    parallelism and context parallelism, cut to the rank's pipeline stage (the layers of its model chunks, which
    ``chunk_layers`` records for ``stage_chunks``), converted, then materialised on ``device``.

    Training builds its model this way (``build_model``). On the meta device (the default) nothing is allocated and
    ``grid`` may be a ``GridPosition`` of any rank: the memory planner counts what each stage holds from the model
    this returns, so that it reads the same shapes, placements and dtypes as training. With ``placeholders`` the
    parameters have no storage on ``device`` (``materialize``).
    """
    spec = spec_for_config(model_config)
    tp, stages = grid.size(Axis.TP), grid.size(Axis.PP)
    vocab = padded_vocab_size(model_config.vocab_size, options.vocab_multiple, tp)
    with torch.device(META):
        model = spec.model_class(model_config, vocab)
        if tp > 1:
            apply_tensor_parallel(model, spec.tensor_parallel_plan(model_config), grid.group(Group.TP), options.tp_mode,
                                  options.tp_overlap, options.tp_sums_in_fp32)
            model.tie_weights()
        if grid.size(Axis.EP) > 1:
            spec.expert_parallel(model, grid.group(Group.EP))
        if grid.size(Axis.CP) > 1:
            apply_context_parallel(model, grid.group(Group.CP))
        layout = grid.layout
        chunks, layers = layout.chunks_of(grid.coord(Axis.PP)), [range(model_config.num_hidden_layers)]
        if stages > 1:
            layers = pipeline_stage_layers(model_config, options, layout.chunks, tp)
            keep_stage(model, [index for chunk in chunks for index in layers[chunk]], 0 in chunks,
                       layout.chunks - 1 in chunks)
        # the stage's chunks, by their index among all: what ``stage_chunks`` cuts the model into
        model.chunk_layers, model.chunk_count = {chunk: layers[chunk] for chunk in chunks}, len(layers)
        for convert in converters:
            convert(model)
    materialize(model, device, options.dtype, placeholders)
    annotate_placements(model)
    last_stage = layout.stage_of(layout.chunks - 1)
    if last_stage != 0 and model_config.embedding_on_head_stage:
        mark_tied_embedding_copies(model, last_stage)
    return model


def build_model(model_config, parallel_context: ParallelContext, options: BuildOptions,
                converters: Sequence[ModuleConverter] = (), initialize: bool = True) -> CausalLM:
    """The model of this rank, with placements on every parameter and random initial weights.

    Weights loaded from a checkpoint overwrite these afterwards; initialising anyway keeps one code path. Without
    ``initialize`` the parameters are placeholders without storage or values, which ZeRO-3 gives them a bucket at a
    time (``parameter_initializer``).
    """
    pc = parallel_context
    model = build_stage(model_config, pc, options, converters, pc.device, placeholders=not initialize)
    if hasattr(model, "flash_attention"):  # a family with attention
        model.flash_attention = use_flash_attention(options.attention_backend, pc.device, options.dtype,
                                                    model_config.head_dim)
    if pc.size(Axis.PP) > 1:
        log_stages(model, pc.coord(Axis.PP))
    if initialize:
        parameter_initializer(model_config, pc, options)(logical_parameters(model))
    if options.recompute != "none":  # before compiling, so that the compiled forward recomputes too
        for layer in model.layers.values():
            recompute_in_backward(layer, options.recompute)
    if options.compile:
        for layer in model.layers.values():
            compile_layer(layer)
        if model.norm is not None:  # eager, it would keep an fp32 copy of the last hidden states for its backward
            model.norm.compile()
    return model


def parameter_initializer(model_config, grid: ParallelContext | GridPosition,
                          options: BuildOptions) -> Callable[[dict[str, torch.Tensor]], None]:
    """The function that gives parameters (by logical name) their initial values at ``grid``'s coordinates: the
    family's rule, seeded by the run's seed and each name."""
    rule = initial_value_rule(model_config, options)

    def initialize(params: dict[str, torch.Tensor]) -> None:
        init_parameters(params, options.seed, rule, grid.coordinates, grid.sizes)

    return initialize


def initial_value_rule(model_config, options: BuildOptions) -> Callable[[str], Initializer]:
    """Each parameter's initializer by logical name, as ``model.init_method`` selects it: spectral µP
    (``models/mup.py``), an initialisation of the family's own (``ModelSpec.init_rules``), or the family's rule at
    ``init_std``."""
    spec, method = spec_for_config(model_config), options.init_method
    if isinstance(method, SpectralMupInit):
        return spectral_init_rule(model_config, spec)
    own = spec.init_rules.get(type(method))
    if own is not None:
        return lambda name: own(name, model_config, method)
    return lambda name: spec.init_rule(name, model_config, options.init_std)


def parameter_lr_scales(model_config, options: BuildOptions) -> dict[str, float] | None:
    """Each parameter's learning rate over the schedule's (by logical name), where ``model.init_method`` sets them
    (spectral µP); None: the schedule's for all."""
    if isinstance(options.init_method, SpectralMupInit):
        return learning_rate_scales(model_config, spec_for_config(model_config))
    return None
