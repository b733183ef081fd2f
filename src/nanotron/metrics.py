"""Throughput and utilisation figures, defined once so every report uses the same formulas.

FLOPs per token come from the model family (``ModelSpec.costs``), in Megatron-LM's convention: 6 per weight a token
uses (forward and backward), the LM head included and the input-embedding lookup not, plus ``6 * layers * hidden *
sequence`` for causal attention. MFU divides the achieved FLOP/s by the device's dense peak for the
training dtype; on a device missing from the table no MFU is reported rather than a wrong one. MFU counts only the
model's FLOPs, however the run computes them; the hardware figure adds the work done on top of them (recomputed
layers): it tells how busy the devices were rather than how fast the model trains.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from nanotron.files import atomic_write_text

logger = logging.getLogger(__name__)

# Dense (no sparsity) peak FLOP/s by device-name fragment, for 16-bit and fp32 (TF32 tensor cores) training.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp32": 494e12},
    "H100 PCIe": {"bf16": 756e12, "fp32": 378e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 418e12},
    "H100": {"bf16": 989e12, "fp32": 494e12},
    "A100": {"bf16": 312e12, "fp32": 156e12},
    "L40S": {"bf16": 362e12, "fp32": 183e12},
    "A10G": {"bf16": 70e12, "fp32": 35e12},
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    kind = "fp32" if dtype == torch.float32 else "bf16"
    for fragment, peaks in PEAK_FLOPS.items():
        if fragment in name:
            return peaks[kind]
    return None


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux
    except ImportError:
        return 0.0


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line)["step"]
    except (ValueError, TypeError, KeyError):
        return None
    return step if isinstance(step, int) else None


class MetricsWriter:
    """Appends one JSON object per logged step.

    A resumed run continues the same file; records of steps after the resumed checkpoint (logged before a crash)
    are dropped first, so every step appears once and steps only increase. A line that is not a record (the torn
    last line of a run killed while writing) is dropped with a warning.
    """

    def __init__(self, path: Path, resume_step: int = 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # rewritten atomically: a crash here must not lose the history
            lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
            torn = [line for line in lines if _step_of(line) is None]
            if torn:
                logger.warning(f"{path}: dropped {len(torn)} line(s) that are not step records "
                               f"(e.g. {torn[0][:60]!r}, torn by a crash)")
            kept = [line for line in lines if (step := _step_of(line)) is not None and step <= resume_step]
            atomic_write_text(path, "".join(line + "\n" for line in kept))
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
