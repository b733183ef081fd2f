"""Per-rank GPU memory of a training run, estimated from its config before anything is allocated.

Every pipeline stage is estimated on its own (stages hold different layers and keep different numbers of
micro-batches in flight); ranks of one stage hold the same amounts. All sizes are bytes; GB below means 1e9 bytes,
as in ``torch.cuda.max_memory_allocated() / 1e9``, the peak that ``scripts/benchmark.py`` and the step line report.

How each part is computed, and why:

- **weights**: the parameters this rank holds, each in its own dtype (``model.dtype``, fp32 for those a module keeps
  in fp32). They are read from the stage's model as training builds it (``models/build.py``'s ``build_stage``: the
  family's tensor-parallel plan, its expert parallelism, the pipeline cut and the FP8 converter), built on the meta
  device for the rank at coordinate 0 of the other axes (ranks of one stage hold the same amounts). A parameter
  shared by two modules (tied embeddings on one stage) counts once; the last stage's own copy of a tied embedding
  counts there.
- **gradients**: where they are summed (several micro-batches a step, replicas over the gradient axes, a copy on
  another pipeline stage), one flat buffer of the same elements (``data_parallel.py``): fp32 with
  ``optimizer.accumulate_grad_in_fp32``, else the parameter's dtype. ZeRO-1 reduce-scatters into a slice of the full
  buffer, so the buffer keeps its full size. Elsewhere (unless ``optimizer.persistent_gradient_buffers``) gradients
  of 2^20 elements or more have no buffer: autograd's, in the parameter's dtype, are held from the backward to the
  update (``holds_autograd_gradient``); smaller ones keep a buffer in the parameter's dtype.
  ZeRO-2 and ZeRO-3 keep no full buffer: each rank sums its 1/n shard of every gradient (same dtype), and the
  full-size gradients of the buckets being filled and reduced (``REDUCTIONS_IN_FLIGHT`` + 1 at most, in bf16 with
  ``optimizer.grad_reduce_in_bf16``) count where they are alive. Under ZeRO-3 a bucket holds one unit's parameters:
  the outer unit's is filled from the LM head's backward to the embedding's, a layer's during its backward and
  reduced during the next two; under ZeRO-2 the largest buckets (``model.ddp_bucket_cap_mb``) count throughout.
  Those count at the moment of the peak: where the backward starts (one layer's, the final norm's and the LM
  head's, unless the fused loss computed the head's in its forward and counts it), or later in the backward when a
  layer's gradients outweigh what it keeps for the backward (large layers with recomputation). Each layer's
  backward is tried, with the gradients of the layers after it and the activations of those before it, and the
  backward's end (every gradient, the tied embedding's two gradients being summed, the embedding's backward).
- **master weights**: the optimizer's fp32 masters of its shard: 2 bytes per bf16 weight, the bits the weight lacks
  (``optim/param_remainders.py``), with ``optimizer.store_param_remainders``, else 4 bytes, an fp32 copy (even when
  the model is fp32). **Adam moments**: two more tensors of the same shard, fp32 or
  ``optimizer.adam_moments_dtype``. With ``zero_stage`` 1-3 the shard of a parameter is 1/n of it, n the ranks of
  its gradient axes (``Placement.gradient_axes``: dp·cp·ep for a dense weight, dp·cp for an expert) with dp replaced
  by ``parallelism.dp_shard`` under HSDP, else everything.
- **ZeRO-3** weights: the rank's 1/n shard of every weight, and the units gathered at the peak: the outer unit (the
  embeddings, the final norm and the LM head, gathered for the whole step) and the two largest decoder layers (one
  computing, the next prefetched: ``parallel/parameter_sharding.py``).
- **activations**: what autograd keeps for the backward, per micro-batch in flight, plus the largest transient of a
  backward, for the rank's tokens: 1/cp of each sequence under context parallelism, whose attention also keeps the
  gathered keys and values and its mask. The rank's tokens and the micro-batches in flight on each stage are the
  layout's (``Layout.rank_tokens``, ``Layout.in_flight``: the schedule runs by the same numbers). With several model
  chunks per stage (virtual stages) each (chunk, micro-batch) in flight weighs its chunk's layers, at the moment
  the stage's schedule holds the most (``Timeline.held``); the logits count at their own most.
  What a decoder layer saves cannot be read from its parameters: each family models it
  (``ModelSpec.layer_activations``, in ``models/<family>/costs.py``) from reading the layer's code, checked layer by
  layer on an H200; with ``parallelism.recompute: full`` each layer keeps only its input (with ``selective``, also
  its attention output and log-sum-exp; with ``pointwise``, those and its matmuls' outputs), and the backward
  rebuilds one layer at a time. The last stage adds the final norm (compiled
  with the layers: it then keeps its input, not an fp32 copy of it) and what the family's modules beside the head
  keep (``ModelSpec.head_side_activations``: DeepSeek-V3's multi-token prediction, with one more output of the LM
  head per depth).
- **FP8** (``fp8.enabled``) with ``parallelism.recompute``: the compiled forward keeps the FP8 copies of the
  converted linears' weights for the backward, counted as one byte per weight element per micro-batch in flight.
  Without recomputation FP8 keeps less than bf16, since the backward recomputes the cast inputs; that is not
  modeled, so the estimate is then an upper bound.
- **logits**: the LM head's output and the loss buffers of the last stage (``logits_bytes``), per micro-batch in
  flight and during the loss's backward; with the fused head and loss (``model.loss_chunk_tokens``), the gradients
  it computes in the forward and keeps, and one chunk's logits (``fused_loss_bytes``).
- **workspace**: cuBLAS workspaces and the step's small buffers, allocated by the first step.

Their sum is the **peak** the PyTorch allocator reports. The device needs more: the CUDA context, the libraries'
kernels and NCCL's buffers live outside the allocator (``CUDA_RUNTIME_BYTES``), and the caching allocator holds
freed blocks it cannot reuse for other shapes (``ALLOCATOR_SLACK``). ``total`` adds both and decides whether a
configuration fits.

The columns add up to the peak: the loss's backward and a layer's backward do not overlap, so only the larger of
the two transients counts (the layers' one under activations, the rest of the loss's under logits). When the peak
falls later in the backward, the columns are those of that moment (no logits).

The estimates are checked against the peaks measured on H200s (docs/benchmarks.md, "Memory planner against
measured peaks", where each run and its error are listed; tests/test_memory.py holds the Llama runs): as trained by
default, a Llama estimate is never below its measured peak and at most 3% above it.
The ZeRO-2/3 terms are checked on the CPU only, against the tensor storage each rank holds at dp 1, 2 and 4 under
every stage (tests/test_zero_memory.py, the table in docs/config.md): within 3.2%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from nanotron.config import Config, ConfigError
from nanotron.layout import Axis, Layout
from nanotron.models.build import BuildOptions, build_stage, padded_vocab_size
from nanotron.models.registry import spec_for_config
from nanotron.models.spec import ActivationShape, HeadSideActivations, ModelSpec
from nanotron.nn.fp8 import FP8Matmul, fp8_converter
from nanotron.optim.param_remainders import master_element_bytes
from nanotron.parallel.context import GridPosition
from nanotron.parallel.data_parallel import REDUCTIONS_IN_FLIGHT, gradient_dtype, holds_autograd_gradient
from nanotron.parallel.parameter_sharding import OUTER, parameter_units
from nanotron.parallel.pipeline_partition import describe_layers, held_layers
from nanotron.parallel.placement import get_placement

GB = 1e9
DEFAULT_GPU_MEMORY_GB = 150.1  # an H200 (its total_memory, 150,109,880,320 bytes), when no CUDA device is visible
# Device memory in use outside PyTorch's allocator: CUDA context, cuBLAS/cuDNN/Triton kernels, NCCL communicators.
# Measured on one H200 (torch 2.11, NCCL) as used device memory minus the allocator's reserved memory: 3.84-3.86 GB
# in each of seven runs of the 1B and 8B shapes, eager and compiled (docs/benchmarks.md).
CUDA_RUNTIME_BYTES = int(3.84e9)
# Reserved but unallocated memory of the caching allocator, as a share of the peak: measured 0.4-1.5% with
# compiled layers, 3-5% with recomputation, 2.5-12.5% eager (more shapes of temporaries), on the same runs.
ALLOCATOR_SLACK = 0.05
# Allocated by the first training step and kept (cuBLAS workspaces, step scalars): 67 MB in the same runs.
STEP_WORKSPACE_BYTES = int(67e6)
LARGEST_MICRO_BATCH_SEARCHED = 1 << 16


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's memory per rank, in bytes, at ``micro_batch_size``."""

    stage: int
    layers: list[int]
    in_flight: int  # (chunk, micro-batch) activations kept at once
    weights: int
    gradients: int
    master_weights: int
    adam_moments: int
    activations: int
    logits: int
    workspace: int

    @property
    def peak(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` reports at this stage's peak."""
        return (self.weights + self.gradients + self.master_weights + self.adam_moments + self.activations
                + self.logits + self.workspace)

    @property
    def total(self) -> int:
        """Device memory needed: the peak, the allocator's slack and the CUDA runtime."""
        return int(self.peak * (1 + ALLOCATOR_SLACK)) + CUDA_RUNTIME_BYTES


@dataclass(frozen=True)
class MemoryEstimate:
    """Every stage's memory at the configured micro-batch size, and what fits in ``gpu_memory_gb``."""

    description: str  # the model and layout, one line
    stages: tuple[StageMemory, ...]
    gpu_memory_gb: float
    micro_batch_size: int
    largest_micro_batch_per_stage: tuple[int, ...]  # 0: not even one sequence fits
    pipeline: str = ""  # the schedule's predicted bubble and activations in flight, one line (several stages)

    @property
    def fits(self) -> bool:
        return all(stage.total <= self.gpu_memory_gb * GB for stage in self.stages)

    @property
    def largest_micro_batch(self) -> int:
        """The largest ``tokens.micro_batch_size`` with which every stage fits (0: none does)."""
        return min(self.largest_micro_batch_per_stage)

    def table(self) -> str:
        """The per-stage table the ``estimate-memory`` command prints (parts in GB)."""
        header = ["stage", "layers", "in flight", "weights", "grads", "masters", "moments", "activations", "logits",
                  "peak", "total", "fits", "largest micro-batch"]
        rows = [header]
        for stage, largest in zip(self.stages, self.largest_micro_batch_per_stage):
            parts = (stage.weights, stage.gradients, stage.master_weights, stage.adam_moments, stage.activations,
                     stage.logits, stage.peak, stage.total)
            rows.append([str(stage.stage), describe_layers(stage.layers), str(stage.in_flight),
                         *(f"{part / GB:.2f}" for part in parts),
                         "yes" if stage.total <= self.gpu_memory_gb * GB else "no", str(largest)])
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [" | ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
        lines.insert(1, "-+-".join("-" * width for width in widths))
        verdict = "fits" if self.fits else "does not fit"
        return "\n".join([
            self.description, *([self.pipeline] if self.pipeline else []), *lines,
            "GB per rank, at the moment of the peak (grads: the gradient buffers and the gradients held without "
            "one at that moment).",
            f"peak: what torch.cuda.max_memory_allocated reports (workspace of "
            f"{STEP_WORKSPACE_BYTES / GB:.2f} included); total: + {ALLOCATOR_SLACK:.0%} allocator slack + "
            f"{CUDA_RUNTIME_BYTES / GB:.2f} CUDA runtime.",
            f"micro_batch_size {self.micro_batch_size} {verdict} in {self.gpu_memory_gb:.1f} GB; the largest that "
            f"fits on every stage is {self.largest_micro_batch}.",
        ])


def device_memory_gb() -> float:
    """The current CUDA device's memory, or an H200's when there is none."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GB
    return DEFAULT_GPU_MEMORY_GB


def estimate_memory(config: Config, gpu_memory_gb: float | None = None) -> MemoryEstimate:
    """Per-stage memory of ``config`` per rank, whether it fits in ``gpu_memory_gb`` (None: this machine's GPU,
    else an H200's 150.1 GB), and the largest micro-batch size that fits (searched: activations grow with it, state
    does not)."""
    if gpu_memory_gb is None:
        gpu_memory_gb = device_memory_gb()
    p, layout = config.parallelism, Layout.from_config(config)
    spec = spec_for_config(config.model.model_config)
    if spec.layer_activations is None:
        raise ConfigError(f"the memory planner has no model of what the {spec.name} family's layers keep for the "
                          "backward (its ModelSpec.layer_activations)")
    states = [_stage_state(config, stage) for stage in range(layout.pp)]

    def stages_at(micro_batch_size: int) -> tuple[StageMemory, ...]:
        return tuple(_stage_memory(config, spec, stage, state, micro_batch_size) for stage, state in enumerate(states))

    budget = gpu_memory_gb * GB
    largest = tuple(_largest_fitting(lambda mb, s=stage: stages_at(mb)[s].total <= budget)
                    for stage in range(layout.pp))
    parameters = spec.costs(config.model.model_config, states[0].padded_vocab_size, layout.sequence_length).parameters
    size = f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"
    description = (f"{spec.name}, {size} parameters, {layout.summary()}, {config.model.dtype}"
                   + (", compiled" if config.model.compile else ", eager")
                   + (", recomputed layers" if p.recompute != "none" else "")
                   + (f" ({p.recompute})" if p.recompute not in ("none", "full") else ""))
    return MemoryEstimate(description, stages_at(layout.micro_batch_size), gpu_memory_gb, layout.micro_batch_size,
                          largest, layout.timeline().summary() if layout.pp > 1 else "")


def sharding_advice(config: Config, estimate: MemoryEstimate) -> str | None:
    """Where ``config`` does not fit and has data-parallel ranks: the least sharding that fits, tried from ZeRO-1 up
    (ZeRO-3 under HSDP with the largest replica count first, since its gathers stay within fewer ranks, then over
    all of dp); None where it fits, or where none of them does."""
    dp = config.parallelism.dp
    if estimate.fits or dp == 1:
        return None
    current = config.optimizer.zero_stage
    tries = [(stage, None) for stage in (1, 2) if stage > current]
    tries += [(3, shard) for shard in range(2, dp) if dp % shard == 0] + [(3, None)]
    for stage, shard in tries:
        sharded = replace(config, optimizer=replace(config.optimizer, zero_stage=stage),
                          parallelism=replace(config.parallelism, dp_shard=shard))
        fitting = estimate_memory(sharded, estimate.gpu_memory_gb)
        if fitting.fits:
            keys = f"optimizer.zero_stage={stage}" + (f" parallelism.dp_shard={shard}" if shard else "")
            peak = max(part.peak for part in fitting.stages) / GB
            return f"fits with {keys} ({peak:.2f} GB peak per rank): docs/config.md says when to pick which"
    return None


def memory_summary(config: Config, stage: int, gpu_memory_gb: float | None) -> str:
    """One line for the start of training: this rank's stage's estimated peak and total. Never raises: a planner
    that cannot model a configuration must not stop a run that may well fit."""
    try:
        estimate = estimate_memory(config, gpu_memory_gb if gpu_memory_gb is not None else DEFAULT_GPU_MEMORY_GB)
    except Exception as error:  # noqa: BLE001 - the estimate is advice; training goes on without it
        return f"memory estimate unavailable: {error}"
    mine = estimate.stages[stage]
    line = f"memory estimate for pipeline stage {stage}: {mine.peak / GB:.1f} GB peak allocated per rank"
    if gpu_memory_gb is None:  # not on a GPU: the CUDA runtime and allocator terms of the total do not apply
        return line
    verdict = (f"fits in {gpu_memory_gb:.1f} GB" if mine.total <= gpu_memory_gb * GB else
               f"more than the {gpu_memory_gb:.1f} GB of this GPU")
    return f"{line}, {mine.total / GB:.1f} GB of device memory, {verdict}"


# --- parameters and optimizer state ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StageState:
    """A stage's parameters on one rank: its layers, their bytes, the elements of the optimizer's shard of them and
    the bytes of those shards' masters, and the padded vocabulary its model was built with."""

    layers: list[int]
    chunk_layers: dict[int, range]  # the layers of each of the stage's model chunks
    weight_bytes: int  # ZeRO-3: the shards
    gradient_bytes: int  # the gradient buffers (ZeRO-2/3: the shards of the step's gradients)
    gathered_bytes: int  # ZeRO-3: the whole weights of the units gathered at the peak
    staging: _Staging
    held: _HeldGradients
    optimizer_elements: float
    master_bytes: float
    fp8_weight_elements: tuple[int, ...]  # per layer, weights of the linears that FP8 converts
    padded_vocab_size: int


@dataclass(frozen=True)
class _HeldGradients:
    """Bytes of the gradients a stage holds as autograd produced them (buckets without a buffer), by when the
    backward produces them: the LM head's and the final norm's first, then each layer's, the input embedding's last.
    A tied embedding is the head's weight: its gradient is there from the loss's backward on, and at the end the
    embedding's is added to it (two more of its size at once)."""

    head: int  # the LM head's weight (if held and on this stage), tied or not
    final_norm: int
    layers: tuple[int, ...]  # in layer order
    embedding: int  # an untied input embedding
    tied: int  # a tied embedding: its weight's bytes, for the sum at the end

    @classmethod
    def of(cls, model: nn.Module, held: dict[int, int]) -> _HeldGradients:
        def total(module: nn.Module | None) -> int:
            return 0 if module is None else sum(held.get(id(param), 0) for param in module.parameters())

        head, embedding = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
        tied = head is not None and embedding is not None and head.weight is embedding.weight
        return cls(head=total(head), final_norm=total(getattr(model, "norm", None)),
                   layers=tuple(total(layer) for layer in model.layers.values()),
                   embedding=0 if tied else total(embedding), tied=total(embedding) if tied else 0)

    @property
    def total(self) -> int:
        return self.head + self.final_norm + sum(self.layers) + self.embedding


def _stage_state(config: Config, stage: int) -> _StageState:
    """Build pipeline stage ``stage``'s model as training does, on the meta device (no memory), for the rank at
    coordinate 0 of the other axes, and count its parameters from their local shapes, dtypes and placements."""
    optimizer, zero = config.optimizer, config.optimizer.zero_stage
    layout = Layout.from_config(config)
    grid = GridPosition(layout, layout.coordinates(layout.rank_of({Axis.PP: stage})))
    converters = (fp8_converter(config.fp8),) if config.fp8 is not None and config.fp8.enabled else ()
    model = build_stage(config.model.model_config, grid, BuildOptions.from_config(config), converters)
    weight_bytes = gradient_bytes = optimizer_elements = master_bytes = 0.0
    single_micro_batch = config.tokens.batch_accumulation_per_replica == 1
    held: dict[int, int] = {}  # id(parameter) -> bytes of its gradient, where a bucket holds autograd's
    units = parameter_units(model) if zero == 3 else {}
    whole: dict[str, int] = {}  # ZeRO-3: the bytes of each unit's weights
    full_gradients: dict[str, list[int]] = {}  # ZeRO-2/3: each unit's (ZeRO-2: the stage's) full gradients' bytes
    for param in model.parameters():  # each shared parameter once
        elements, element_bytes = param.numel(), param.element_size()
        placement = get_placement(param)
        # the ranks the buckets reduce over and, under ZeRO, shard over (HSDP: the replicas are left out)
        shards = math.prod(layout.size(axis) for axis in placement.gradient_axes) // layout.dpr
        unit = units.get(placement.name, "")
        grad_dtype = gradient_dtype(param.dtype, optimizer.accumulate_grad_in_fp32, single_micro_batch, shards,
                                    bool(placement.pipeline_copies))
        if zero >= 2 and shards > 1:
            gradient_bytes += elements / shards * grad_dtype.itemsize
            staged = torch.bfloat16 if optimizer.grad_reduce_in_bf16 else grad_dtype
            full_gradients.setdefault(unit, []).append(elements * staged.itemsize)
        elif holds_autograd_gradient(elements, single_micro_batch, shards, bool(placement.pipeline_copies),
                                     optimizer.persistent_gradient_buffers):
            held[id(param)] = elements * element_bytes
        else:
            gradient_bytes += elements * grad_dtype.itemsize
        if zero == 3 and shards > 1:
            weight_bytes += elements / shards * element_bytes
            whole[unit] = whole.get(unit, 0) + elements * element_bytes
        else:
            weight_bytes += elements * element_bytes
        shard_elements = elements / shards if zero else elements
        optimizer_elements += shard_elements
        master_bytes += shard_elements * master_element_bytes(param.dtype, optimizer.store_param_remainders)
    layers = sorted((size for unit, size in whole.items() if unit != OUTER), reverse=True)
    buckets = {unit: _bucket_bytes(sizes, config.model.ddp_bucket_cap_mb * 2**20)
               for unit, sizes in full_gradients.items()}
    if zero == 3:
        staging = _Staging(max(buckets.get(OUTER, [0])), tuple(tuple(buckets.get(f"layers.{index}", []))
                                                               for index in model.layers))
    else:
        staging = _Staging(sum(sorted(buckets.get("", []), reverse=True)[:REDUCTIONS_IN_FLIGHT + 1]))
    return _StageState(
        layers=held_layers(model), chunk_layers=model.chunk_layers, weight_bytes=int(weight_bytes),
        gradient_bytes=int(gradient_bytes), gathered_bytes=whole.get(OUTER, 0) + sum(layers[:2]),
        staging=staging,
        held=_HeldGradients.of(model, held),
        optimizer_elements=optimizer_elements, master_bytes=master_bytes,
        fp8_weight_elements=tuple(sum(map(_fp8_weight_elements, layer.modules())) for layer in model.layers.values()),
        padded_vocab_size=model.padded_vocab_size,
    )


@dataclass(frozen=True)
class _Staging:
    """ZeRO-2/3's full-size gradients of the buckets being filled or reduced: ``throughout`` the backward (ZeRO-3:
    the outer unit's largest bucket, which the LM head's gradient starts; ZeRO-2: the largest buckets), and under
    ZeRO-3 each layer's buckets (in the order the backward fills them), the last ``REDUCTIONS_IN_FLIGHT`` + 1 of
    them alive at once."""

    throughout: int
    layers: tuple[tuple[int, ...], ...] = ()

    def at_layer(self, index: int) -> int:
        """During the backward of the stage's layer ``index`` (its number of layers: before the first layer's
        backward; -1: after the last one's, nothing being filled)."""
        filled = [size for layer in self.layers[max(index, 0):] for size in layer]
        return self.throughout + sum(filled[:REDUCTIONS_IN_FLIGHT + (index >= 0)])


def _bucket_bytes(gradient_bytes: list[int], bucket_bytes: int) -> list[int]:
    """The sizes of the buckets of gradients of ``gradient_bytes`` (in parameter order), in the order the backward
    fills them: the parameters taken in reverse, a bucket closed once it holds ``bucket_bytes``
    (``GradientBuckets``)."""
    buckets, current = [], 0
    for size in reversed(gradient_bytes):
        current += size
        if current >= bucket_bytes:
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


def _moment_bytes(config: Config) -> int:
    return getattr(torch, config.optimizer.adam_moments_dtype).itemsize


def _fp8_weight_elements(module: nn.Module) -> int:
    """Weight elements of ``module`` if a converter gave it an FP8 matmul (the bias stays in the model dtype)."""
    if not any(isinstance(value, FP8Matmul) for value in vars(module).values()):
        return 0
    return sum(param.numel() for key, param in module.named_parameters(recurse=False) if key != "bias")


# --- activations and logits --------------------------------------------------------------------------------------


def _layout(config: Config, micro_batch_size: int) -> Layout:
    """The run's layout at ``micro_batch_size`` (the planner tries several): the token shares come from it."""
    return replace(Layout.from_config(config), micro_batch_size=micro_batch_size)


def _activation_shape(config: Config, micro_batch_size: int) -> ActivationShape:
    layout = _layout(config, micro_batch_size)
    return ActivationShape(
        tokens=layout.rank_tokens, sequence_length=layout.sequence_length, tp=layout.tp,
        value_bytes=config.model.torch_dtype().itemsize, residual_share=layout.residual_share,
        linear_input_share=layout.linear_input_share, compiled=config.model.compile,
        recompute=config.parallelism.recompute, cp=layout.cp,
    )


def final_norm_bytes(config: Config, micro_batch_size: int) -> int:
    """The final norm keeps its input (compiled with ``model.compile``; eager, the normalised values and an fp32
    copy of its input) and its output, the LM head's input."""
    d, hidden = config.model.torch_dtype().itemsize, config.model.model_config.hidden_size
    layout = _layout(config, micro_batch_size)
    kept_of_input = d if config.model.compile else 4 + d
    return int(layout.rank_tokens * (kept_of_input * hidden * layout.residual_share
                                     + d * hidden * layout.linear_input_share))


def logits_bytes(config: Config, micro_batch_size: int) -> tuple[int, int]:
    """(kept, transient): what the loss keeps per micro-batch in flight, and what its forward or backward adds.
    ``fused_loss_bytes`` with ``model.loss_chunk_tokens``; without it, as follows.

    Logits span the padded vocabulary split over tp, for every token of the micro-batch (the LM head gathers the
    sequence). With one TP rank the loss is ``F.cross_entropy`` on the logits cast to fp32: compiled, it keeps the
    model-dtype logits and its backward writes their gradient in the same dtype (the fp32 copy is fused away);
    eager, it keeps the fp32 log-softmax and its backward holds two more fp32 tensors of that size. Over several TP
    ranks the vocabulary-parallel cross-entropy keeps the fp32 softmax, next to the model-dtype logits in the
    forward and their gradient in the backward; eager, its forward also holds the fp32 copy of the logits.
    """
    if config.model.loss_chunk_tokens:
        return fused_loss_bytes(config, micro_batch_size)
    tp, d = config.parallelism.tp, config.model.torch_dtype().itemsize
    vocab = padded_vocab_size(config.model.model_config.vocab_size, config.model.make_vocab_size_divisible_by, tp)
    elements = _layout(config, micro_batch_size).rank_tokens * vocab // tp
    logits, fp32 = elements * d, elements * 4
    compiled = config.model.compile
    if tp == 1:
        return (logits, logits) if compiled else (fp32, 2 * fp32)
    return (fp32, logits) if compiled else (fp32, logits + fp32)


# Bytes per element of a chunk's logits that the two passes of the fused loss hold at most, beyond the logits
# themselves: compiled, the gradient in the model dtype (added below); eager, the fp32 intermediates of
# ``loss_and_logit_gradient`` (softmax, the boolean target mask, softmax - 1, the selection, its weighted copy).
FUSED_EAGER_PASS_BYTES = 4 + 1 + 4 + 4


def fused_loss_bytes(config: Config, micro_batch_size: int) -> tuple[int, int]:
    """(kept, transient) of the fused LM head and loss (``parallel/linear_cross_entropy.py``), from its code (not yet
    checked against a measured peak).

    It keeps, per micro-batch in flight, the gradients it computed in the forward: the head input's (the whole
    sequence, gathered over TP) and the weight shard's, in the model dtype. Its forward holds one chunk's logits
    and their gradient (compiled) or fp32 intermediates (eager); from the second chunk on the weight gradient is
    summed in fp32 (at the second, next to the first chunk's product and the new one).
    """
    c, tp, d = config.model.model_config, config.parallelism.tp, config.model.torch_dtype().itemsize
    vocab = padded_vocab_size(c.vocab_size, config.model.make_vocab_size_divisible_by, tp) // tp
    tokens = _layout(config, micro_batch_size).rank_tokens
    weight = vocab * c.hidden_size
    chunk = min(config.model.loss_chunk_tokens, tokens) * vocab
    passes = chunk * (2 * d if config.model.compile else d + FUSED_EAGER_PASS_BYTES)
    kept = tokens * c.hidden_size * d + weight * d
    if chunk == tokens * vocab:  # one chunk: its product is the weight gradient
        return kept, passes
    return kept, max(passes + 4 * weight, chunk * d + weight * (4 + 2 * d))


def _stage_memory(config: Config, spec: ModelSpec, stage: int, state: _StageState,
                  micro_batch_size: int) -> StageMemory:
    layout = _layout(config, micro_batch_size)
    in_flight = layout.in_flight(stage)
    shape = _activation_shape(config, micro_batch_size)
    per_layer = [spec.layer_activations(config.model.model_config, index, shape) for index in state.layers]
    if shape.recompute != "none":  # one byte each: the FP8 weights a recomputed forward keeps
        per_layer = [(k + fp8, t) for (k, t), fp8 in zip(per_layer, state.fp8_weight_elements, strict=True)]
    kept_by_layer = dict(zip(state.layers, (k for k, _ in per_layer), strict=True))
    kept = {chunk: sum(kept_by_layer[index] for index in layers) for chunk, layers in state.chunk_layers.items()}
    backward = max(t for _, t in per_layer)
    logits = 0
    held = state.held
    held_at_start = held.final_norm + (held.layers[-1] if held.layers else 0)
    timeline, head_chunk = layout.timeline(), layout.chunks - 1
    if head_chunk in kept:
        beside = _head_side(config, spec, shape)
        kept[head_chunk] += final_norm_bytes(config, micro_batch_size) + beside.kept
        backward = max(backward, beside.transient)
        logits_kept, logits_transient = logits_bytes(config, micro_batch_size)
        logits_kept *= 1 + beside.head_outputs
        # The loss's backward runs before any layer's, when every layer still holds its activations.
        in_flight_logits = timeline.held(stage, {chunk: chunk == head_chunk for chunk in kept})
        logits = int(in_flight_logits) * logits_kept + max(logits_transient - backward, 0)
        if not config.model.loss_chunk_tokens:  # the fused loss counts the head's gradient it keeps
            held_at_start += held.head
    staging = state.staging
    gradients = held_at_start + staging.at_layer(len(per_layer))
    activations = int(timeline.held(stage, kept)) + backward
    # Later moments, when held gradients may outweigh the activations left (held gradients imply one micro-batch):
    # each layer's backward, from the last layer down, and the backward's end.
    later = held.head + held.final_norm
    moments = []
    for index in reversed(range(len(per_layer))):
        later += held.layers[index]
        activations_then = sum(k for k, _ in per_layer[:index + 1]) + per_layer[index][1]
        moments.append((later + staging.at_layer(index), activations_then))
    moments.append((held.total + 2 * held.tied + staging.at_layer(-1),
                    _embedding_backward_bytes(config, micro_batch_size, stage)))
    for held_then, activations_then in moments:
        if held_then + activations_then > gradients + activations + logits:
            gradients, activations, logits = held_then, activations_then, 0
    return StageMemory(
        stage=stage, layers=state.layers, in_flight=in_flight, weights=state.weight_bytes + state.gathered_bytes,
        gradients=state.gradient_bytes + gradients, master_weights=int(state.master_bytes),
        adam_moments=int(2 * _moment_bytes(config) * state.optimizer_elements),
        activations=activations, logits=logits, workspace=STEP_WORKSPACE_BYTES,
    )


def _head_side(config: Config, spec: ModelSpec, shape: ActivationShape) -> HeadSideActivations:
    """What the family's modules beside the LM head keep (DeepSeek-V3's multi-token prediction), if it has any."""
    if spec.head_side_activations is None:
        return HeadSideActivations(kept=0, transient=0, head_outputs=0)
    return spec.head_side_activations(config.model.model_config, shape)


def _embedding_backward_bytes(config: Config, micro_batch_size: int, stage: int) -> int:
    """What the first stage holds at the backward's end besides its gradients: the gradient of the embedding's
    output, which the first layer's backward hands over, and the fp32 sums by token of CUDA's embedding backward,
    counted as two model-dtype copies and one fp32 copy of the output's size. Held gradients can make this moment
    the peak: the 8B shape recomputed on one H200 peaked there 179 MB above its weights, gradients and optimizer
    state (112.60 GB), 112 MB beyond the step's workspace, where this counts 134 MB (the split between those tensors
    was not measured)."""
    if stage != 0:
        return 0
    d, hidden = config.model.torch_dtype().itemsize, config.model.model_config.hidden_size
    return _layout(config, micro_batch_size).rank_tokens * hidden * (2 * d + 4)


def _largest_fitting(fits) -> int:
    """The largest micro-batch size ``fits`` accepts (0 if not 1), for a ``fits`` that holds up to some size."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= LARGEST_MICRO_BATCH_SEARCHED and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
