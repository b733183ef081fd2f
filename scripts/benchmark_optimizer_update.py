"""The optimizer step of a bf16 model on one CUDA device: masters as fp32 copies or as remainders, fp32 or bf16 moments.

    python scripts/benchmark_optimizer_update.py --output optimizer_update.json

The real ``MixedPrecisionAdamW.step`` (``optim/optimizer.py``: one compiled update per gradient bucket, the clipping
factor applied as it reads the gradient) over the mixtral preset's parameters in bf16 (the shapes of
``benchmark_gradient_passes.py``), with bf16 gradient buffers, as a run of one micro-batch per step on one GPU has
them. Reported per setting: the median step time (ms, CUDA events), the bytes an update reads and writes per
parameter, their bandwidth, and the optimizer state's bytes per parameter (masters beyond the weights, and moments).
"""

from __future__ import annotations

import gc
import json

import torch
import torch.distributed as dist
from benchmark_gradient_passes import SHAPES
from benchmark_record import kernel_parser, kernel_record, median_cuda_ms
from torch import nn

from nanotron.config import LRSchedulerArgs, OptimizerArgs
from nanotron.optim.optimizer import build_optimizer
from nanotron.parallel.placement import annotate_placements

BUCKET_MB = 25.0  # model.ddp_bucket_cap_mb's default


def moved_bytes_per_parameter(remainders: bool, moment_bytes: int) -> int:
    """Read: gradient (2), both moments, the masters (weights and remainders, or the fp32 copy); written: both
    moments, the weights, and the remainders or the fp32 copy."""
    masters = 2 + 2 + 2 + 2 if remainders else 4 + 4 + 2
    return 2 + 4 * moment_bytes + masters


def step_ms(remainders: bool, moments: str, group, repeats: int) -> float:
    holder = nn.Module()
    for index, shape in enumerate(SHAPES):
        holder.register_parameter(f"p{index}", nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16)))
    annotate_placements(holder)
    args = OptimizerArgs(learning_rate_scheduler=LRSchedulerArgs(learning_rate=1e-4), weight_decay=0.1,
                         adam_moments_dtype=moments, store_param_remainders=remainders)
    params = dict(holder.named_parameters())
    buckets, optimizer = build_optimizer(params, args, BUCKET_MB, {("dp", "cp", "ep"): group},
                                         single_micro_batch=True)
    for bucket in buckets.buckets:
        bucket.grads.normal_()
    multiplier = torch.tensor(0.5, device=optimizer.device)
    return median_cuda_ms(lambda: optimizer.step(1e-4, multiplier), repeats)


def main() -> None:
    parser = kernel_parser(__doc__, repeats=10)
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a one-rank data-parallel group
    elements = sum(torch.Size(shape).numel() for shape in SHAPES)
    results = []
    for moments, moment_bytes in (("float32", 4), ("bfloat16", 2)):
        for remainders in (False, True):
            ms = step_ms(remainders, moments, dist.group.WORLD, args.repeats)
            gc.collect()
            torch.cuda.empty_cache()
            moved = moved_bytes_per_parameter(remainders, moment_bytes)
            masters = "remainders" if remainders else "fp32 copies"
            state = (2 if remainders else 4) + 2 * moment_bytes
            print(f"masters {masters:11s} moments {moments:8s} {ms:6.2f} ms  {moved} B/param  "
                  f"{elements * moved / ms / 1e9:5.2f} TB/s  state {state} B/param", flush=True)
            results.append({"masters": masters, "moments": moments, "ms": ms, "bytes_moved_per_parameter": moved,
                            "tb_per_s": elements * moved / ms / 1e9, "state_bytes_per_parameter": state})
    if args.output:
        record = kernel_record("optimizer-update", args.commit, results, parameters=elements)
        args.output.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
