"""AdamW on fp32 master weights, over the flat shards of the gradient buckets (ZeRO-1 when they are sharded).

The optimizer keeps an fp32 copy ("master") of this rank's shard of every bucket and updates that copy: small
updates that would vanish when added to a bf16 weight are kept. After each step the masters are copied back into
the model's parameters (and, with ZeRO-1, all-gathered over data-parallel ranks). Without ZeRO a rank's shard is the
whole bucket; with ZeRO-1 it is 1/dp of it, so masters and Adam moments take 1/dp of the memory.

Checkpoints need state per logical parameter, not per shard: ``bucket_states`` gathers one bucket at a time over
data-parallel ranks and cuts it into parameters; ``load_bucket_states`` does the reverse.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from nanotron.config import OptimizerArgs
from nanotron.parallel.data_parallel import GradientBuckets

STATE_KINDS = ("exp_avg", "exp_avg_sq", "master")


def no_weight_decay(name: str, param: torch.Tensor, exclude_patterns: list[str] | None) -> bool:
    """Built-in rule: norms and biases (1-D tensors) and embeddings are not decayed; patterns replace the rule."""
    if exclude_patterns is not None:
        return any(re.search(pattern, name) for pattern in exclude_patterns)
    return param.dim() < 2 or "embed" in name


class MixedPrecisionAdamW:
    def __init__(self, buckets: GradientBuckets, args: OptimizerArgs):
        self.buckets = buckets
        self.args = args
        self.masters = [b.params[b.shard].detach().float().clone() for b in buckets.buckets]
        groups = [
            {"params": [m for m, b in zip(self.masters, buckets.buckets) if b.weight_decay], "weight_decay": args.weight_decay},
            {"params": [m for m, b in zip(self.masters, buckets.buckets) if not b.weight_decay], "weight_decay": 0.0},
        ]
        on_cuda = any(m.is_cuda for m in self.masters)
        self.inner = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=args.learning_rate_scheduler.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            fused=bool(args.torch_adam_is_fused and on_cuda) or None,
        )

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr
        for master, bucket in zip(self.masters, self.buckets.buckets):
            master.grad = bucket.grads[bucket.shard].float()  # a view when gradients are fp32
        self.inner.step()
        for master, bucket in zip(self.masters, self.buckets.buckets):
            master.grad = None
            bucket.params[bucket.shard].copy_(master)
        self.buckets.all_gather_params()

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Take the masters from the model's weights (after weights were loaded without optimizer state)."""
        for master, bucket in zip(self.masters, self.buckets.buckets):
            master.copy_(bucket.params[bucket.shard])

    @property
    def step_count(self) -> int:
        states = [self.inner.state[m] for m in self.masters if m in self.inner.state]
        return int(states[0]["step"]) if states else 0

    def local_state_numel(self) -> int:
        """Elements of fp32 optimizer state held by this rank (masters and both moments)."""
        return sum(m.numel() for m in self.masters) * (3 if self.step_count else 1)

    # --- checkpointing -------------------------------------------------------------------------------------------

    def _shard_state(self, index: int, kind: str) -> torch.Tensor:
        master = self.masters[index]
        return master if kind == "master" else self.inner.state[master][kind]

    def bucket_states(self) -> Iterator[dict[str, dict[str, torch.Tensor]]]:
        """Per bucket: {parameter name: {state kind: tensor of the parameter's local shape}}.

        Collective over data-parallel ranks under ZeRO-1 (the shards are all-gathered), local otherwise.
        """
        buckets = self.buckets
        kinds = STATE_KINDS if self.step_count else ("master",)
        for index, bucket in enumerate(buckets.buckets):
            full = {}
            for kind in kinds:
                shard = self._shard_state(index, kind)
                if buckets.shard_optimizer:
                    whole = torch.empty(bucket.numel, dtype=shard.dtype, device=shard.device)
                    dist.all_gather_into_tensor(whole, shard.contiguous(), group=buckets.group)
                else:
                    whole = shard
                full[kind] = whole
            yield {name: {kind: full[kind][slice(*bucket.ranges[name])].view(bucket.shapes[name]) for kind in full}
                   for name in bucket.names}

    @torch.no_grad()
    def load_bucket_states(self, read: Callable[[str, str, torch.Tensor], None], step: int) -> None:
        """Fill masters and moments; ``read(name, kind, out)`` fills ``out`` (the parameter's local shape) in fp32."""
        for index, bucket in enumerate(self.buckets.buckets):
            master = self.masters[index]
            state = {"step": torch.tensor(float(step), dtype=torch.float32,
                                          device=master.device if self.inner.defaults.get("fused") else "cpu")}
            for kind in STATE_KINDS:
                whole = torch.zeros(bucket.numel, dtype=torch.float32, device=master.device)
                for name in bucket.names:
                    read(name, kind, whole[slice(*bucket.ranges[name])].view(bucket.shapes[name]))
                if kind == "master":
                    master.copy_(whole[bucket.shard])
                    bucket.params[bucket.shard].copy_(master)
                else:
                    state[kind] = whole[bucket.shard].clone()
            self.inner.state[master] = state
        self.buckets.all_gather_params()


def build_optimizer(params: dict[str, torch.nn.Parameter], args: OptimizerArgs, bucket_mb: float,
                    group: dist.ProcessGroup) -> tuple[GradientBuckets, MixedPrecisionAdamW]:
    """Gradient buckets (fp32 when accumulating in fp32) and the optimizer over their shards."""
    model_dtype = next(iter(params.values())).dtype
    grad_dtype = torch.float32 if args.accumulate_grad_in_fp32 else model_dtype
    no_decay = {n for n, p in params.items() if no_weight_decay(n, p, args.weight_decay_exclude_named_params)}
    buckets = GradientBuckets(params, no_decay, grad_dtype, int(bucket_mb * 2**20), group, shard=args.zero_stage == 1)
    return buckets, MixedPrecisionAdamW(buckets, args)
