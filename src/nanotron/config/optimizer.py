"""The ``optimizer`` section: AdamW or Muon, ZeRO, clipping, bad-step handling, and the learning-rate schedule."""

import re
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields
from typing import Annotated, Literal

from nanotron.config.rules import Spellings, at_least, positive

LR_KEY = "optimizer.learning_rate_scheduler"
ZERO_STAGES = (0, 1, 2, 3)
MomentsDType = Annotated[Literal["float32", "bfloat16"],
                         Spellings(fold=str.lower, aliases={"fp32": "float32", "bf16": "bfloat16"})]
OptimizerName = Annotated[Literal["adamw", "muon"], Spellings(fold=str.lower)]
# Muon's update scale (``optim/muon.py``): Moonlight's RMS matching, 0.2 * sqrt(max(rows, columns)), gives the update
# the RMS of AdamW's so that AdamW's learning rate and weight decay carry over; the original, sqrt(max(1, rows /
# columns)), needs a learning rate of its own (about 0.02).
MuonUpdateScale = Literal["rms_matching", "original"]
# Keller Jordan's quintic Newton-Schulz coefficients (``optim/newton_schulz.py``).
MUON_QUINTIC = (3.4445, -4.7750, 2.0315)
# The largest Adam beta that bf16 moments take: bf16 keeps 8 significant bits (a relative spacing of 2^-7 = 0.0078),
# so ``beta * m + (1 - beta) * x`` with a smaller ``1 - beta`` can round back to ``m`` (at 0.999, always does).
BF16_MOMENTS_MAX_BETA = 0.99


@dataclass
class LRSchedulerArgs:
    learning_rate: float
    lr_warmup_steps: int = 0
    lr_warmup_style: Literal["linear", "constant"] = "linear"
    lr_decay_style: Literal["constant", "linear", "cosine", "1-sqrt"] = "cosine"
    lr_decay_starting_step: int | None = None  # None: right after the warmup
    lr_decay_steps: int | None = None  # None: until the last training step
    min_decay_lr: float = 0.0

    def problems(self) -> Iterator[str]:
        """The schedule's own rules; how it fits ``tokens.train_steps`` is a rule between sections."""
        yield from positive(f"{LR_KEY}.learning_rate", self.learning_rate)
        yield from at_least(f"{LR_KEY}.lr_warmup_steps", self.lr_warmup_steps, 0)
        if not 0 <= self.min_decay_lr <= self.learning_rate:
            yield (f"{LR_KEY}.min_decay_lr ({self.min_decay_lr}) must be in [0, learning_rate] = "
                   f"[0, {self.learning_rate}]")
        if self.lr_decay_steps is not None:
            yield from at_least(f"{LR_KEY}.lr_decay_steps", self.lr_decay_steps, 0)
        if self.lr_decay_starting_step is not None and self.lr_decay_starting_step < self.lr_warmup_steps:
            yield (
                f"{LR_KEY}.lr_decay_starting_step ({self.lr_decay_starting_step}) must be >= {LR_KEY}.lr_warmup_steps "
                f"({self.lr_warmup_steps}): decay starts after the warmup"
            )


@dataclass
class OptimizerArgs:
    learning_rate_scheduler: LRSchedulerArgs
    zero_stage: int = 0  # sharded over data-parallel ranks: 1 optimizer state, 2 and gradients, 3 and weights
    weight_decay: float = 0.0
    weight_decay_exclude_named_params: list[str] | None = None  # None: norms, biases and embeddings are excluded
    clip_grad: float | None = 1.0
    accumulate_grad_in_fp32: bool = True
    adam_eps: float = 1e-8
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_moments_dtype: MomentsDType = "float32"  # bfloat16: a lower-precision option, fp32 arithmetic and masters
    store_param_remainders: bool = True  # fp32 masters of bf16 weights as those weights + 16 bits (false: copies)
    persistent_gradient_buffers: bool = False  # a flat gradient buffer even where nothing is summed in it
    grad_reduce_in_bf16: bool = False  # ZeRO-2/3: reduce-scatter gradients in bf16 (accumulated in fp32 after)
    torch_adam_is_fused: bool = True
    skip_bad_steps: int = 0  # bad steps in a row whose update is skipped before the run stops (0: stop at the first)
    loss_spike_factor: float | None = None  # a loss above this times the recent mean counts as a bad step
    # ``adamw``, or ``muon``: orthogonalised momentum for the decoder's matrices, AdamW (the adam_* settings) for the
    # rest (embeddings, LM head, norms, biases, routers); upstream's ``optimizer_factory.name``.
    name: OptimizerName = "adamw"
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    muon_ns_coefficients: list[float] = field(default_factory=lambda: list(MUON_QUINTIC))
    muon_update_scale: MuonUpdateScale = "rms_matching"
    muon_weight_decay: float | None = None  # None: optimizer.weight_decay
    muon_named_params: list[str] | None = None  # regexes of the matrices Muon takes; None: the decoder's matrices
    # QK-clip (Kimi K2's MuonClip, ``optim/qk_clip.py``): after each step, the query and key rows of every head whose
    # largest attention logit of the step passed this threshold (e.g. 100) are scaled down to it; None: off
    muon_qk_clip_threshold: float | None = None

    def muon_problems(self) -> Iterator[str]:
        """Muon's settings; they are refused when another optimizer is chosen, where they would do nothing."""
        changed = [f.name for f in fields(self) if f.name.startswith("muon_")
                   and getattr(self, f.name) != (f.default_factory() if f.default is MISSING else f.default)]
        if self.name != "muon":
            if changed:
                yield (f"optimizer.{changed[0]} is a setting of Muon but optimizer.name is {self.name}; set "
                       "optimizer.name: muon (optimizer_factory.name: muon) or remove it")
            return
        if not 0 <= self.muon_momentum < 1:
            yield f"optimizer.muon_momentum must be in [0, 1) (got {self.muon_momentum})"
        yield from at_least("optimizer.muon_ns_steps", self.muon_ns_steps, 1)
        if len(self.muon_ns_coefficients) != 3:
            yield (f"optimizer.muon_ns_coefficients must be the three coefficients (a, b, c) of the quintic "
                   f"a x + b x^3 + c x^5 (got {self.muon_ns_coefficients}); the default is {list(MUON_QUINTIC)}")
        if self.muon_weight_decay is not None:
            yield from at_least("optimizer.muon_weight_decay", self.muon_weight_decay, 0)
        if self.muon_qk_clip_threshold is not None:
            yield from positive("optimizer.muon_qk_clip_threshold", self.muon_qk_clip_threshold)
        for i, pattern in enumerate(self.muon_named_params or []):
            try:
                re.compile(pattern)
            except re.error as e:
                yield f"optimizer.muon_named_params[{i}] ({pattern!r}) is not a valid regex: {e}"

    def problems(self) -> Iterator[str]:
        yield from self.muon_problems()
        if self.zero_stage not in ZERO_STAGES:
            yield (f"optimizer.zero_stage must be 0 (off), 1 (optimizer state sharded over dp), 2 (and gradients) or "
                   f"3 (and weights) (got {self.zero_stage})")
        elif self.grad_reduce_in_bf16 and self.zero_stage < 2:
            yield (f"optimizer.grad_reduce_in_bf16 needs optimizer.zero_stage 2 or 3 (got {self.zero_stage}), where "
                   "gradients are reduced every micro-batch and summed in fp32 shards; set zero_stage or remove it")
        yield from at_least("optimizer.weight_decay", self.weight_decay, 0)
        if self.clip_grad is not None:
            yield from positive("optimizer.clip_grad", self.clip_grad)
        yield from positive("optimizer.adam_eps", self.adam_eps)
        yield from at_least("optimizer.skip_bad_steps", self.skip_bad_steps, 0)
        if self.loss_spike_factor is not None and not self.loss_spike_factor > 1:
            yield (f"optimizer.loss_spike_factor must be > 1 (got {self.loss_spike_factor}): it multiplies the "
                   "recent mean loss; use e.g. 2.0, or null to detect no spikes")
        for name in ("adam_beta1", "adam_beta2"):
            beta = getattr(self, name)
            if not 0 <= beta < 1:
                yield f"optimizer.{name} must be in [0, 1) (got {beta})"
            elif self.adam_moments_dtype == "bfloat16" and beta > BF16_MOMENTS_MAX_BETA:
                yield (f"optimizer.{name} ({beta}) must be <= {BF16_MOMENTS_MAX_BETA} with "
                       "optimizer.adam_moments_dtype bfloat16: bf16 keeps 8 significant bits, so a moment updated by "
                       "beta * m + (1 - beta) * x with so small a 1 - beta rounds back to its old value (at 0.999 the "
                       f"second moment never decays); lower optimizer.{name} or set optimizer.adam_moments_dtype: "
                       "float32")
        for i, pattern in enumerate(self.weight_decay_exclude_named_params or []):
            try:
                re.compile(pattern)
            except re.error as e:
                yield f"optimizer.weight_decay_exclude_named_params[{i}] ({pattern!r}) is not a valid regex: {e}"
        yield from self.learning_rate_scheduler.problems()
