"""The collectives one training step issues on one rank: kind, group, bytes and count, derived from the model's shapes
as our code issues them (``tests/test_step_time.py`` counts them in gloo training steps and finds the same).

Bytes are those of the whole buffer a rank hands the collective, the size NCCL's tests report: an all-reduce's
tensor, an all-gather's gathered output, a reduce-scatter's input, what an all-to-all sends (its own part included),
a point-to-point message. ``cluster.py`` turns them into time.

Where they come from (``tokens``: a micro-batch's tokens on the rank, ``micro_batch_size × sequence_length / cp``,
in the model dtype unless said):

- **tensor parallelism**, per micro-batch, read from the modules of the built model (``parallel/tensor_parallel.py``):
  a column-parallel linear of ``in`` features gathers its input (``tokens × in``) in the forward and
  reduce-scatters its gradient in the backward with sequence parallelism, or all-reduces that gradient without it;
  ``tp_linear_async_communication`` gathers the input again in the backward. A row-parallel linear of ``out``
  features reduce-scatters (sequence parallelism) or all-reduces its output, and gathers its gradient in the
  backward with sequence parallelism. The vocabulary-parallel embedding acts as a row-parallel linear, a mixture of
  experts split over TP as a column-parallel linear at its entry and a row-parallel one at its exit. Backward
  all-reduces of weight gradients: sequence-parallel norms, routers, kv-head rows shared by TP ranks. The loss:
  the fused head gathers ``3 × tokens`` fp32 statistics per rank over TP, the plain one all-reduces three fp32
  values per token (two more with a z-loss).
- **context parallelism**: per attention layer and micro-batch, one all-gather of keys and values per group of kv
  heads (``context_parallel.head_groups``) in the forward, a reduce-scatter of their gradients in the backward.
- **expert parallelism**: per mixture-of-experts layer and micro-batch, the counts (``8 × experts`` bytes) and the
  tokens (``tokens × top-k × hidden``) all-to-all'd there and back in the forward, the tokens again in the
  backward. What a rank sends back depends on the routing; the model counts the balanced share, which the ranks of
  an ep group add up to exactly.
- **recomputation** (``full``, ``selective``) runs a layer's forward again in the backward, collectives included.
- **pipeline**: a stage sends each micro-batch's activations forward and their gradient back
  (``micro_batch_size × sequence / cp / (tp with sequence parallelism) × hidden``), ``chunks`` times per
  micro-batch with virtual stages (``pipeline_schedules.py``).
- **data parallelism** (``parallel/data_parallel.py``), once per step: each gradient bucket over its replicas (dense
  weights over dp × cp × ep, experts over dp × cp), all-reduced, or reduce-scattered from ZeRO-1 on, in the gradient
  dtype (fp32 with ``optimizer.accumulate_grad_in_fp32`` where gradients are summed); ZeRO-1 and 2 then all-gather
  the updated shards in the model dtype; ZeRO-3 all-gathers every weight before its forward and again before its
  backward, per micro-batch, and gathers nothing after the update. A weight tied across pipeline stages is
  all-reduced between the two stages.
- **the step's scalars**: the global token count (4 bytes over dp × cp × ep), the statistics (fp64 over
  pp × dp × cp × ep) and the gradient norm (4 bytes over every rank): latency only.

Not modeled: FP8's amax all-reduces, the routers' per-sequence sums under context parallelism and the replica
check (every ``replica_check_interval`` steps), each a few bytes per call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from nanotron.config import Config
from nanotron.layout import Axis, Group, Layout
from nanotron.models.build import BuildOptions, build_stage, pipeline_stage_layers
from nanotron.nn.attention import AttentionCore
from nanotron.optim.optimizer import no_weight_decay
from nanotron.parallel.context import GridPosition
from nanotron.parallel.context_parallel import head_groups
from nanotron.parallel.data_parallel import gradient_dtype
from nanotron.parallel.expert_parallel import ExpertExchange
from nanotron.parallel.placement import Shard, declared_names, get_placement
from nanotron.parallel.tensor_parallel import (
    REDUCE_SCATTER,
    ColumnParallelLinear,
    GradientSummedLinear,
    GradientSummedRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)

ALL_REDUCE, REDUCE_SCATTER_KIND, ALL_GATHER, ALL_TO_ALL, SEND = (
    "all-reduce", "reduce-scatter", "all-gather", "all-to-all", "send/recv")
PIPELINE_ENDS, WORLD = "pipeline_ends", "world"  # scopes besides the layout's groups
SCALAR_BYTES = 1024  # below this a collective costs its latency only (the step's scalars)


@dataclass(frozen=True)
class Collective:
    """Calls of one collective a rank makes in a step: ``count`` calls of ``bytes`` each (see the module's rules)."""

    kind: str
    group: str  # a ``Group``'s value, ``PIPELINE_ENDS`` or ``WORLD``
    bytes: int
    count: int
    phase: str  # forward, backward, gradients (the reduction during the last backward), update, step
    source: str  # what issues it, for the tables


def group_size(layout: Layout, group: str) -> int:
    """The ranks of a collective's scope."""
    if group == PIPELINE_ENDS:
        return 2
    if group == WORLD:
        return layout.world_size
    return layout.size(Group(group))


def group_members(layout: Layout, group: str) -> list[int]:
    """The world ranks of world rank 0's ``group`` (every group of a scope spans nodes alike)."""
    if group == PIPELINE_ENDS:
        return [0, layout.rank_of({Axis.PP: layout.pp - 1})]
    axes = tuple(Axis) if group == WORLD else Group(group).axes
    members = [{}]
    for axis in axes:
        members = [place | {axis: i} for place in members for i in range(layout.size(axis))]
    return sorted(layout.rank_of(place) for place in members)


def step_collectives(config: Config, stage: int = 0, layout: Layout | None = None) -> list[Collective]:
    """The collectives a rank of pipeline stage ``stage`` issues in one training step of ``config`` (its layout, or
    ``layout`` in its place)."""
    layout = layout or Layout.from_config(config)
    structure = _structure(config, layout)
    layers = structure.stage_layers(config, layout)[stage]
    first, last = stage == 0, stage == layout.pp - 1
    per_micro_batch = [*_layer_collectives(config, layout, structure, layers),
                       *(_edge_collectives(config, layout, structure, first, last))]
    micro_batches = layout.accumulation
    collectives = [replace(c, count=c.count * micro_batches) for c in per_micro_batch]
    collectives += _pipeline_messages(config, layout, first, last)
    collectives += _gradient_collectives(config, layout, stage)
    collectives += _step_scalars(layout)
    return [c for c in collectives if c.count and group_size(layout, c.group) > 1]


def merged(collectives: list[Collective]) -> dict[tuple[str, str], tuple[int, int]]:
    """(kind, group) → (calls, bytes) of a step: the totals the gloo count is compared with."""
    totals: dict[tuple[str, str], tuple[int, int]] = {}
    for c in collectives:
        calls, size = totals.get((c.kind, c.group), (0, 0))
        totals[(c.kind, c.group)] = (calls + c.count, size + c.bytes * c.count)
    return totals


# --- the model's modules -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parameter:
    """One parameter as a rank holds it: its logical name, local elements, dtype, gradient axes and decay."""

    name: str
    elements: int
    dtype: torch.dtype
    gradient_axes: tuple[Axis, ...]
    decay: bool


@dataclass(frozen=True)
class _Structure:
    """The whole model as one rank of a layout's tp and ep holds it (built once per such pair), by part: the
    modules that issue collectives and the parameters."""

    layer_modules: dict[int, tuple[nn.Module, ...]]
    edge_modules: dict[str, tuple[nn.Module, ...]]  # "embedding", "head" (the final norm and the LM head)
    layer_parameters: dict[int, tuple[Parameter, ...]]
    edge_parameters: dict[str, tuple[Parameter, ...]]
    kv_heads: dict[int, int]  # per attention layer: the kv heads a rank holds
    hidden_size: int

    def stage_layers(self, config: Config, layout: Layout) -> list[range]:
        options = BuildOptions.from_config(with_layout(config, layout))
        return pipeline_stage_layers(config.model.model_config, options, layout.pp, layout.tp)


def with_layout(config: Config, layout: Layout) -> Config:
    """``config`` split as ``layout``: its grid, token split, pipeline schedule and ZeRO stage; an explicit pipeline
    split kept only for its own number of model chunks."""
    p = config.parallelism
    same_chunks = (layout.pp, layout.virtual) == (p.pp, p.virtual_pipeline_size)
    p = replace(p, dp=layout.dp, tp=layout.tp, pp=layout.pp, expert_parallel_size=layout.ep,
                context_parallel_size=layout.cp, pp_engine=layout.pp_engine, virtual_pipeline_size=layout.virtual,
                tp_mode="REDUCE_SCATTER" if layout.sequence_parallel else "ALL_REDUCE",
                tp_linear_async_communication=layout.overlapped_linears,
                pp_stage_layers=p.pp_stage_layers if same_chunks else None)
    t = replace(config.tokens, micro_batch_size=layout.micro_batch_size,
                batch_accumulation_per_replica=layout.accumulation)
    optimizer = replace(config.optimizer, zero_stage=layout.zero_stage)
    return replace(config, parallelism=p, tokens=t, optimizer=optimizer)


_STRUCTURES: dict[tuple, _Structure] = {}


_MODELS: dict[tuple, nn.Module] = {}


def rank_model(config: Config, layout: Layout) -> nn.Module:
    """The whole model on the meta device as the rank at coordinate 0 of ``layout``'s tp × ep grid holds it, as
    training builds it (sequence parallel where tp > 1: a module keeps ``ALL_REDUCE`` only where it always runs so,
    the others follow the layout), built once per (model, tp, ep) in this process."""
    options = replace(BuildOptions.from_config(config), tp_mode=REDUCE_SCATTER if layout.tp > 1 else "ALL_REDUCE",
                      tp_overlap=False, pp_stage_layers=None)
    key = (repr(config.model.model_config), repr(options), layout.tp, layout.ep)
    if key not in _MODELS:
        grid = Layout(tp=layout.tp, ep=layout.ep, sequence_parallel=layout.tp > 1)
        _MODELS[key] = build_stage(config.model.model_config, GridPosition(grid, grid.coordinates(0)), options)
    return _MODELS[key]


def _structure(config: Config, layout: Layout) -> _Structure:
    """The model as a rank of ``layout``'s tp and ep holds it (``rank_model``), sorted once per (model, tp, ep)."""
    exclude = config.optimizer.weight_decay_exclude_named_params
    model = rank_model(config, layout)
    key = (id(model), repr(exclude))
    if key not in _STRUCTURES:
        _STRUCTURES[key] = _built_structure(model, config.model.model_config, exclude, layout.tp)
    return _STRUCTURES[key]


def _built_structure(model: nn.Module, model_config, exclude, tp: int) -> _Structure:
    """Sort the modules and parameters of ``model`` (a ``rank_model``) by part."""
    no_decay = declared_names(model, "no_weight_decay_parameters")
    parameters: dict[str, list[Parameter]] = {}
    for name, param in {get_placement(p).name: p for p in model.parameters()}.items():
        part = _part(name)
        placement = get_placement(param)
        parameters.setdefault(part, []).append(Parameter(
            name, param.numel(), param.dtype, placement.gradient_axes,
            not no_weight_decay(name, param, exclude, no_decay)))
    modules: dict[str, list[nn.Module]] = {}
    for name, module in model.named_modules():
        if _communicates(module):
            modules.setdefault(_part(name), []).append(module)
    kv_heads = {int(index): _kv_heads(layer, model_config, tp) for index, layer in model.layers.items()}
    return _Structure(
        layer_modules={int(i): tuple(modules.get(f"layers.{i}", ())) for i in model.layers},
        edge_modules={part: tuple(modules.get(part, ())) for part in ("embedding", "head")},
        layer_parameters={int(i): tuple(parameters.get(f"layers.{i}", ())) for i in model.layers},
        edge_parameters={part: tuple(parameters.get(part, ())) for part in ("embedding", "head")},
        kv_heads={index: heads for index, heads in kv_heads.items() if heads},
        hidden_size=model_config.hidden_size,
    )


_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, GradientSummedRMSNorm,
           GradientSummedLinear)


def _communicates(module: nn.Module) -> bool:
    """Whether a call of ``module`` issues collectives of its own: tensor-parallel layers, blocks split over TP as a
    whole and blocks whose experts other ranks hold."""
    return (isinstance(module, _LAYERS) or _split_as_a_whole(module)
            or isinstance(getattr(module, "exchange", None), ExpertExchange))


def _split_as_a_whole(module: nn.Module) -> bool:
    """A block a family's plan splits over TP as a whole (a mixture of experts, ``TensorParallelMoE``): it holds a
    TP group and mode and, like a column-parallel linear at its entry and a row-parallel one at its exit, gathers
    (or all-reduces the gradient of) its hidden-size input and reduces its hidden-size output."""
    return (not isinstance(module, _LAYERS) and hasattr(module, "group") and getattr(module, "mode", None) is not None)


def _part(name: str) -> str:
    """The part of the model a module or parameter belongs to: ``layers.<i>``, ``embedding`` or ``head``."""
    parts = name.split(".")
    if parts[0] == "layers":
        return f"layers.{parts[1]}"
    return "embedding" if parts[0] == "embed_tokens" else "head"


def _kv_heads(layer: nn.Module, model_config, tp: int) -> int:
    """The kv heads one rank's attention core of ``layer`` reads (0: no attention): its share of them over TP,
    whole heads replicated where there are fewer than ranks (as ``ColumnParallelLinear`` splits them)."""
    if not any(isinstance(module, AttentionCore) for module in layer.modules()):
        return 0
    width, head = model_config.num_key_value_heads * model_config.head_dim, model_config.head_dim
    return Shard(Axis.TP, 0, (width,), (head,)).local_size(width, tp) // head


# --- per micro-batch --------------------------------------------------------------------------------------------


def _layer_collectives(config: Config, layout: Layout, structure: _Structure, layers: range) -> Iterator[Collective]:
    recomputed = config.parallelism.recompute in ("full", "selective")
    for index in layers:
        calls = [*(c for module in structure.layer_modules[index]
                   for c in _module_collectives(module, config, layout, layout.overlapped_linears)),
                 *_context_parallel(config, layout, structure.kv_heads.get(index, 0))]
        for c in calls:
            yield c
            if recomputed and c.phase == "forward":
                yield replace(c, phase="backward", source=f"{c.source} (recomputed)")


def _edge_collectives(config: Config, layout: Layout, structure: _Structure, first: bool,
                      last: bool) -> Iterator[Collective]:
    for part, held in (("embedding", first), ("head", last)):
        if held:
            # The fused loss takes the LM head's operands: its gather is the plain one (no overlapped backward).
            overlapped = layout.overlapped_linears and not (part == "head" and config.model.loss_chunk_tokens)
            for module in structure.edge_modules[part]:
                yield from _module_collectives(module, config, layout, overlapped)
    if last:
        yield from _loss(config, layout)


def _module_collectives(module: nn.Module, config: Config, layout: Layout, overlapped: bool) -> Iterator[Collective]:
    """What one call of ``module`` issues over TP or EP, forward and backward (``overlapped``: a column-parallel
    linear computing ``F.linear`` runs the overlapped backward, ``tp_linear_async_communication``)."""
    tokens, value = layout.rank_tokens, config.model.torch_dtype().itemsize
    tp = Group.TP.value
    if isinstance(getattr(module, "exchange", None), ExpertExchange):
        yield from _expert_exchange(config, layout)
    if isinstance(module, (GradientSummedRMSNorm, GradientSummedLinear)):
        # The structure is built sequence-parallel; a norm over sequence shards exists only in that mode.
        sequence_norm = getattr(module, "part", None) == "sequence"
        if layout.tp > 1 and (layout.sequence_parallel or not sequence_norm):
            weight = module.weight
            yield Collective(ALL_REDUCE, tp, weight.numel() * weight.element_size(), 1, "backward",
                             f"{type(module).__name__} weight gradient")
        return
    whole = _split_as_a_whole(module)
    if not (whole or isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))):
        return  # a mixture of experts on one TP rank
    sequence_parallel = layout.sequence_parallel and module.mode == REDUCE_SCATTER
    hidden = config.model.model_config.hidden_size
    if whole or isinstance(module, ColumnParallelLinear):
        width = hidden if whole else module.weight.shape[1]
        overlapped = overlapped and isinstance(module, ColumnParallelLinear) and module.matmul is F.linear
        yield from _gathered_input(tokens * width * value, sequence_parallel, overlapped, type(module).__name__)
    if isinstance(module, ColumnParallelLinear) and module.shared_rows:
        for tensor in (module.weight, module.bias):  # each replicated tensor's gradient rows summed by a call
            if tensor is not None:
                elements = module.shared_buffer_rows * math.prod(tensor.shape[1:])
                yield Collective(ALL_REDUCE, tp, elements * tensor.element_size(), 1, "backward",
                                 "shared kv-head rows")
    if whole or isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
        width = (hidden if whole else module.weight.shape[0] if isinstance(module, RowParallelLinear) else
                 module.weight.shape[1])
        yield from _reduced_output(tokens * width * value, sequence_parallel, type(module).__name__)


def _gathered_input(size: int, sequence_parallel: bool, overlapped: bool, source: str) -> Iterator[Collective]:
    tp = Group.TP.value
    if sequence_parallel:
        yield Collective(ALL_GATHER, tp, size, 1, "forward", f"{source} input")
        yield Collective(REDUCE_SCATTER_KIND, tp, size, 1, "backward", f"{source} input gradient")
        if overlapped:
            yield Collective(ALL_GATHER, tp, size, 1, "backward", f"{source} input, gathered again")
    else:
        yield Collective(ALL_REDUCE, tp, size, 1, "backward", f"{source} input gradient")


def _reduced_output(size: int, sequence_parallel: bool, source: str) -> Iterator[Collective]:
    tp = Group.TP.value
    if sequence_parallel:
        yield Collective(REDUCE_SCATTER_KIND, tp, size, 1, "forward", f"{source} output")
        yield Collective(ALL_GATHER, tp, size, 1, "backward", f"{source} output gradient")
    else:
        yield Collective(ALL_REDUCE, tp, size, 1, "forward", f"{source} output")


def _loss(config: Config, layout: Layout) -> Iterator[Collective]:
    if layout.tp == 1:
        return
    tokens, tp = layout.rank_tokens, Group.TP.value
    chunk = config.model.loss_chunk_tokens
    if chunk:
        for size in (min(chunk, tokens - start) for start in range(0, tokens, chunk)):
            yield Collective(ALL_GATHER, tp, layout.tp * 3 * size * 4, 1, "forward", "fused loss statistics")
        return
    z_loss = config.model.model_config.logit_z_loss > 0
    yield Collective(ALL_REDUCE, tp, tokens * 4, 3 + 2 * z_loss, "forward", "vocabulary-parallel loss")


def _context_parallel(config: Config, layout: Layout, kv_heads: int) -> Iterator[Collective]:
    if layout.cp == 1 or not kv_heads:
        return
    head_bytes = 2 * config.model.model_config.head_dim * layout.rank_tokens * layout.cp
    head_bytes *= config.model.torch_dtype().itemsize
    for heads in head_groups(kv_heads):
        yield Collective(ALL_GATHER, Group.CP.value, heads * head_bytes, 1, "forward", "keys and values")
        yield Collective(REDUCE_SCATTER_KIND, Group.CP.value, heads * head_bytes, 1, "backward",
                         "key and value gradients")


def _expert_exchange(config: Config, layout: Layout) -> Iterator[Collective]:
    if layout.ep == 1:
        return
    moe = config.model.model_config.moe
    size = layout.rank_tokens * moe.top_k * config.model.model_config.hidden_size
    size *= config.model.torch_dtype().itemsize
    ep = Group.EP.value
    yield Collective(ALL_TO_ALL, ep, 8 * moe.num_experts, 1, "forward", "tokens per expert")
    yield Collective(ALL_TO_ALL, ep, size, 2, "forward", "tokens to and from their experts")
    yield Collective(ALL_TO_ALL, ep, size, 2, "backward", "token gradients")


# --- per step ------------------------------------------------------------------------------------------------------


def _pipeline_messages(config: Config, layout: Layout, first: bool, last: bool) -> list[Collective]:
    """A stage's sends: activations forward (all but the last stage), gradients back (all but the first)."""
    if layout.pp == 1:
        return []
    model_config = config.model.model_config
    dtype = model_config.activation_dtype(config.model.torch_dtype())
    size = math.prod(layout.stage_activation_shape(model_config.hidden_size)) * dtype.itemsize
    chunks = layout.virtual
    messages = layout.accumulation * chunks
    sends = []
    if not last or chunks > 1:
        sends.append(Collective(SEND, Group.PP.value, size, messages, "forward", "activations"))
    if not first or chunks > 1:
        sends.append(Collective(SEND, Group.PP.value, size, messages, "backward", "activation gradients"))
    return sends


def stage_parameters(config: Config, layout: Layout, stage: int) -> list[Parameter]:
    """The parameters a rank of pipeline stage ``stage`` holds (its part of each), in the order of their names: a
    weight tied across stages is held by the first and the last."""
    structure = _structure(config, layout)
    layers = structure.stage_layers(config, layout)[stage]
    first, last = stage == 0, stage == layout.pp - 1
    params = [p for i in layers for p in structure.layer_parameters[i]]
    for part, held in (("embedding", first), ("head", last)):
        if held:
            params += structure.edge_parameters[part]
    tied = config.model.model_config.embedding_on_head_stage and layout.pp > 1
    if tied and last and not first:  # the last stage's copy of the tied embedding
        params += structure.edge_parameters["embedding"]
    return sorted(params, key=lambda p: p.name)


def _gradient_collectives(config: Config, layout: Layout, stage: int) -> list[Collective]:
    params = stage_parameters(config, layout, stage)
    tied = config.model.model_config.embedding_on_head_stage and layout.pp > 1
    collectives = []
    for bucket in _buckets(params, config, layout, tied):
        group = Group.EXPERT_REPLICAS if bucket.axes == Group.EXPERT_REPLICAS.axes else Group.DENSE_REPLICAS
        size = layout.size(group)
        if size == 1 and not bucket.tied:
            continue
        elements = -(-bucket.elements // size) * size
        kind = ALL_REDUCE if layout.zero_stage == 0 else REDUCE_SCATTER_KIND
        times = layout.accumulation if layout.zero_stage >= 2 else 1  # ZeRO-2/3 reduce every micro-batch
        collectives.append(Collective(kind, group.value, elements * bucket.gradient_bytes, times, "gradients",
                                      "gradient bucket"))
        if layout.zero_stage in (1, 2):
            collectives.append(Collective(ALL_GATHER, group.value, elements * bucket.weight_bytes, 1, "update",
                                          "updated shards"))
        if bucket.tied:
            shard = elements // size if layout.zero_stage else elements
            collectives.append(Collective(ALL_REDUCE, PIPELINE_ENDS, shard * bucket.gradient_bytes, 1, "gradients",
                                          "tied embedding copies"))
    if layout.zero_stage == 3:
        collectives += _gathered_weights(params, config, layout, tied)
    return collectives


def _unit(name: str) -> str:
    """The ZeRO-3 unit of a parameter (``parallel/parameter_sharding.py``): its decoder layer, or the outer unit."""
    return ".".join(name.split(".")[:2]) if name.startswith("layers.") else "outer"


def _gathered_weights(params: list[Parameter], config: Config, layout: Layout, tied: bool) -> list[Collective]:
    """ZeRO-3's gathers (``ShardedUnits``): the outer unit once a step (it stays gathered until the update); each
    decoder layer before its forward and again before its backward in every micro-batch, but the stage's last
    layer, which stays gathered from its forward into its backward."""
    last = max((b.unit for b in _buckets(params, config, layout, tied) if b.unit != "outer"),
               key=lambda unit: int(unit.split(".")[1]), default=None)
    collectives = []
    for bucket in _buckets(params, config, layout, tied):
        group = Group.EXPERT_REPLICAS if bucket.axes == Group.EXPERT_REPLICAS.axes else Group.DENSE_REPLICAS
        size = layout.size(group)
        times = 1 if bucket.unit == "outer" else layout.accumulation * (1 if bucket.unit == last else 2)
        collectives.append(Collective(ALL_GATHER, group.value, -(-bucket.elements // size) * size * bucket.weight_bytes,
                                      times, "forward", "sharded weights"))
    return collectives


@dataclass(frozen=True)
class _Bucket:
    axes: tuple[Axis, ...]
    elements: int
    gradient_bytes: int
    weight_bytes: int
    tied: bool
    unit: str = "outer"  # ZeRO-3's unit; every bucket's without ZeRO-3


def _buckets(params: list[Parameter], config: Config, layout: Layout, tied: bool) -> list[_Bucket]:
    """The gradient buckets of ``GradientBuckets`` (``parallel/data_parallel.py``): parameters in reverse order of
    their names, by weight decay, ZeRO-3 unit, gradient axes and dtype, cut once a bucket reaches
    ``model.ddp_bucket_cap_mb``; a weight tied across stages in a bucket of its own."""
    cap = int(config.model.ddp_bucket_cap_mb * 2**20)
    single = layout.accumulation == 1
    in_fp32 = config.optimizer.accumulate_grad_in_fp32
    buckets: list[_Bucket] = []
    for decay in (True, False):
        kinds: dict[tuple[str, tuple[Axis, ...], torch.dtype], list[Parameter]] = {}
        for p in reversed(params):
            if p.decay == decay:
                unit = _unit(p.name) if layout.zero_stage == 3 else "outer"
                kinds.setdefault((unit, p.gradient_axes, p.dtype), []).append(p)
        for (unit, axes, dtype), members in kinds.items():
            replicas = math.prod(layout.size(axis) for axis in axes)

            def bucket(elements: int, copies: bool, axes=axes, dtype=dtype, replicas=replicas, unit=unit) -> _Bucket:
                grad = gradient_dtype(dtype, in_fp32, single, replicas, copies)
                return _Bucket(axes, elements, grad.itemsize, dtype.itemsize, copies, unit)

            filled = 0
            for p in members:
                if tied and p.name == "embed_tokens.weight":
                    if filled:
                        buckets.append(bucket(filled, False))
                    buckets.append(bucket(p.elements, True))
                    filled = 0
                    continue
                filled += p.elements
                if filled * gradient_dtype(dtype, in_fp32, single, replicas, False).itemsize >= cap:
                    buckets.append(bucket(filled, False))
                    filled = 0
            if filled:
                buckets.append(bucket(filled, False))
    return buckets


def _step_scalars(layout: Layout) -> list[Collective]:
    return [Collective(ALL_REDUCE, Group.DENSE_REPLICAS.value, 4, 1, "step", "global token count"),
            Collective(ALL_REDUCE, Group.STATISTICS.value, 8, 1, "step", "step statistics"),
            Collective(ALL_REDUCE, WORLD, 4, 1, "step", "gradient norm")]
