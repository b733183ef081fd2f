"""A training step's time on a cluster: compute, exposed communication, the pipeline's bubble and the update.

Rules (docs/planning.md says why):

- **compute**: a micro-batch's on a rank, from the compute model ``compute_model`` chooses: the sum of its kernels'
  times at the rank's shapes from the GPU's kernel table (``kernels.py``), or its hardware FLOPs at the effective
  speed measured for the nearest recorded shape (``efficiency.py``). The slowest pipeline stage sets the pace.
- **update**: the optimizer's pass over its shard, memory-bound: ``update_bytes`` per element at 85% of the HBM
  bandwidth.
- **communication** (``collectives.py``, timed by ``cluster.py``): tensor- and expert-parallel collectives and the
  pipeline's messages are exposed; context parallelism's exchange overlaps its attention, all but its first head
  group's share and whatever exceeds the attention's compute; the gradient reduction overlaps the last
  micro-batch's backward (two thirds of its compute) but for its last bucket; ZeRO's gather of updated shards, the
  tied copies' sum and the step's scalars are exposed.
- **bubble**: the schedule's idle share (``Schedule.idle_share``, ``pipeline_schedules.py``) of the pipelined
  micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanotron.config import Config
from nanotron.layout import Group, Layout
from nanotron.models.build import BuildOptions, pipeline_stage_layers
from nanotron.optim.param_remainders import master_element_bytes
from nanotron.parallel.data_parallel import gradient_dtype
from nanotron.planning.cluster import TB, Cluster
from nanotron.planning.collectives import stage_parameters, step_collectives, with_layout
from nanotron.planning.efficiency import Efficiency
from nanotron.planning.kernels import KernelTable, committed_table

HBM_EFFICIENCY = 0.85  # of the data sheet's bandwidth, reached by the update's multi-tensor kernels


@dataclass(frozen=True)
class StepTime:
    """One layout's predicted step on a cluster, in seconds."""

    layout: Layout
    compute: float  # the pacing stage's micro-batches and the update
    communication: float  # exposed
    bubble: float
    tokens: int  # per step, all ranks

    @property
    def step(self) -> float:
        return self.compute + self.communication + self.bubble

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens / self.step / self.layout.world_size


ComputeModel = KernelTable | Efficiency


def compute_model(config: Config, cluster: Cluster) -> ComputeModel:
    """What prices ``config``'s compute on ``cluster`` (one rule): the kernel table committed for its GPU
    (``kernels.TABLES``) where there is one and it prices the config, else ``efficiency.json``."""
    table = committed_table(cluster.gpu.table)
    if table is not None and table.refusal(config) is None:
        return table
    return Efficiency(cluster.gpu.peak_tflops)


def predict(config: Config, layout: Layout, cluster: Cluster, compute: ComputeModel | None = None) -> StepTime:
    """The step time of ``config`` split as ``layout`` on ``cluster``: the slowest stage's micro-batches, the
    schedule's bubble, then the stage that finishes last after its last backward (``compute``: the compute model,
    by default ``compute_model``'s)."""
    compute = compute or compute_model(config, cluster)
    options = BuildOptions.from_config(with_layout(config, layout))
    chunk_layers = pipeline_stage_layers(config.model.model_config, options, layout.chunks, layout.tp)
    stages = [[index for chunk in layout.chunks_of(stage) for index in chunk_layers[chunk]]
              for stage in range(layout.pp)]
    micro_batches = layout.accumulation
    busy, communication = max((_micro_batch(config, layout, cluster, stage, layers, compute)
                                  for stage, layers in enumerate(stages)), key=sum)
    pace = busy + communication
    update, after = max(((update_seconds(config, layout, cluster, stage),
                          _after_backward(config, layout, cluster, stage, busy)) for stage in range(layout.pp)),
                        key=sum)
    idle = pace * micro_batches * (layout.pipeline.idle_share() if layout.pp > 1 else 0.0)
    return StepTime(layout, busy * micro_batches + update, communication * micro_batches + after, idle,
                    layout.global_batch_size * layout.sequence_length)


def _micro_batch(config: Config, layout: Layout, cluster: Cluster, stage: int, layers: Sequence[int],
                 model: ComputeModel) -> tuple[float, float]:
    """(compute, exposed communication) of one micro-batch on a rank of ``stage`` (holding ``layers``)."""
    head = stage == layout.stage_of(layout.chunks - 1)
    seconds, attention = model.micro_batch(config, layout, layers, head=head)
    collectives = [c for c in step_collectives(config, stage, layout) if c.phase in ("forward", "backward")]
    context = [c for c in collectives if c.group == Group.CP.value]
    exchange = sum(cluster.seconds(c, layout) for c in context) / layout.accumulation
    first_group = exchange / (sum(c.count for c in context) / layout.accumulation) if context else 0.0
    exposed = sum(cluster.seconds(c, layout) for c in collectives if c not in context) / layout.accumulation
    return seconds, exposed + max(first_group, exchange - attention)


def _after_backward(config: Config, layout: Layout, cluster: Cluster, stage: int,
                    compute: float) -> float:
    """The exposed communication after a stage's last backward: the gradient reduction beyond that backward (two
    thirds of ``compute``; its last bucket always), the update's gathers and the step's scalars."""
    collectives = step_collectives(config, stage, layout)
    reduction = [cluster.seconds(c, layout) for c in collectives if c.phase == "gradients"]
    after = sum(cluster.seconds(c, layout) for c in collectives if c.phase in ("update", "step"))
    if reduction:
        after += reduction[-1] + max(0.0, sum(reduction[:-1]) - 2 / 3 * compute)
    return after


def update_bytes(config: Config, layout: Layout) -> float:
    """HBM bytes the update moves per element of the optimizer's shard: the gradient read twice (the norm, the
    update); the weight and its remainder bits read and written, or the fp32 master read and written and the weight
    written; the two moments read and written."""
    o = config.optimizer
    dtype = config.model.torch_dtype()
    replicas = layout.size(Group.DENSE_REPLICAS)
    gradient = gradient_dtype(dtype, o.accumulate_grad_in_fp32, layout.accumulation == 1, replicas, False).itemsize
    master = master_element_bytes(dtype, o.store_param_remainders)
    weights = 2 * (dtype.itemsize + master) if master < 4 else 2 * master + dtype.itemsize
    return 2 * gradient + weights + 4 * getattr(torch, o.adam_moments_dtype).itemsize


def update_seconds(config: Config, layout: Layout, cluster: Cluster, stage: int) -> float:
    """The optimizer's pass over a rank's shard of ``stage``'s parameters (1/n of each under ZeRO, n
    its replicas)."""
    elements = 0.0
    for p in stage_parameters(config, layout, stage):
        replicas = math.prod(layout.size(axis) for axis in p.gradient_axes)
        elements += p.elements / (replicas if layout.zero_stage else 1)
    return elements * update_bytes(config, layout) / (cluster.gpu.memory_tb_s * TB * HBM_EFFICIENCY)
