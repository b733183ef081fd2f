"""The record of each logged step: a line in the log, a record in metrics.jsonl and in the trackers (rank 0)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nanotron.config import Config
from nanotron.metrics import MetricsWriter, format_duration, peak_flops, peak_memory_gb
from nanotron.parallel.context import ParallelContext
from nanotron.trackers import Trackers

logger = logging.getLogger("nanotron.trainer")


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    domain_losses: dict[str, float]  # mean token loss of each domain present in the step's batch
    skipped: bool = False  # a bad step whose update was skipped (``divergence.py``)
    model_metrics: dict = field(default_factory=dict)  # the features' (FP8's ranges), the family's (expert load)


class StepLog:
    """Logs steps on rank 0 (every rank holds the step's statistics); the others only count."""

    def __init__(self, config: Config, pc: ParallelContext, flops_per_token: float, hardware_flops_per_token: float,
                 resume_step: int):
        self.config, self.pc = config, pc
        self.flops_per_token, self.hardware_flops_per_token = flops_per_token, hardware_flops_per_token
        self.peak_flops = peak_flops(pc.device, config.model.torch_dtype())
        self.metrics = MetricsWriter(config.resolved_metrics_path(), resume_step=resume_step) if pc.rank == 0 else None
        self.trackers = Trackers(config) if pc.rank == 0 else None

    def write(self, result: StepResult, step: int, consumed_tokens: int, per_domain: bool, step_seconds: float,
              mean_step_seconds: float) -> None:
        """Step ``step``, which took ``step_seconds`` (``mean_step_seconds`` on average since the run started);
        ``per_domain``: the data has several domains, whose losses are logged."""
        if self.pc.rank != 0:  # rank 0 logs at logging.log_level
            return
        config = self.config
        tokens_per_sec = config.global_batch_tokens / step_seconds
        per_gpu = tokens_per_sec / self.pc.world_size
        tflops = per_gpu * self.flops_per_token / 1e12
        hardware_tflops = per_gpu * self.hardware_flops_per_token / 1e12
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
        record |= result.model_metrics
        eta = mean_step_seconds * (config.tokens.train_steps - step)
        mfu = f"{100 * record['mfu']:.1f}%" if "mfu" in record else "n/a"
        hardware = f" (hw {hardware_tflops:.2f})" if self.hardware_flops_per_token != self.flops_per_token else ""
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
