"""Learning rate as a pure function of the optimizer step.

A pure function needs no saved state: resuming at step t gives exactly lr(t), whatever happened before. Steps are
1-based (step t is the t-th optimizer update), so linear warmup starts at lr/W rather than 0.
"""

from __future__ import annotations

import math

from nanotron.config import LRSchedulerArgs


def learning_rate_at(step: int, args: LRSchedulerArgs, train_steps: int) -> float:
    peak, floor = args.learning_rate, args.min_decay_lr
    warmup = args.lr_warmup_steps
    if step <= warmup:
        return peak * step / warmup if args.lr_warmup_style == "linear" else peak

    decay_start = args.lr_decay_starting_step if args.lr_decay_starting_step is not None else warmup
    decay_steps = args.lr_decay_steps if args.lr_decay_steps is not None else train_steps - decay_start
    if step <= decay_start or args.lr_decay_style == "constant":
        return peak
    if decay_steps <= 0 or step >= decay_start + decay_steps:
        return floor

    progress = (step - decay_start) / decay_steps
    if args.lr_decay_style == "linear":
        fraction = 1.0 - progress
    elif args.lr_decay_style == "cosine":
        fraction = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif args.lr_decay_style == "1-sqrt":
        fraction = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"unknown lr_decay_style {args.lr_decay_style!r}")
    return floor + (peak - floor) * fraction
