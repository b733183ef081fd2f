"""The layouts of a GPU count, ranked by predicted tokens/s per GPU among those that fit in memory.

Enumerated: every dp × tp × pp × cp × ep of the GPU count with tp within a node and dividing the attention heads,
pp at most the layers, cp only for families that split sequences (and sequences it cuts evenly), ep only for a
mixture of experts (dividing its experts), sequence parallelism at tp > 1; ZeRO stages 0 to 3 (over replicas
only) and, with several stages, the schedules of ``pipeline_schedules.py`` with the fewest model chunks each runs
(2 for ``interleaved_1f1b`` and ``zbv``). The global batch stays the config's (or ``global_batch``): a layout whose
sample shards do not divide it is left out, the micro-batch shrinks where a shard reads fewer sequences than it.

Memory is checked with the memory planner (``memory.estimate_memory``), fastest layout first, until ``top`` fit;
a layout whose weights and optimizer state alone exceed the GPU is dropped before.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from nanotron.config import Config, ConfigError
from nanotron.layout import Group, Layout
from nanotron.memory import GB, estimate_memory
from nanotron.models.registry import spec_for_config
from nanotron.pipeline_schedules import SCHEDULES
from nanotron.planning.cluster import Cluster
from nanotron.planning.collectives import with_layout
from nanotron.planning.step_time import StepTime, predict

LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero", "schedule", "mbs")


@dataclass(frozen=True)
class Candidate:
    time: StepTime
    memory_gb: float  # the largest stage's device memory

    @property
    def layout(self) -> Layout:
        return self.time.layout


def parse_layout(text: str, config: Config, global_batch: int) -> Layout:
    """``--layout dp=8,tp=1,...`` (keys of ``LAYOUT_KEYS``; the others as one GPU's: 1, ZeRO 0, 1F1B) for
    ``config``, at ``global_batch`` sequences per step."""
    values: dict[str, str] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key.strip() not in LAYOUT_KEYS or not value.strip():
            raise ConfigError(f"--layout {text!r}: {part!r} is not KEY=VALUE with KEY one of {', '.join(LAYOUT_KEYS)}")
        values[key.strip()] = value.strip()
    schedule = values.pop("schedule", "1f1b")
    if schedule not in SCHEDULES:
        raise ConfigError(f"--layout schedule={schedule} is not a schedule the planner knows: {', '.join(SCHEDULES)}")
    try:
        sizes = {key: int(value) for key, value in values.items()}
    except ValueError:
        raise ConfigError(f"--layout {text!r}: sizes must be whole numbers") from None
    if any(size < 1 for key, size in sizes.items() if key != "zero") or not 0 <= sizes.get("zero", 0) <= 3:
        raise ConfigError(f"--layout {text!r}: sizes must be at least 1 and zero 0 to 3")
    layout = _layout(config, global_batch, sizes.get("dp", 1), sizes.get("tp", 1), sizes.get("pp", 1),
                     sizes.get("cp", 1), sizes.get("ep", 1), sizes.get("zero", 0), schedule, sizes.get("mbs"))
    if layout is None:
        raise ConfigError(f"--layout {text!r} cannot run {global_batch} sequences per step: dp x ep must divide "
                          "the global batch (--global-batch-size), and the micro-batch size (mbs) the sequences a "
                          "shard reads")
    problem = next(iter(problems(config, layout)), None)
    if problem is not None:
        raise ConfigError(f"--layout {text!r}: {problem}")
    return layout


def _layout(config: Config, global_batch: int, dp: int, tp: int, pp: int, cp: int, ep: int, zero: int, schedule: str,
            micro_batch_size: int | None = None) -> Layout | None:
    """The layout of these sizes running ``global_batch`` sequences a step (None: it cannot)."""
    shards = dp * ep
    if global_batch % shards:
        return None
    per_shard = global_batch // shards
    size = micro_batch_size or min(config.tokens.micro_batch_size, per_shard)
    if per_shard % size:
        return None
    return replace(Layout.from_config(config), dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero,
                   pp_engine=schedule, virtual=SCHEDULES[schedule].fewest_chunks() if pp > 1 else 1,
                   sequence_parallel=tp > 1, overlapped_linears=False, micro_batch_size=size,
                   accumulation=per_shard // size)


def problems(config: Config, layout: Layout) -> Iterator[str]:
    """Why ``config`` cannot run split as ``layout`` (the sizes' rules; the config's own rules decide the rest)."""
    model_config = config.model.model_config
    heads = getattr(model_config, "num_attention_heads", None)
    if heads is not None and heads % layout.tp:
        yield f"tp={layout.tp} does not divide the {heads} attention heads"
    costs = spec_for_config(model_config).costs(model_config, model_config.vocab_size, layout.sequence_length)
    if layout.chunks > len(costs.layer_flops):
        yield f"pp={layout.pp} makes {layout.chunks} model chunks, more than the {len(costs.layer_flops)} layers"
    if layout.cp > 1 and model_config.context_parallel_refusal() is not None:
        yield model_config.context_parallel_refusal()
    moe = model_config.moe
    if layout.ep > 1 and (moe is None or moe.num_experts % layout.ep):
        yield f"ep={layout.ep} needs a mixture of experts whose experts it divides"
    if layout.zero_stage and layout.size(Group.DENSE_REPLICAS) == 1:
        yield f"zero={layout.zero_stage} needs data-parallel replicas (dp x cp x ep > 1)"
    yield from layout.problems()


def layouts(config: Config, gpus: int, gpus_per_node: int, global_batch: int) -> Iterator[Layout]:
    """Every layout of ``gpus`` the module's rules allow."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp in (d for d in divisors if d <= gpus_per_node):
        for pp in (d for d in divisors if (gpus // tp) % d == 0):
            for cp in (d for d in divisors if (gpus // (tp * pp)) % d == 0):
                for ep in (d for d in divisors if (gpus // (tp * pp * cp)) % d == 0):
                    dp = gpus // (tp * pp * cp * ep)
                    schedules = [s for s in SCHEDULES if s != "afab"] if pp > 1 else ["1f1b"]
                    for zero in range(4 if dp * cp * ep > 1 else 1):
                        for schedule in schedules:
                            layout = _layout(config, global_batch, dp, tp, pp, cp, ep, zero, schedule)
                            if layout is not None and not any(problems(config, layout)):
                                yield layout


def candidate(config: Config, time: StepTime, gpu_memory_gb: float) -> Candidate:
    """``time``'s layout with its memory per GPU (the largest stage's, as the memory planner estimates it)."""
    layout = time.layout
    estimate = estimate_memory(with_layout(config, layout), gpu_memory_gb)
    return Candidate(time, max(stage.total for stage in estimate.stages) / GB)


def ranked(config: Config, gpus: int, cluster: Cluster, top: int, global_batch: int) -> list[Candidate]:
    """The ``top`` fastest layouts of ``gpus`` that fit in the cluster's GPU memory."""
    times = sorted((predict(config, layout, cluster) for layout in layouts(config, gpus, cluster.gpus_per_node,
                                                                           global_batch)
                    if _state_bytes(config, layout) <= cluster.gpu.memory_gb * GB),
                   key=lambda time: time.step)
    fitting = []
    for time in times:
        found = candidate(config, time, cluster.gpu.memory_gb)
        if found.memory_gb <= cluster.gpu.memory_gb:
            fitting.append(found)
            if len(fitting) == top:
                break
    return fitting


def _state_bytes(config: Config, layout: Layout) -> float:
    """A lower bound of a rank's memory: its weights in the model dtype and, per element of its optimizer shard, an
    fp32 master and two fp32 moments less what remainders and narrower moments save (at least 8 bytes)."""
    model_config = config.model.model_config
    parameters = spec_for_config(model_config).costs(model_config, model_config.vocab_size,
                                                     layout.sequence_length).parameters
    held = parameters / (layout.tp * layout.pp * (layout.ep if model_config.moe is not None else 1))
    shards = layout.size(Group.DENSE_REPLICAS) if layout.zero_stage else 1
    weight = config.model.torch_dtype().itemsize / (shards if layout.zero_stage == 3 else 1)
    return held * (weight + 8 / shards)


def table(candidates: list[Candidate], description: str) -> str:
    """The ranking ``nanotron estimate`` prints."""
    header = ["#", "dp", "tp", "pp", "cp", "ep", "zero", "schedule", "mbs x acc", "step s", "compute",
              "exposed comm", "bubble", "tokens/s/GPU", "memory GB"]
    rows = [header]
    for index, c in enumerate(candidates, 1):
        layout, time = c.layout, c.time
        rows.append([str(index), *(str(getattr(layout, key)) for key in ("dp", "tp", "pp", "cp", "ep")),
                     str(layout.zero_stage), layout.schedule if layout.pp > 1 else "-",
                     f"{layout.micro_batch_size} x {layout.accumulation}", f"{time.step:.3f}",
                     f"{time.compute:.3f}", f"{time.communication:.3f}", f"{time.bubble:.3f}",
                     f"{time.tokens_per_second_per_gpu:,.0f}", f"{c.memory_gb:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.rjust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    legend = ("seconds per step: compute (the slowest stage's forwards and backwards, and the update) + exposed "
              "communication + the pipeline's bubble; predictions (docs/planning.md)")
    return "\n".join([description, *lines, legend])
