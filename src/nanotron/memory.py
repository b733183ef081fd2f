"""Per-rank GPU memory of a training run, estimated from its config before anything is allocated.

Every pipeline stage is estimated on its own (stages hold different layers and keep different numbers of
micro-batches in flight); ranks of one stage hold the same amounts. All sizes are bytes; GB below means 1e9 bytes,
as in ``torch.cuda.max_memory_allocated() / 1e9``, the peak that ``scripts/benchmark.py`` and the step line report.

How each part is computed, and why:

- **weights**: the parameters this rank holds, in ``model.dtype`` (4 bytes for those a module keeps in fp32,
  ``fp32_parameters``). They are counted on the model built on the meta device, so every family's spec decides
  the shapes; the family's tensor-parallel plan decides which are split over ``tp`` (whole heads per rank, kv heads
  replicated when tp exceeds them, the vocabulary rows), and experts are split over ``expert_parallel_size``.
- **gradients**: one flat buffer of the same elements (``data_parallel.py``): fp32 with
  ``optimizer.accumulate_grad_in_fp32``, else the parameter's dtype. ZeRO-1 reduce-scatters into a slice of the
  full buffer, so the buffer keeps its full size.
- **master weights**: the optimizer's fp32 copy of its shard (``optimizer.py`` clones the shard even when the model
  is fp32). **Adam moments**: two more fp32 tensors of the same shard. With ``zero_stage: 1`` the shard is 1/dp·ep
  of every dense parameter and 1/dp of every expert (their replicas: ``Placement.gradient_axes``), else everything.
- **activations**: what autograd keeps for the backward, per micro-batch in flight, plus the largest transient of a
  backward. In flight on stage ``s`` of ``pp``: ``min(pp - s, batch_accumulation_per_replica)`` under 1F1B (a
  single stage keeps one), all of them under AFAB. The decoder layer's saved tensors (``llama_layer_bytes``, and
  ``mamba_layer_bytes`` for compiled Mamba blocks) come from reading the layer's code and were checked layer by
  layer on an H200; with ``parallelism.recompute_layer`` each layer keeps only its input, and the backward
  rebuilds one layer at a time. The last stage adds the final norm, which is never compiled.
- **FP8** (``fp8.enabled``) with ``parallelism.recompute_layer``: the compiled forward keeps the FP8 copies of the
  converted linears' weights for the backward, counted as one byte per weight element per micro-batch in flight
  (the 8B shape on one H200 peaked 6.44 GB above bf16, where this counts 6.98 GB). Without recomputation FP8 keeps
  less than bf16, since the backward recomputes the cast inputs (45.8 against 52.3 GB at the 1B shape); that is
  not modeled, so the estimate is then an upper bound.
- **logits**: the LM head's output and the loss buffers of the last stage (``logits_bytes``), per micro-batch in
  flight and during the loss's backward; with the fused head and loss (``model.loss_chunk_tokens``), the gradients
  it computes in the forward and keeps, and one chunk's logits (``fused_loss_bytes``).
- **workspace**: cuBLAS workspaces and the step's small buffers, allocated by the first step.

Their sum is the **peak** the PyTorch allocator reports. The device needs more: the CUDA context, the libraries'
kernels and NCCL's buffers live outside the allocator (``CUDA_RUNTIME_BYTES``), and the caching allocator holds
freed blocks it cannot reuse for other shapes (``ALLOCATOR_SLACK``). ``total`` adds both and decides whether a
configuration fits.

The columns add up to the peak: the loss's backward and a layer's backward do not overlap, so only the larger of
the two transients counts (the layers' one under activations, the rest of the loss's under logits).

Checked against the peaks in docs/benchmarks.md ("Memory planner against measured peaks"): the Llama 1B shape on
one H200 with compiled layers (52.3 GB), at pp=2 1F1B with 10 + 6 layers (43.0 / 28.1 GB), at tp=2 with sequence
parallelism (30.4 GB), the 8B shape at dp=2 with ZeRO-1 (118.4 GB), and on one H200 with recomputed layers and
bf16 gradients (135.7 GB; 142.1 GB in FP8): within 1%, except tp=2 at -7% (that
figure is from an older commit; the layout measured 28.3 GB at the commit the planner was checked on). Compiled
Mamba at 130M (24.6 GB; 7.0 GB with recomputed layers) and 1.4B (76.6 GB): within 0.3%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from nanotron.config import Config, ConfigError, LlamaConfig, MambaConfig
from nanotron.models.build import BuildOptions, padded_vocab_size, pipeline_stage_layers
from nanotron.models.mamba.parallelize import SelectiveStateSpace
from nanotron.models.moe.model import GroupedExperts
from nanotron.models.moe.parallelize import MixtureOfExperts
from nanotron.models.registry import spec_for_config
from nanotron.nn.fp8 import FP8Matmul, fp8_converter
from nanotron.nn.selective_scan import BLOCK_T as SCAN_CHUNK
from nanotron.parallel.placement import Shard
from nanotron.parallel.tensor_parallel import REDUCE_SCATTER, Column, Row, VocabEmbedding

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
    layers: range
    in_flight: int  # micro-batches whose activations are kept at once
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
            rows.append([str(stage.stage), f"{stage.layers.start}-{stage.layers.stop - 1}", str(stage.in_flight),
                         *(f"{part / GB:.2f}" for part in parts),
                         "yes" if stage.total <= self.gpu_memory_gb * GB else "no", str(largest)])
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [" | ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
        lines.insert(1, "-+-".join("-" * width for width in widths))
        verdict = "fits" if self.fits else "does not fit"
        return "\n".join([
            self.description, *lines,
            f"GB per rank. peak: what torch.cuda.max_memory_allocated reports (workspace of "
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
    p = config.parallelism
    model_config = config.model.model_config
    if not isinstance(model_config, (LlamaConfig, MambaConfig)):
        raise ConfigError(f"the memory planner has no activation model for {type(model_config).__name__}; it knows "
                          "Llama-style decoders (llama, llamoe) and Mamba")
    if isinstance(model_config, MambaConfig) and not config.model.compile:
        raise ConfigError("the memory planner models compiled Mamba blocks only (model.compile: true): eager ones "
                          "peaked up to 14% above its count on an H200, for want of a model of their backward")
    layers = pipeline_stage_layers(model_config, BuildOptions.from_config(config), p.pp, p.tp)
    state = _stage_states(config, layers)

    def stages_at(micro_batch_size: int) -> tuple[StageMemory, ...]:
        return tuple(_stage_memory(config, stage, layers[stage], state[stage], micro_batch_size)
                     for stage in range(p.pp))

    budget = gpu_memory_gb * GB
    largest = tuple(_largest_fitting(lambda mb, s=stage: stages_at(mb)[s].total <= budget) for stage in range(p.pp))
    t, spec = config.tokens, spec_for_config(model_config)
    vocab = padded_vocab_size(model_config.vocab_size, config.model.make_vocab_size_divisible_by, p.tp)
    parameters = spec.costs(model_config, vocab, t.sequence_length).parameters
    size = f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"
    description = (f"{spec.name}, {size} parameters, dp {p.dp} x ep {p.expert_parallel_size} x tp "
                   f"{p.tp} x pp {p.pp} ({_schedule_name(config)}), micro-batch {t.micro_batch_size} x "
                   f"{t.sequence_length} tokens, {t.batch_accumulation_per_replica} per step, {config.model.dtype}"
                   + (", compiled" if config.model.compile else ", eager")
                   + (", recomputed layers" if p.recompute_layer else ""))
    return MemoryEstimate(description, stages_at(t.micro_batch_size), gpu_memory_gb, t.micro_batch_size, largest)


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
    """A stage's parameters on one rank: their bytes, and the fp32 elements of the optimizer's shard of them."""

    weight_bytes: int
    gradient_bytes: int
    optimizer_elements: float
    fp8_weight_elements: int  # weights of the linears that FP8 converts


def _stage_states(config: Config, layers: list[range]) -> list[_StageState]:
    """Walk the family's model on the meta device (no memory) and sum, per stage, the local sizes of the parameters
    the stage keeps (``keep_stage``: the embedding on the first, the final norm and the LM head on the last; a
    tied LM head is the embedding itself on one stage, its own copy on the last of several)."""
    model_config, p, opt = config.model.model_config, config.parallelism, config.optimizer
    spec = spec_for_config(model_config)
    vocab = padded_vocab_size(model_config.vocab_size, config.model.make_vocab_size_divisible_by, p.tp)
    with torch.device("meta"):
        model = spec.model_class(model_config, vocab)
        if config.fp8 is not None and config.fp8.enabled:
            fp8_converter(config.fp8)(model)
    plan = spec.tensor_parallel_plan(model_config) if p.tp > 1 else {}
    model_bytes = config.model.torch_dtype().itemsize
    zero = opt.zero_stage == 1

    by_part: dict[str, dict[int, tuple[int, int, bool]]] = {}  # part -> {id(param): (elements, bytes each, expert)}
    fp8_by_part: dict[str, int] = {}  # part -> weight elements of its FP8 linears
    for name, module in model.named_modules():
        keep_fp32 = getattr(module, "fp32_parameters", ())
        part = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
        in_fp8 = any(isinstance(getattr(module, kind, None), FP8Matmul) for kind in ("matmul", "expert_matmul"))
        for key, param in module.named_parameters(recurse=False):
            elements, expert = _local_elements(module, name, key, param, plan, p.tp, p.expert_parallel_size)
            by_part.setdefault(part, {})[id(param)] = (elements, 4 if key in keep_fp32 else model_bytes, expert)
            if in_fp8 and key != "bias":
                fp8_by_part[part] = fp8_by_part.get(part, 0) + elements

    states = []
    for stage, stage_layers in enumerate(layers):
        parts = [f"layers.{index}" for index in stage_layers]
        parts += ["embed_tokens"] if stage == 0 else []
        parts += ["norm", "lm_head"] if stage == p.pp - 1 else []
        held = {key: value for part in parts for key, value in by_part.get(part, {}).items()}
        replicas = {False: p.dp * p.expert_parallel_size, True: p.dp}  # dense weights, experts
        states.append(_StageState(
            weight_bytes=sum(n * size for n, size, _ in held.values()),
            gradient_bytes=sum(n * (4 if opt.accumulate_grad_in_fp32 else size) for n, size, _ in held.values()),
            optimizer_elements=sum(n / (replicas[expert] if zero else 1) for n, _, expert in held.values()),
            fp8_weight_elements=sum(fp8_by_part.get(part, 0) for part in parts),
        ))
    return states


def _local_elements(module: nn.Module, module_name: str, key: str, param: torch.Tensor, plan: dict, tp: int,
                    ep: int) -> tuple[int, bool]:
    """Elements of ``param`` (of ``module``) on one rank, and whether it is an expert weight: the sharding that
    ``apply_tensor_parallel`` and ``apply_expert_parallel`` give the module (or its nearest planned ancestor)."""
    shape = list(param.shape)
    if isinstance(module, GroupedExperts):  # [experts, ...]: experts over ep, feed-forward width over tp
        shape[0] //= ep
        if tp > 1:
            shape[1 if key == "gate_up_proj" else 2] //= tp
        return math.prod(shape), True
    style = _planned_style(module_name, plan)
    if isinstance(style, SelectiveStateSpace):  # a Mamba mixer: every parameter split along its channel dim
        shape[1 if module_name.endswith(("x_proj", "out_proj")) else 0] //= tp
    elif isinstance(style, Column):
        shape[0] = Shard("tp", 0, style.chunks, style.units).local_size(shape[0], tp)
    elif isinstance(style, Row):
        shape[1] //= tp
    elif isinstance(style, VocabEmbedding):
        shape[0] //= tp
    # Norms (also sequence-parallel ones) and the router of a tensor-parallel mixture of experts are replicated.
    return math.prod(shape), False


def _planned_style(module_name: str, plan: dict):
    """The plan entry that applies to ``module_name``: its own, else a whole block's (``MixtureOfExperts``, a Mamba
    mixer's ``SelectiveStateSpace``)."""
    parts = module_name.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        style = next((s for key, s in plan.items() if name == key or name.endswith("." + key)), None)
        if style is not None:
            whole_block = isinstance(style, (MixtureOfExperts, SelectiveStateSpace))
            return style if end == len(parts) or whole_block else None
    return None


# --- activations and logits --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Widths:
    """One rank's share of a decoder layer, from the config and the tensor-parallel layout."""

    hidden: int
    q: int  # query width on this rank (heads × head_dim)
    kv: int  # key (= value) width on this rank, a replicated head when tp exceeds the kv heads
    heads: int
    head_dim: int
    ffn: int  # dense MLP width on this rank
    residual_share: float  # share of the tokens of the residual stream (1/tp with sequence parallelism)
    linear_input_share: float  # share of a column-parallel linear's input it keeps (1/tp only when overlapped)
    value_bytes: int  # model dtype


def _token_shares(config: Config) -> tuple[float, float]:
    """(residual, linear input): the share of a micro-batch's tokens a rank keeps of the residual stream (1/tp with
    sequence parallelism) and of a column-parallel linear's input (1/tp only when the backward is overlapped: it
    keeps the input shard and gathers it again; the plain one keeps the gathered input)."""
    p = config.parallelism
    sequence_parallel = p.tp > 1 and p.tp_mode == REDUCE_SCATTER
    return (1 / p.tp if sequence_parallel else 1.0,
            1 / p.tp if sequence_parallel and p.tp_linear_async_communication else 1.0)


def _widths(config: Config) -> _Widths:
    c, p = config.model.model_config, config.parallelism
    tp = p.tp
    kv_width = c.num_key_value_heads * c.head_dim
    residual_share, linear_input_share = _token_shares(config)
    return _Widths(
        hidden=c.hidden_size, q=c.num_attention_heads * c.head_dim // tp,
        kv=Shard("tp", 0, (kv_width,), (c.head_dim,)).local_size(kv_width, tp),
        heads=c.num_attention_heads // tp, head_dim=c.head_dim, ffn=c.intermediate_size // tp,
        residual_share=residual_share, linear_input_share=linear_input_share,
        value_bytes=config.model.torch_dtype().itemsize,
    )


def llama_layer_bytes(config: Config, layer: int, micro_batch_size: int, recomputed: bool) -> tuple[int, int]:
    """(kept, transient): bytes one decoder layer keeps for the backward per micro-batch, and the most it adds while
    its backward runs, on one rank.

    Per token, with d the model dtype's bytes and widths on this rank, a compiled layer keeps:

    - its input and the residual after attention (d·hidden each; the compiler recomputes the norms from them),
    - both norms' outputs, the inputs of the q|k|v and gate|up matmuls (d·hidden each),
    - the fused q|k|v output (SDPA's v is a view of it) and the rotated q and k: d·(2q + 3kv),
    - the attention output, the o_proj input (d·q), and SDPA's fp32 logsumexp (4 bytes per head),
    - the gate|up output, which the SwiGLU backward reads, and the SwiGLU output, the down_proj input (3d·ffn),

    plus the rotary cos/sin tables cast to the model dtype (2·sequence·head_dim·d per micro-batch). Eager, each
    norm keeps instead its fp32 input copy, the normalised values (for the weight's gradient) and its output:
    8·hidden more bytes per token. Measured per layer on an H200 (1B and 8B shapes, eager and compiled, tp=1 and
    tp=2 in both modes): within 0.1% of these counts. A recomputed layer keeps its input (and, compiled, a tensor of
    the SwiGLU width that the compiler saves; measured) and rebuilds the rest during its backward. The backward
    adds the gradients of the gate|up and SwiGLU outputs (3d·ffn per token) on top of what the layer keeps.

    Mixture-of-experts layers replace the MLP terms by those of the experts each token visits (derived from
    ``models/moe.py``, not measured): its ``k`` copies of the token, gate|up and SwiGLU outputs and the experts'
    outputs, and the router's fp32 logits and probabilities.
    """
    w, c = _widths(config), config.model.model_config
    d, tokens, sequence = w.value_bytes, micro_batch_size * config.tokens.sequence_length, config.tokens.sequence_length
    compiled = config.model.compile
    residual, linear_input = d * w.hidden * w.residual_share, d * w.hidden * w.linear_input_share
    if compiled:
        norms = 2 * (residual + linear_input)
    else:
        norms = 2 * (4 * w.hidden * w.residual_share + residual + linear_input)
    attention = d * (2 * w.q + 3 * w.kv) + d * w.q + 4 * w.heads
    if getattr(c, "is_moe_layer", lambda index: False)(layer):
        k, experts = c.num_experts_per_tok, c.moe_num_experts
        feed_forward = k * d * (2 * w.hidden + 3 * w.ffn) + 3 * 4 * experts
        gradients = k * 3 * d * w.ffn
        swiglu_output = k * d * w.ffn
    else:
        feed_forward = 3 * d * w.ffn
        gradients = 3 * d * w.ffn
        swiglu_output = d * w.ffn
    rotary_tables = 2 * sequence * w.head_dim * d
    full = int(tokens * (norms + attention + feed_forward) + rotary_tables)
    transient = int(tokens * gradients)
    if not recomputed:
        return full, transient
    kept = tokens * (residual + (swiglu_output if compiled else 0))
    return int(kept), full + transient


def mamba_layer_bytes(config: Config, micro_batch_size: int, recomputed: bool) -> tuple[int, int]:
    """(kept, transient) of one compiled Mamba block per micro-batch on one rank, as ``llama_layer_bytes``.

    With h = d_model, e = d_inner / tp (this rank's channels), r = dt_rank, n = d_state and d the model dtype's
    bytes, the block keeps per token:

    - the fp32 residual stream it reads (4h) and the in_proj input (d·h),
    - in_proj's output x|z, the conv/SiLU output (the scan's x), dt_proj's output, the scan's output y and the
      gated out_proj input: 6d·e (the conv kernels read x inside in_proj's output: no padded copy),
    - Δ in fp32 (4e), and the state entering every chunk of ``SCAN_CHUNK`` steps (fp32: 4n·e / ``SCAN_CHUNK``),
    - x_proj's output dt|B|C and the scan's contiguous copies of B and C: d·(r + 4n),

    and per block the fp32 A (4e·n). Measured per layer on an H200 (130M and 1.4B shapes, bf16): within 0.02%,
    when y was fp32; with y in the model dtype the step peaks fell by the 2e per token this count drops, to within
    0.1% of it. A recomputed block keeps its input (measured). No transient is added for the backward: at both
    shapes, with and without recomputation, the step peaks came within 0.3% of the count without one (the loss's
    backward, which runs first, needs more).
    """
    c, p = config.model.model_config, config.parallelism
    d, tokens = config.model.torch_dtype().itemsize, micro_batch_size * config.tokens.sequence_length
    h, e, r, n = c.d_model, c.d_inner // p.tp, c.dt_rank, c.ssm_cfg.d_state
    residual_share, linear_input_share = _token_shares(config)
    residual = (4 if c.residual_in_fp32 else d) * h * residual_share
    chunk_states = 4 * n * e / SCAN_CHUNK
    per_token = residual + d * h * linear_input_share + 6 * d * e + 4 * e + chunk_states + d * (r + 4 * n)
    full = int(tokens * per_token + 4 * e * n)
    return (int(tokens * residual), full) if recomputed else (full, 0)


def final_norm_bytes(config: Config, micro_batch_size: int) -> int:
    """The final norm (never compiled) keeps its fp32 input copy, the normalised values and its output."""
    d, hidden = config.model.torch_dtype().itemsize, config.model.model_config.hidden_size
    residual_share, linear_input_share = _token_shares(config)
    tokens = micro_batch_size * config.tokens.sequence_length
    return int(tokens * ((4 + d) * hidden * residual_share + d * hidden * linear_input_share))


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
    elements = micro_batch_size * config.tokens.sequence_length * vocab // tp
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
    tokens = micro_batch_size * config.tokens.sequence_length
    weight = vocab * c.hidden_size
    chunk = min(config.model.loss_chunk_tokens, tokens) * vocab
    passes = chunk * (2 * d if config.model.compile else d + FUSED_EAGER_PASS_BYTES)
    kept = tokens * c.hidden_size * d + weight * d
    if chunk == tokens * vocab:  # one chunk: its product is the weight gradient
        return kept, passes
    return kept, max(passes + 4 * weight, chunk * d + weight * (4 + 2 * d))


def _in_flight(config: Config, stage: int) -> int:
    p, accumulation = config.parallelism, config.tokens.batch_accumulation_per_replica
    if p.pp > 1 and p.pp_engine == "afab":
        return accumulation
    return min(p.pp - stage, accumulation)


def _schedule_name(config: Config) -> str:
    return config.parallelism.pp_engine.upper() if config.parallelism.pp > 1 else "gradient accumulation"


def _stage_memory(config: Config, stage: int, layers: range, state: _StageState,
                  micro_batch_size: int) -> StageMemory:
    in_flight = _in_flight(config, stage)
    recomputed = config.parallelism.recompute_layer
    if isinstance(config.model.model_config, MambaConfig):
        per_layer = [mamba_layer_bytes(config, micro_batch_size, recomputed)] * len(layers)
    else:
        per_layer = [llama_layer_bytes(config, index, micro_batch_size, recomputed) for index in layers]
    kept = sum(k for k, _ in per_layer)
    if recomputed:
        kept += state.fp8_weight_elements  # one byte each: the FP8 weights a recomputed forward keeps
    backward = max(t for _, t in per_layer)
    logits = 0
    if stage == config.parallelism.pp - 1:
        kept += final_norm_bytes(config, micro_batch_size)
        logits_kept, logits_transient = logits_bytes(config, micro_batch_size)
        # The loss's backward runs before any layer's, when every layer still holds its activations.
        logits = in_flight * logits_kept + max(logits_transient - backward, 0)
    return StageMemory(
        stage=stage, layers=layers, in_flight=in_flight, weights=state.weight_bytes, gradients=state.gradient_bytes,
        master_weights=int(4 * state.optimizer_elements), adam_moments=int(8 * state.optimizer_elements),
        activations=in_flight * kept + backward, logits=logits, workspace=STEP_WORKSPACE_BYTES,
    )


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
