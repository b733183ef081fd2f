"""A cluster as the planner sees it: the GPU (peak bf16 FLOP/s, memory and its bandwidth) and the links between GPUs,
and the α–β time of each collective over them.

A collective's group runs inside a node (NVLink) when all its ranks sit on one node, given ``gpus_per_node`` and the
layout's rank order (tensor parallelism innermost, then cp, ep, dp, pp outermost: ``layout.py``); otherwise over
InfiniBand, whose bandwidth per GPU then limits the whole ring. Ring algorithms, with ``n`` ranks, ``S`` bytes (as
``collectives.Collective`` counts them), ``β`` the link's bus bandwidth and ``α`` its latency per step:

| kind                       | time                          |
| -------------------------- | ----------------------------- |
| all-reduce                 | 2(n − 1)/n · S/β + 2(n − 1)·α |
| all-gather, reduce-scatter | (n − 1)/n · S/β + (n − 1)·α   |
| all-to-all                 | (n − 1)/n · S/β + (n − 1)·α   |
| send/recv                  | S/β + α                       |

The presets' link figures are effective bus bandwidths, below the data sheets' (assumed, not measured here):
NVLink 4 carries 450 GB/s per direction per GPU (NVIDIA's H100 and H200 SXM data sheets), of which NCCL's ring
all-reduce reaches about 360 GB/s of bus bandwidth on 8-GPU nodes (nccl-tests on DGX H100, as published); each GPU
has its own 400 Gb/s InfiniBand NIC (50 GB/s), of which about 45 GB/s are reached. Latencies are those of NCCL's
ring steps: about 5 µs inside a node and 10 µs across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanotron.layout import Layout
from nanotron.planning.collectives import ALL_REDUCE, SEND, Collective, group_members, group_size

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float  # dense bf16
    memory_gb: float  # what torch reports as total_memory, in 1e9 bytes (the memory planner's budget)
    memory_tb_s: float  # HBM bandwidth
    table: str  # its kernel table's name under planning/kernel_tables/, and the preset's


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8
    intra_gb_s: float = 360.0  # NVLink bus bandwidth a collective reaches inside a node
    inter_gb_s: float = 45.0  # InfiniBand bandwidth per GPU a collective reaches across nodes
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0

    def spans_nodes(self, layout: Layout, group: str) -> bool:
        """Whether world rank 0's ``group`` holds ranks of several nodes."""
        return len({rank // self.gpus_per_node for rank in group_members(layout, group)}) > 1

    def seconds(self, collective: Collective, layout: Layout) -> float:
        """The time of all of ``collective``'s calls in a step (the module's table)."""
        n = group_size(layout, collective.group)
        if n == 1:
            return 0.0
        inter = self.spans_nodes(layout, collective.group)
        bandwidth = (self.inter_gb_s if inter else self.intra_gb_s) * GB
        latency = (self.inter_latency_us if inter else self.intra_latency_us) * 1e-6
        if collective.kind == SEND:
            one = collective.bytes / bandwidth + latency
        else:
            rounds = 2 if collective.kind == ALL_REDUCE else 1
            one = rounds * ((n - 1) / n * collective.bytes / bandwidth + (n - 1) * latency)
        return one * collective.count


H100 = GPU("H100 SXM 80GB", peak_tflops=989.0, memory_gb=85.0, memory_tb_s=3.35, table="h100")
H200 = GPU("H200 SXM 141GB", peak_tflops=989.0, memory_gb=150.1, memory_tb_s=4.8, table="h200")
CLUSTERS = {"h100": Cluster(H100), "h200": Cluster(H200)}
