"""The FP8 backward's cast of an output gradient, on CUDA: what the compiler makes of it against one tiled kernel.

    python scripts/benchmark_fp8_cast.py --output fp8_cast.json

Each linear's backward casts its bf16 output gradient [tokens, features] to e5m2 twice: row-major for the input
gradient's product, and transposed for the weight gradient's (``torch._scaled_mm`` takes both operands with the
reduced dimension contiguous). torch.compile fuses the cast and the transposed copy into one kernel with two stores
(``nn/fp8.py`` as compiled layers run it), with the amax as a separate reduction unless the scale is known. The
kernel of ``nn/fp8.py`` reads a [rows, columns] tile once and writes both layouts from it, recording the amax with
one atomic per tile; it is timed here at several tiles. Shapes: the 1B model's gate|up, q|k|v and output-projection
gradients at 16,384 tokens.
Every setting's outputs are checked bit for bit against the compiler's; times are ``triton.testing.do_bench``
medians in ms, with the bandwidth of the 4 bytes moved per element.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from nanotron.nn.fp8 import _cast_both_layouts_kernel

E5M2 = torch.float8_e5m2
E5M2_MAX = torch.finfo(E5M2).max
SHAPES = ((16384, 16384), (16384, 3072), (16384, 2048))
TILES = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4), (128, 32, 4), (64, 256, 8),
         (256, 64, 8))  # rows, columns, warps


def tiled(x: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int, int]):
    """``nn/fp8.py``'s kernel (it records the amax) at another tile."""
    rows, columns = x.shape
    out = torch.empty_like(x, dtype=E5M2)
    out_t = torch.empty((columns, rows), dtype=E5M2, device=x.device)
    amax = torch.zeros((), device=x.device)
    block_r, block_c, warps = tile
    grid = (triton.cdiv(rows, block_r), triton.cdiv(columns, block_c))
    _cast_both_layouts_kernel[grid](x, scale, out, out_t, amax, rows, columns, FP8_MAX=E5M2_MAX, RECORD_AMAX=True,
                                    BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out, out_t


@torch.compile
def compiled(x: torch.Tensor, scale: torch.Tensor):
    out = (x.float() * scale).clamp(-E5M2_MAX, E5M2_MAX).to(E5M2)
    return out, out.t().contiguous()


@torch.compile
def compiled_with_amax(x: torch.Tensor, scale: torch.Tensor):
    out = (x.float() * scale).clamp(-E5M2_MAX, E5M2_MAX).to(E5M2)
    return out, out.t().contiguous(), x.abs().amax(dim=-1).amax()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA device")
    results = []
    for rows, columns in SHAPES:
        x = torch.randn(rows, columns, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor(1000.0, device="cuda")
        expected = [t.view(torch.uint8) for t in compiled(x, scale)]
        row = {"shape": [rows, columns], "compiled_ms": do_bench(lambda: compiled(x, scale)),
               "compiled_with_amax_ms": do_bench(lambda: compiled_with_amax(x, scale)), "tiled": []}
        for tile in TILES:
            got = [t.view(torch.uint8) for t in tiled(x, scale, tile)]
            if not all(torch.equal(a, b) for a, b in zip(got, expected)):
                raise SystemExit(f"error: tile {tile} casts differently from the compiler at {rows}x{columns}")
            row["tiled"].append({"tile": tile, "ms": do_bench(lambda: tiled(x, scale, tile))})
        best = min(row["tiled"], key=lambda entry: entry["ms"])
        print(f"{rows}x{columns}: compiled {row['compiled_ms']:.3f} ms (+amax {row['compiled_with_amax_ms']:.3f}); "
              f"best tile {best['tile']} {best['ms']:.3f} ms (with the amax), "
              f"{rows * columns * 4 / best['ms'] / 1e9:.2f} TB/s")
        results.append(row)
    args.output.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
