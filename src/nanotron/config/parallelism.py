"""How the run is split over processes: the ``parallelism`` section, and whether a launch has its world size."""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

from nanotron.config.rules import Spellings, at_least, canonical_spellings, positive

# nanotron matched these enum names case-insensitively; one spelling is stored so that equal configs compare equal.
PipelineEngine = Annotated[Literal["afab", "1f1b"], Spellings(fold=str.lower)]
TensorParallelMode = Annotated[Literal["ALL_REDUCE", "REDUCE_SCATTER"], Spellings(fold=str.upper)]
# Megatron-LM's names (upstream nanotron's RecomputeGranularity enum spells them in capitals), and nanotron's
# ``pointwise``.
RecomputeGranularity = Annotated[Literal["full", "selective", "pointwise"], Spellings(fold=str.lower)]


@dataclass
class ParallelismArgs:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1  # ranks each sequence is split over (parallel/context_parallel.py)
    pp_engine: PipelineEngine = "1f1b"
    tp_mode: TensorParallelMode = "ALL_REDUCE"
    tp_linear_async_communication: bool = False
    pp_stage_layers: list[int] | None = None  # decoder layers per stage; None: balanced by estimated cost
    pp_timeout_s: float = 600.0  # a pipeline exchange waiting longer than this fails, naming the stage and step
    replica_check_interval: int | None = 100  # steps between weight checksums across data-parallel replicas
    # Recompute each decoder layer's activations in backward (saves memory, ~1/3 more layer FLOPs).
    recompute_layer: bool = False
    # With recompute_layer, what the backward rebuilds (nn/recompute.py): the whole layer (full), all but the
    # attention kernels' outputs, which are kept (selective: ~6% more layer FLOPs at long sequences instead of ~1/3),
    # or all but the matmuls' and attention kernels' outputs (pointwise: only elementwise ops rerun).
    recompute_granularity: RecomputeGranularity = "full"

    def __post_init__(self) -> None:
        canonical_spellings(self)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.expert_parallel_size * self.context_parallel_size

    def problems(self) -> Iterator[str]:
        for name in ("dp", "pp", "tp", "expert_parallel_size", "context_parallel_size"):
            yield from at_least(f"parallelism.{name}", getattr(self, name), 1)
        if self.tp_linear_async_communication and self.tp_mode == "ALL_REDUCE":
            yield (
                "parallelism.tp_linear_async_communication: true needs parallelism.tp_mode: REDUCE_SCATTER "
                "(only that mode overlaps communication with compute); change one of them"
            )
        if self.recompute_granularity != "full" and not self.recompute_layer:
            yield (
                f"parallelism.recompute_granularity: {self.recompute_granularity} takes effect only with "
                "parallelism.recompute_layer: true; set recompute_layer to true, or remove recompute_granularity"
            )
        yield from positive("parallelism.pp_timeout_s", self.pp_timeout_s)
        if self.replica_check_interval is not None:
            yield from at_least("parallelism.replica_check_interval", self.replica_check_interval, 1)
        if self.pp_stage_layers is not None and len(self.pp_stage_layers) != self.pp:
            yield (
                f"parallelism.pp_stage_layers has {len(self.pp_stage_layers)} entries but parallelism.pp is "
                f"{self.pp}: give one layer count per pipeline stage"
            )
        if self.pp_stage_layers is not None and any(count < 1 for count in self.pp_stage_layers):
            yield f"parallelism.pp_stage_layers {self.pp_stage_layers}: every stage needs at least one decoder layer"

    def world_size_problems(self, world_size: int) -> Iterator[str]:
        """Whether ``world_size`` launched processes are the ones this layout needs."""
        if self.world_size != world_size:
            yield (
                f"parallelism.dp ({self.dp}) * parallelism.pp ({self.pp}) * parallelism.tp ({self.tp}) * "
                f"parallelism.expert_parallel_size ({self.expert_parallel_size}) * parallelism.context_parallel_size "
                f"({self.context_parallel_size}) = {self.world_size}, but "
                f"{world_size} processes were launched; make the product equal the number of processes "
                "(`torchrun --nproc_per_node` times the number of nodes)"
            )
