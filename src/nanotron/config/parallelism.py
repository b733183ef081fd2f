"""How the run is split over processes: the ``parallelism`` section, and whether a launch has its world size."""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

from nanotron.config.rules import Spellings, at_least, canonical_spellings, positive

# nanotron matched these enum names case-insensitively; one spelling is stored so that equal configs compare equal.
# The pipeline schedules (``pipeline_schedules.py``) also take torchtitan's names (its ``pipeline_parallel_schedule``).
PipelineEngine = Annotated[
    Literal["afab", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"],
    Spellings(fold=str.lower, aliases={"gpipe": "afab", "interleaved1f1b": "interleaved_1f1b",
                                       "interleavedzerobubble": "zb_h1", "zbvzerobubble": "zbv"}),
]
TensorParallelMode = Annotated[Literal["ALL_REDUCE", "REDUCE_SCATTER"], Spellings(fold=str.upper)]
# What each decoder layer keeps for the backward and runs again there, and what that costs. The setting's three
# consequences, one per value:
#   value      keeps (memory planner: a family's ``layer_activations``)  reruns in the backward (``nn/recompute.py``)
#              extra FLOPs counted (``ModelCosts.hardware_flops_per_token``)
#   none       every activation                                          nothing; none
#   full       its input                                                 the whole layer; a third of its FLOPs
#   selective  its input and its attention kernels' outputs              all but attention; a third of all but
#                                                                        attention's
#   pointwise  its input, its attention kernels' and matmuls' outputs    only elementwise ops; none (their FLOPs are
#                                                                        uncounted anyway)
# Upstream's recompute_layer (a bool) with Megatron-LM's recompute_granularity (full, selective) is translated to it
# (``upstream.py``).
Recompute = Annotated[Literal["none", "full", "selective", "pointwise"], Spellings(fold=str.lower)]


@dataclass
class ParallelismArgs:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1  # ranks each sequence is split over (parallel/context_parallel.py)
    dp_shard: int | None = None  # HSDP: ZeRO shards over groups of this many dp ranks, replicated over dp / dp_shard
    pp_engine: PipelineEngine = "1f1b"
    virtual_pipeline_size: int = 1  # model chunks per pipeline stage (virtual stages; interleaved_1f1b, zbv: 2)
    tp_mode: TensorParallelMode = "ALL_REDUCE"
    tp_linear_async_communication: bool = False
    # the partial sums the TP ranks add up (row-parallel outputs, column-parallel input gradients) made and summed in
    # fp32, rounded once as at tp=1 (parallel/tensor_parallel.py); twice the bytes of those collectives
    tp_partial_sums_in_fp32: bool = False
    pp_stage_layers: list[int] | None = None  # decoder layers per chunk, in model order; None: balanced by cost
    pp_timeout_s: float = 600.0  # a pipeline exchange waiting longer than this fails, naming the stage and step
    replica_check_interval: int | None = 100  # steps between weight checksums across data-parallel replicas
    recompute: Recompute = "none"  # what each decoder layer rebuilds in the backward (``Recompute``)

    def __post_init__(self) -> None:
        canonical_spellings(self)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.expert_parallel_size * self.context_parallel_size

    def problems(self) -> Iterator[str]:
        for name in ("dp", "pp", "tp", "expert_parallel_size", "context_parallel_size"):
            yield from at_least(f"parallelism.{name}", getattr(self, name), 1)
        if self.dp_shard is not None and (self.dp_shard < 2 or self.dp % self.dp_shard):
            yield (f"parallelism.dp_shard ({self.dp_shard}) must divide parallelism.dp ({self.dp}) and be at least 2: "
                   "ZeRO shards over groups of dp_shard data-parallel ranks, replicated over dp / dp_shard groups; "
                   f"pick a divisor of {self.dp} or remove it (null: shard over all of dp)")
        if self.tp_linear_async_communication and self.tp_mode == "ALL_REDUCE":
            yield (
                "parallelism.tp_linear_async_communication: true needs parallelism.tp_mode: REDUCE_SCATTER "
                "(only that mode overlaps communication with compute); change one of them"
            )
        yield from positive("parallelism.pp_timeout_s", self.pp_timeout_s)
        if self.replica_check_interval is not None:
            yield from at_least("parallelism.replica_check_interval", self.replica_check_interval, 1)
        chunks = self.pp * self.virtual_pipeline_size
        if self.pp_stage_layers is not None and len(self.pp_stage_layers) != chunks:
            yield (
                f"parallelism.pp_stage_layers has {len(self.pp_stage_layers)} entries but parallelism.pp x "
                f"virtual_pipeline_size is {chunks}: give one layer count per model chunk, in model order"
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
