"""Stand-ins for what only a GPU has, so that the CPU runs the GPU's code paths: ``torch._scaled_mm`` with the
demands FP8 GPUs make, the benchmark's CUDA memory counters and timer, and the integer ``torch.histc``."""

from __future__ import annotations

import torch


def strict_scaled_mm(calls: list):
    """A stand-in for ``torch._scaled_mm`` that checks the demands every FP8 GPU makes (dimensions multiples of 16,
    a row-major, b column-major, scale shapes, and a bf16 output with per-row scales: Ada and sm_100+ GPUs refuse
    fp32 there) and multiplies as the emulation does; each call appends a's shape to ``calls``."""
    def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
        calls.append(a.shape)
        assert all(d % 16 == 0 for d in (*a.shape, *b.shape)), (a.shape, b.shape)
        assert a.is_contiguous() and b.t().is_contiguous()
        assert scale_a.shape in ((), (a.shape[0], 1)) and scale_b.shape in ((), (1, b.shape[1]))
        assert not (scale_a.dim() or scale_b.dim()) or out_dtype == torch.bfloat16, f"rowwise with {out_dtype} out"
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    return scaled_mm


def benchmark_on_cpu(monkeypatch, benchmark) -> None:
    """``scripts/benchmark.py`` (the module ``benchmark``) with CUDA's memory counters, its all-gather and its CUDA
    event timer stood in, so that ``run_nanotron`` trains the real trainer on the CPU: every step takes 0.5 s."""
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(benchmark, "per_rank", lambda value: [value])
    monkeypatch.setattr(benchmark, "timed", lambda step, steps, warmup: ([step(i) or 0.5 for i in range(warmup + steps)]
                                                                          [warmup:], 0))


def integer_histc(monkeypatch) -> None:
    """``torch.histc`` of an integer tensor, counted in its dtype as CUDA counts it (the CPU's refuses integers):
    torchtitan's routers count each expert's tokens with it."""
    histc = torch.histc
    monkeypatch.setattr(torch, "histc",
                        lambda input, *args, **kwargs: histc(input.float(), *args, **kwargs).to(input.dtype))
