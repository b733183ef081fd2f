"""The compute of a micro-batch on a rank as the sum of its kernels' times, from a table of kernel speeds measured on
one GPU (``kernel_tables/<gpu>.json``, written there by ``scripts/planner_kernels.py``).

**The kernels** (``micro_batch_kernels``), read from the modules of the model as a rank of the layout holds them
(``collectives.rank_model``: 1/tp of each split linear, the rank's experts), over the micro-batch's tokens on the rank
(``T`` = micro-batch size × sequence / cp; sequence-parallel linears run on the gathered tokens):

- each linear of ``in`` × ``out`` features on the rank: three GEMMs, ``(m, n, k)`` for ``[m, k] × [k, n]``: the
  forward ``(T, out, in)``, the input gradient ``(T, in, out)`` and the weight gradient ``(out, in, T)``, each with
  2mnk FLOPs; the LM head of the fused loss (``model.loss_chunk_tokens``) runs them per chunk of tokens;
- each attention core: its forward and backward at the sequence and head dimension; forward FLOPs 2 · tokens · keys
  · heads on the rank · (head dim + value head dim), the scores and the weighted sum over the keys a query attends
  to on average (``attended_keys``: half the sequence when causal, fewer in a sliding window), twice that
  backward;
- each block of experts (``GroupedExperts``): its forward and backward as the block runs them (grouped GEMMs and the
  gated activation between), dims (experts on the rank, tokens per expert, hidden, ffn) with 6 · experts · tokens ·
  hidden · ffn FLOPs forward and twice that backward; the routed experts take the balanced share, ``T × top-k × ep /
  experts`` tokens each, a shared expert every token;
- the elementwise remainder (``elementwise_bytes``): the bytes it moves, at the bandwidth measured for an
  activation of the rank's (``T × hidden`` elements);
- recomputation adds one more forward: every forward kernel with ``full``, every one but attention's with
  ``selective``, the elementwise ones with ``pointwise``.

**The table**: per kernel kind, measured points ``dims → seconds`` for a known amount of work (FLOPs, or bytes for
the elementwise kind). A kernel's speed (work per second) is its own point's where one was measured at its dims;
otherwise it is interpolated linearly in the logarithms of the dims and of the speed between the points at the
powers of two around each dim (the recorder measures both for the shapes and splits it is given, so another split
or model of similar widths is priced between measured points); where one of those points is missing, the speed of
the nearest measured point (summed log distance of the dims) is taken. Time = work / speed.

**Which compute model prices a config** (``compute_model``, one rule): the kernel table of the cluster's GPU where
one is committed and it covers the config (a family with attention, linears in the model dtype: not FP8, not
Mamba's scan); otherwise the measured effective speed of the nearest recorded shape (``efficiency.py``).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path

from torch import nn

from nanotron.config import Config
from nanotron.layout import Layout
from nanotron.models.llama.costs import attended_keys
from nanotron.models.moe.model import GroupedExperts
from nanotron.models.registry import spec_for_config
from nanotron.nn.attention import AttentionCore
from nanotron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from nanotron.planning.collectives import rank_model

TABLES = Path(__file__).with_name("kernel_tables")

GEMM_FORWARD, GEMM_INPUT_GRADIENT, GEMM_WEIGHT_GRADIENT = "gemm.forward", "gemm.input_gradient", "gemm.weight_gradient"
ATTENTION_FORWARD, ATTENTION_BACKWARD = "attention.forward", "attention.backward"
EXPERTS_FORWARD, EXPERTS_BACKWARD = "experts.forward", "experts.backward"
ELEMENTWISE_FORWARD, ELEMENTWISE_BACKWARD = "elementwise.forward", "elementwise.backward"
ELEMENTWISE_KINDS = (ELEMENTWISE_FORWARD, ELEMENTWISE_BACKWARD)
FORWARD_KINDS = (GEMM_FORWARD, ATTENTION_FORWARD, EXPERTS_FORWARD, ELEMENTWISE_FORWARD)
# What each recomputation runs again in the backward.
RECOMPUTED = {"none": (), "full": FORWARD_KINDS, "selective": (GEMM_FORWARD, EXPERTS_FORWARD, ELEMENTWISE_FORWARD),
              "pointwise": (ELEMENTWISE_FORWARD,)}


@dataclass(frozen=True)
class Kernel:
    """Calls of one kernel in a micro-batch: ``kind``, ``dims`` (the module's rules: gemm (m, n, k), attention
    (sequence, head dim), experts (experts, tokens per expert, hidden, ffn), elementwise (elements of one
    activation)) and ``work``, all the calls' FLOPs (bytes for the elementwise kinds)."""

    kind: str
    dims: tuple[float, ...]
    work: float


def measured_kind(kind: str) -> str:
    """The kind of the table's points that price a ``kind`` kernel: itself, but the elementwise kinds share one
    measured bandwidth."""
    return ELEMENTWISE_FORWARD if kind in ELEMENTWISE_KINDS else kind


def gemms(m: float, n: int, k: int, calls: float = 1) -> list[Kernel]:
    """The three GEMMs of ``calls`` calls of a linear of ``k`` input and ``n`` output features on ``m`` tokens."""
    flops = 2.0 * m * n * k * calls
    return [Kernel(GEMM_FORWARD, (m, n, k), flops), Kernel(GEMM_INPUT_GRADIENT, (m, k, n), flops),
            Kernel(GEMM_WEIGHT_GRADIENT, (n, k, m), flops)]


def elementwise_bytes(residual: float, hidden: int, q: int, kv: int, gated: int, assignments: int,
                      value_bytes: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token of one decoder layer's elementwise work, compiled (the compiler fuses
    each residual add into the norm after it), with the widths on the rank: ``residual`` the residual stream's
    features per token (hidden, or hidden / tp split over the sequence by sequence parallelism), ``q`` and ``kv`` the
    query and the key (= value) features of the attention, ``gated`` the ffn of the dense gated MLP (0 with experts,
    whose activation is timed with them), ``assignments`` the experts each token is routed to (0 without); in units of
    ``value_bytes`` (the model dtype's), per token:

    - forward: the input norm reads and writes the residual (2·residual); RoPE reads and writes q and k, v is copied
      (2·(q + 2kv)); the residual add with the second norm reads two and writes two (4·residual); the gated
      activation reads 2·gated and writes gated (3·gated); the last residual add (3·residual): 9·residual +
      2·(q + 2kv) + 3·gated;
    - backward: each norm reads its input and the gradient and writes one (3·residual, twice), each residual sums two
      gradients (3·residual, twice), RoPE's gradient reads and writes q and k and the q|k|v gradient is assembled
      (2·(q + 2kv)), the gated activation reads its input and the gradient and writes two (5·gated): 12·residual +
      2·(q + 2kv) + 5·gated;
    - with experts, each direction adds 8·hidden per assignment: the token copies, the permutation to the experts
      and back, the combine weights and the sum (read and write each).
    """
    routing = 8 * hidden * assignments
    forward = 9 * residual + 2 * (q + 2 * kv) + 3 * gated + routing
    backward = 12 * residual + 2 * (q + 2 * kv) + 5 * gated + routing
    return float(forward * value_bytes), float(backward * value_bytes)


def head_elementwise_bytes(tokens: int, residual: float, hidden: int, vocab: int, chunks: int, value_bytes: int
                           ) -> tuple[float, float]:
    """(forward, backward) HBM bytes of the final norm and the fused loss (``parallel/linear_cross_entropy.py``) over a
    micro-batch's ``tokens`` in ``chunks`` chunks, ``vocab`` the head's rows on the rank, ``residual`` as for
    ``elementwise_bytes``: per token, in the model dtype, forward the norm (2·residual) and the logits read for their
    statistics and again to write their gradient (3·vocab: the fused loss computes the gradients in the forward),
    backward the norm's (3·residual) and the scaling of the saved input gradient (2·hidden); per chunk, the weight
    gradient's fp32 sum read and written (8 bytes per element of the head). The embedding's lookup and its gradient's
    sum are not counted (under 1% of a layer's)."""
    forward = tokens * (2 * residual + 3 * vocab) * value_bytes + chunks * 8 * vocab * hidden
    return float(forward), float(tokens * (3 * residual + 2 * hidden) * value_bytes)


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features on the rank of a module that multiplies by a weight matrix, else None."""
    if isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
        out, inputs = module.weight.shape
        return inputs, out
    return None


def _residual(layout: Layout, hidden: int) -> float:
    """The residual stream's features per token of the micro-batch on a rank: 1/tp of them under sequence
    parallelism (each rank holds 1/tp of the tokens)."""
    return hidden / layout.tp if layout.sequence_parallel else hidden


def _layer_kernels(config: Config, layout: Layout, layer: nn.Module, keys: float) -> list[Kernel]:
    """A decoder layer's kernels in one micro-batch, without recomputation (the module's rules)."""
    model_config, tokens = config.model.model_config, layout.rank_tokens
    hidden, value_bytes = model_config.hidden_size, config.model.torch_dtype().itemsize
    kernels: list[Kernel] = []
    q = kv = gated = assignments = 0
    for name, module in layer.named_modules():
        shape = _linear_shape(module)
        if shape is not None:
            kernels += gemms(tokens, shape[1], shape[0])
            if name.endswith("gate_up_proj"):
                gated += shape[1] // 2
        elif isinstance(module, GroupedExperts):
            experts, double_ffn, _ = module.gate_up_proj.shape
            moe = model_config.moe
            routed = not name.endswith("shared_expert")
            per_expert = tokens * moe.top_k * layout.ep / moe.num_experts if routed else tokens
            assignments += moe.top_k if routed else 0
            dims = (experts, per_expert, hidden, double_ffn // 2)
            flops = 6.0 * math.prod(dims)
            kernels += [Kernel(EXPERTS_FORWARD, dims, flops), Kernel(EXPERTS_BACKWARD, dims, 2 * flops)]
        elif isinstance(module, AttentionCore):
            head_dim = model_config.head_dim
            q = model_config.num_attention_heads * head_dim // layout.tp
            kv = max(model_config.num_key_value_heads // layout.tp, 1) * head_dim
            value_dim = getattr(model_config, "v_head_dim", head_dim)
            forward = 2.0 * tokens * keys * (q // head_dim) * (head_dim + value_dim)  # scores and weighted sum
            dims = (layout.sequence_length, head_dim)
            kernels += [Kernel(ATTENTION_FORWARD, dims, forward), Kernel(ATTENTION_BACKWARD, dims, 2 * forward)]
    forward, backward = elementwise_bytes(_residual(layout, hidden), hidden, q, kv, gated, assignments, value_bytes)
    activation = (tokens * hidden,)
    return kernels + [Kernel(ELEMENTWISE_FORWARD, activation, forward * tokens),
                      Kernel(ELEMENTWISE_BACKWARD, activation, backward * tokens)]


def _head_kernels(config: Config, layout: Layout, model: nn.Module) -> list[Kernel]:
    """The final norm, LM head and loss of one micro-batch: the head's GEMMs per chunk of the fused loss (one chunk
    of every token without it) and their elementwise work."""
    tokens = layout.rank_tokens
    chunk = min(config.model.loss_chunk_tokens or tokens, tokens)
    inputs, vocab = _linear_shape(model.lm_head)
    whole, rest = divmod(tokens, chunk)
    kernels = gemms(chunk, vocab, inputs, whole) + (gemms(rest, vocab, inputs) if rest else [])
    forward, backward = head_elementwise_bytes(tokens, _residual(layout, inputs), inputs, vocab, whole + (rest > 0),
                                               config.model.torch_dtype().itemsize)
    activation = (tokens * config.model.model_config.hidden_size,)
    return kernels + [Kernel(ELEMENTWISE_FORWARD, activation, forward),
                      Kernel(ELEMENTWISE_BACKWARD, activation, backward)]


def micro_batch_kernels(config: Config, layout: Layout, layers: Iterable[int], head: bool) -> list[Kernel]:
    """The kernels of one micro-batch on a rank of ``layout`` holding decoder ``layers`` (and, with ``head``, the
    final norm, the LM head and the loss), recomputation's extra forwards included."""
    model = rank_model(config, layout)
    model_config = config.model.model_config
    costs = spec_for_config(model_config).costs(model_config, model_config.vocab_size, layout.sequence_length)
    windows = costs.attention_windows or (None,) * len(costs.layer_flops)
    kernels = [k for index in layers for k in _layer_kernels(
        config, layout, model.layers[str(index)], attended_keys(windows[index], layout.sequence_length))]
    again = RECOMPUTED[config.parallelism.recompute]
    kernels += [k for k in kernels if k.kind in again]
    return kernels + (_head_kernels(config, layout, model) if head else [])


# --- the table -----------------------------------------------------------------------------------------------------


def corners(dims: Sequence[float]) -> list[tuple[int, ...]]:
    """The measured points that price ``dims``: every combination of the powers of two at or around each dim."""
    around = [sorted({2 ** math.floor(math.log2(d)), 2 ** math.ceil(math.log2(d))}) for d in dims]
    return list(product(*around))


@dataclass(frozen=True)
class KernelTable:
    """Measured kernel speeds on one GPU: ``points[kind][dims]`` is work per second (the module's rules)."""

    gpu: str
    attention: str  # the attention backend measured: torch | fa4
    points: dict[str, dict[tuple[int, ...], float]]
    source: str  # where the table was read from

    @classmethod
    def read(cls, path: Path) -> KernelTable:
        data = json.loads(Path(path).read_text())
        points: dict[str, dict[tuple[int, ...], float]] = {}
        for entry in data["entries"]:
            points.setdefault(entry["kind"], {})[tuple(entry["dims"])] = entry["work"] / entry["seconds"]
        return cls(data["gpu"], data["attention"], points, Path(path).name)

    def speed(self, kind: str, dims: Sequence[float]) -> float:
        """Work per second of a ``kind`` kernel at ``dims``: the point's own where it was measured, else log-linear
        between the points around it, else the nearest point's (the module's rules)."""
        measured = self.points[measured_kind(kind)]
        if tuple(dims) in measured:
            return measured[tuple(dims)]
        around = corners(dims)
        if not all(point in measured for point in around):
            nearest = min(measured, key=lambda p: sum(abs(math.log2(d / q)) for d, q in zip(dims, p, strict=True)))
            return measured[nearest]
        log_speed = 0.0
        for point in around:
            weight = 1.0
            for d, p in zip(dims, point, strict=True):
                low = 2 ** math.floor(math.log2(d))
                if low != 2 ** math.ceil(math.log2(d)):  # between low and 2·low: one unit of log2
                    above = math.log2(d / low)
                    weight *= above if p != low else 1 - above
            log_speed += weight * math.log(measured[point])
        return math.exp(log_speed)

    def grid_only(self) -> KernelTable:
        """This table without the points whose dims are not all powers of two (what prices a shape the recorder was
        not given)."""
        grid = {kind: {dims: speed for dims, speed in points.items() if all(d & (d - 1) == 0 for d in dims)}
                for kind, points in self.points.items()}
        return KernelTable(self.gpu, self.attention, grid, f"{self.source}, power-of-two points")

    def seconds(self, kernels: Iterable[Kernel]) -> float:
        return sum(k.work / self.speed(k.kind, k.dims) for k in kernels)

    def micro_batch(self, config: Config, layout: Layout, layers: Sequence[int], head: bool) -> tuple[float, float]:
        """(compute, attention) seconds of one micro-batch on a rank holding ``layers`` (and the head)."""
        kernels = micro_batch_kernels(config, layout, layers, head)
        attention = [k for k in kernels if k.kind in (ATTENTION_FORWARD, ATTENTION_BACKWARD)]
        return self.seconds(kernels), self.seconds(attention)

    def refusal(self, config: Config) -> str | None:
        """Why this table does not price ``config`` (None: it does)."""
        if config.fp8 is not None and config.fp8.enabled:
            return "FP8 linears are not in the kernel table"
        model_config = config.model.model_config
        if not model_config.attention:
            return "the table holds no kernels of a family without attention (Mamba's scan)"
        needed = [GEMM_FORWARD, GEMM_INPUT_GRADIENT, GEMM_WEIGHT_GRADIENT, ATTENTION_FORWARD, ATTENTION_BACKWARD,
                  ELEMENTWISE_FORWARD] + ([EXPERTS_FORWARD, EXPERTS_BACKWARD] if model_config.moe is not None else [])
        missing = [kind for kind in needed if not self.points.get(kind)]
        return f"the table has no {', '.join(missing)} points" if missing else None


@functools.cache
def committed_table(name: str) -> KernelTable | None:
    """The kernel table committed for GPU preset ``name`` (``kernel_tables/<name>.json``), None if there is none."""
    path = TABLES / f"{name}.json"
    return KernelTable.read(path) if path.exists() else None

