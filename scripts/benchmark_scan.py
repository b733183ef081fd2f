"""Kernel times of Mamba's chunked selective scan (``nn/selective_scan.py``), forward and backward, on CUDA.

    python scripts/benchmark_scan.py --output scan.json
    python scripts/benchmark_scan.py --output sweep.json --settings 8,8,1,3,0 8,8,1,3,2 --shapes 8x2048x1536

Times the raw ``scan_forward`` and ``scan_backward`` ops (``triton.testing.do_bench`` medians) with bf16 x, B, C
and upstream gradient and fp32 Δ, as a compiled Mamba block calls them, at each ``batch x length x channels``
shape (default: the 130M shape at micro-batch 8 and the 1.4B shape at micro-batch 4, sequence 2048, d_state 16) and
for each kernel setting ``chunk,channels,warps,forward stages,backward stages`` (default: the one in use; stages
> 1 prefetch the next chunks' loads; 0 backward stages lets the grid choose, as training does). Every setting's
outputs are checked against the first's, so a faster setting that computes something else is reported as such.
Results go to ``--output`` (JSON) and a markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from nanotron.nn import selective_scan as scan


def inputs(batch: int, length: int, channels: int, d_state: int) -> tuple[torch.Tensor, ...]:
    """Inputs in a trained model's ranges (Δ from a softplus, A from the S4D-real initialisation) and dtypes (bf16
    x, B, C and upstream gradient, fp32 Δ), as a compiled Mamba block passes them."""
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=generator).to(dtype)

    x = randn(batch, length, channels)
    delta = torch.nn.functional.softplus(randn(batch, length, channels, dtype=torch.float32) - 4)
    A = -torch.arange(1, d_state + 1, device="cuda", dtype=torch.float32).expand(channels, d_state).contiguous()
    B, C = randn(batch, length, d_state), randn(batch, length, d_state)
    return x, delta, A, B, C, randn(batch, length, channels)


def time_setting(setting: tuple[int, ...], tensors: tuple[torch.Tensor, ...]) -> tuple[float, float, list]:
    """Forward and backward milliseconds at ``setting`` (chunk, channels, warps, forward stages, backward stages;
    0 backward stages: chosen by the grid, as in training), and the outputs to compare."""
    from triton.testing import do_bench

    scan.BLOCK_T, scan.BLOCK_D, scan.NUM_WARPS, scan.FORWARD_STAGES, backward_stages = setting
    scan.BACKWARD_STAGES = backward_stages or None  # the module's settings are read by the ops at each call
    x, delta, A, B, C, dy = tensors
    y, starts, _ = scan.scan_forward(x, delta, A, B, C)
    forward = do_bench(lambda: scan.scan_forward(x, delta, A, B, C))
    backward = do_bench(lambda: scan.scan_backward(x, delta, A, B, C, starts, dy))
    return forward, backward, [y, *scan.scan_backward(x, delta, A, B, C, starts, dy)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["8x2048x1536", "4x2048x4096"],
                        help="batch x length x channels (channels = expand x d_model)")
    parser.add_argument("--d-state", type=int, default=16)
    parser.add_argument("--settings", nargs="+",
                        default=[",".join(map(str, (scan.BLOCK_T, scan.BLOCK_D, scan.NUM_WARPS, scan.FORWARD_STAGES,
                                                     scan.BACKWARD_STAGES or 0)))],
                        help="chunk,channels,warps,forward stages,backward stages; the first is the baseline the "
                             "others are checked against")
    args = parser.parse_args()
    if not torch.cuda.is_available() or scan.triton is None:
        sys.exit("error: the scan benchmark needs a CUDA device and Triton")
    settings = [tuple(int(v) for v in text.split(",")) for text in args.settings]
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "d_state": args.d_state, "rows": []}
    print("| shape | chunk, channels, warps, stages (forward, backward) | forward ms | backward ms "
          "| outputs as the first setting's |")
    print("| --- | --- | ---: | ---: | --- |")
    for shape in args.shapes:
        batch, length, channels = (int(v) for v in shape.split("x"))
        tensors = inputs(batch, length, channels, args.d_state)
        baseline = None
        for setting in settings:
            forward, backward, outputs = time_setting(setting, tensors)
            if baseline is None:
                baseline, same = outputs, True
            else:  # bf16 outputs and gradients: compare at their precision
                same = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-3 * b.float().abs().max().item())
                           for a, b in zip(outputs, baseline))
            results["rows"].append({"shape": shape, "setting": setting, "forward_ms": forward,
                                    "backward_ms": backward, "matches_first": same})
            print(f"| {shape} | {', '.join(map(str, setting))} | {forward:.3f} | {backward:.3f} | {same} |")
    args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
