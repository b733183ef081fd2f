"""The record of each logged step: a line in the log, a record in metrics.jsonl and in the trackers (rank 0)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from nanotron.config import Config
from nanotron.metrics import MetricsWriter, format_duration, peak_flops, peak_memory_gb
from nanotron.models.spec import ModelCosts
from nanotron.parallel.context import ParallelContext
from nanotron.trackers import Trackers
from nanotron.training.objective import ATTENTION_FLOPS

logger = logging.getLogger("nanotron.trainer")


class HostCopy:
    """Tensors on their way to the host: each copy is queued behind the work that computes it, without waiting for
    that work; ``values`` waits for it alone (a CUDA event), not for what was queued after it."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._values = {name: tensor.detach().to("cpu", non_blocking=True) for name, tensor in tensors.items()}
        self._ready = None
        if any(tensor.is_cuda for tensor in tensors.values()):
            self._ready = torch.cuda.Event()
            self._ready.record()

    def values(self) -> dict[str, torch.Tensor]:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._values


@dataclass
class PendingStep:
    """A queued step whose loss, norm and statistics are on their way to the host (``Trainer.finish_step`` reads
    them into its ``StepResult``)."""

    step: int
    lr: float
    readings: HostCopy  # the step statistics and ``grad_norm``
    model_metrics: dict  # the features', taken when the step was queued
    skipped: bool = False
    judged: bool = False  # judged before its update (``divergence.py``): not judged again


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    # mean token loss of each domain present in the step's batch (none for a skipped step); None: the data stage has
    # one domain, and no per-domain losses are logged
    domain_losses: dict[str, float] | None
    skipped: bool = False  # a bad step whose update was skipped (``divergence.py``)
    model_metrics: dict = field(default_factory=dict)  # the features' (FP8's ranges), the step terms' (expert load)
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)  # the step's, read on the host


class StepLog:
    """Logs steps on rank 0 (every rank holds the step's statistics); the others only count.

    TFLOP/s and MFU count the model's FLOPs per token (``costs``), with the layers recomputed for the hardware's;
    under document masking, attention's FLOPs are those of the pairs the steps since the last logged one computed
    (``count``: the step statistic ``ATTENTION_FLOPS``), added up and read once per logged step.
    """

    def __init__(self, config: Config, pc: ParallelContext, costs: ModelCosts, resume_step: int):
        self.config, self.pc, self.costs = config, pc, costs
        self.recompute = config.parallelism.recompute
        self.flops_per_token = costs.flops_per_token
        self.hardware_flops_per_token = costs.hardware_flops_per_token(self.recompute)
        self._attention_flops: torch.Tensor | None = None  # of the steps counted since the last logged one
        self._counted_steps = 0
        self.peak_flops = peak_flops(pc.device, config.model.torch_dtype())
        self.metrics = MetricsWriter(config.resolved_metrics_path(), resume_step=resume_step) if pc.rank == 0 else None
        self.trackers = Trackers(config) if pc.rank == 0 else None

    def count(self, result: StepResult) -> None:
        """Adds up the attention FLOPs of a step under document masking until the next logged step."""
        attention = result.statistics.get(ATTENTION_FLOPS)
        if attention is not None:
            previous = self._attention_flops
            self._attention_flops = attention if previous is None else previous + attention
            self._counted_steps += 1

    def _flops_per_token(self) -> tuple[float, float]:
        """The model's and the hardware's FLOPs per token of the steps since the last logged one (their counted
        attention under document masking), and starts counting again."""
        if self._attention_flops is None:
            return self.flops_per_token, self.hardware_flops_per_token
        tokens, attention = self.config.global_batch_tokens * self._counted_steps, self._attention_flops.item()
        self._attention_flops, self._counted_steps = None, 0
        return (self.costs.masked_flops_per_token(tokens, attention),
                self.costs.masked_flops_per_token(tokens, attention, self.recompute))

    def write(self, result: StepResult, step: int, consumed_tokens: int, step_seconds: float,
              mean_step_seconds: float, evaluation: dict | None = None) -> None:
        """Step ``step``, which took ``step_seconds`` (``mean_step_seconds`` on average since the run started); the
        domains' losses where the data has several; the fields of an evaluation after it (``training/evals.py``)."""
        flops_per_token, hardware_flops_per_token = self._flops_per_token()
        per_domain = result.domain_losses is not None
        if self.pc.rank != 0:  # rank 0 logs at logging.log_level
            return
        config = self.config
        tokens_per_sec = config.global_batch_tokens / step_seconds
        per_gpu = tokens_per_sec / self.pc.world_size
        tflops = per_gpu * flops_per_token / 1e12
        hardware_tflops = per_gpu * hardware_flops_per_token / 1e12
        record = {
            "step": step,
            "lm_loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "consumed_tokens": consumed_tokens,
            "step_time_s": step_seconds,
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_gpu": per_gpu,
            "tflops_per_gpu": tflops,
            "hardware_tflops_per_gpu": hardware_tflops,
            "peak_memory_gb": peak_memory_gb(self.pc.device),
        }
        if self.peak_flops is not None:
            record["mfu"] = tflops * 1e12 / self.peak_flops
        if per_domain:
            record["domain_losses"] = result.domain_losses
        if result.skipped:
            record["skipped_update"] = True
        record |= result.model_metrics | (evaluation or {})
        eta = mean_step_seconds * (config.tokens.train_steps - step)
        mfu = f"{100 * record['mfu']:.1f}%" if "mfu" in record else "n/a"
        hardware = f" (hw {hardware_tflops:.2f})" if self.recompute != "none" else ""
        logger.info(
            f"step {step}/{config.tokens.train_steps} | loss {result.loss:.4f} | lr {result.lr:.3e} | "
            f"grad_norm {result.grad_norm:.3f} | {tokens_per_sec:,.0f} tok/s ({per_gpu:,.0f}/gpu) | "
            f"{tflops:.2f} TFLOP/s{hardware} | MFU {mfu} | mem {record['peak_memory_gb']:.2f} GB | "
            f"ETA {format_duration(eta)}"
            + ("".join(f" | {name} {loss:.4f}" for name, loss in result.domain_losses.items()) if per_domain else "")
            + "".join(f" | {_short_name(name, result.model_metrics)} {value:.4g}"
                      for name, value in result.model_metrics.items() if isinstance(value, float))
        )
        self.metrics.write(record)
        self.trackers.log(record)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.trackers.close()


def _short_name(name: str, metrics: dict) -> str:
    """A metric's name on the step line: without its ``moe_`` prefix, unless another metric has that name (the
    router's ``moe_z_loss`` beside the logits' ``z_loss`` of a Qwen2 mixture of experts)."""
    short = name.removeprefix("moe_")
    return name if short != name and short in metrics else short
