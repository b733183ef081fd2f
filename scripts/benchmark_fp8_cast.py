"""The FP8 backward's casts on CUDA: what the compiler makes of them against the tiled Triton kernels of
``nn/fp8/cast_kernels.py``.

    python scripts/benchmark_fp8_cast.py --output fp8_cast.json
    python scripts/benchmark_fp8_cast.py --grouped --output fp8_grouped_cast.json

Each linear's backward casts its bf16 output gradient [tokens, features] to e5m2 twice: row-major for the input
gradient's product, and transposed for the weight gradient's (``torch._scaled_mm`` takes both operands with the
reduced dimension contiguous). torch.compile fuses the cast and the transposed copy into one kernel with two stores
(``nn/fp8/casts.py`` as compiled layers run it), with the amax as a separate reduction unless the scale is known.
The kernel of ``nn/fp8/cast_kernels.py`` reads a [rows, columns] tile once and writes both layouts from it,
recording the amax with one atomic per tile; it is timed here at several tiles. Shapes: the 1B model's gate|up,
q|k|v and output-projection gradients at 16,384 tokens.
Every setting's outputs are checked bit for bit against the compiler's; times are ``triton.testing.do_bench``
medians in ms, with the bandwidth of the 4 bytes moved per element.

``--grouped`` times the MoE experts' backward casts (``fp8_grouped_linear``'s) at the mixtral preset's shapes: 16,640
token rows in 8 uneven groups of whole 16-row blocks, 2048, 4096 and 8192 features, each cast per (group, feature)
and transposed, and with ``rowwise`` (the output gradient) also per row, row-major; and the weights [8, 8192, 2048]
and [8, 2048, 4096] per (expert, input column), transposed. The compiled plain-torch casts
(``quantize_for_grouped_backward_reference``, ``quantize_weight_columns_reference``) against ``cast_per_group``'s
two kernels at several tiles, whose outputs are checked bit for bit against the plain-torch casts run eagerly (the
compiler may compute a scale an ulp away from the division). The format is e4m3, or e5m2 on a GPU without e4m3
casts in Triton (compute capability below 8.9: the same bytes moved); bandwidths count one read of bf16 and the
FP8 writes (the kernels read twice).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from benchmark_record import kernel_record
from triton.testing import do_bench

from nanotron.nn.fp8 import GROUPED_ALIGNMENT
from nanotron.nn.fp8.cast_kernels import _cast_both_layouts_kernel, _cast_per_group
from nanotron.nn.fp8.grouped import quantize_for_grouped_backward_reference, quantize_weight_columns_reference

E5M2 = torch.float8_e5m2
E5M2_MAX = torch.finfo(E5M2).max
SHAPES = ((16384, 16384), (16384, 3072), (16384, 2048))
TILES = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4), (128, 32, 4), (64, 256, 8),
         (256, 64, 8))  # rows, columns, warps


def tiled(x: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int, int]):
    """``cast_both_layouts``'s kernel (it records the amax) at another tile."""
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

GROUPED_ROWS, GROUPS = 16640, 8
GROUPED_FEATURES = (2048, 4096, 8192)
EXPERT_WEIGHTS = ((GROUPS, 8192, 2048), (GROUPS, 2048, 4096))  # gate|up and down: [experts, out, in]
GROUPED_TILES = ((2, 128, 4), (4, 128, 4), (4, 64, 4), (8, 64, 4), (8, 128, 8), (2, 256, 8), (4, 256, 8))
# 16-row blocks, columns, warps


def uneven_group_ends(rows: int, groups: int) -> torch.Tensor:
    """int32 cumulative ends of ``groups`` groups of whole 16-row blocks over ``rows`` rows, of seeded random sizes
    (an expert's share of the tokens varies), the last ending at the last row."""
    blocks = rows // GROUPED_ALIGNMENT
    shares = torch.rand(groups, generator=torch.Generator().manual_seed(0)) + 0.5
    sizes = (shares / shares.sum() * blocks).floor().long().clamp(min=1)
    sizes[-1] = blocks - sizes[:-1].sum()
    return (sizes.cumsum(0) * GROUPED_ALIGNMENT).to(torch.int32).cuda()


def time_grouped_cast(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool, reference) -> dict:
    """One grouped cast: the compiled plain-torch casts and ``cast_per_group``'s kernels at each tile, checked."""
    def kernels(tile):
        return _cast_per_group(x, offsets, dtype, rowwise, tile)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.element_size() == 1 else t

    expected = reference(x, offsets)
    compiled = torch.compile(reference)
    compiled(x, offsets)  # compiled before the timing
    row = {"shape": list(x.shape), "rowwise": rowwise, "compiled_ms": do_bench(lambda: compiled(x, offsets)),
           "tiled": []}
    for tile in GROUPED_TILES:
        got = kernels(tile)[:len(expected)]
        if not all(torch.equal(bits(a), bits(b)) for a, b in zip(got, expected)):
            raise SystemExit(f"error: tile {tile} casts differently from the plain-torch casts at {list(x.shape)}")
        row["tiled"].append({"tile": tile, "ms": do_bench(lambda: kernels(tile))})
    best = min(row["tiled"], key=lambda entry: entry["ms"])
    moved = x.numel() * (x.element_size() + 1 + rowwise)
    print(f"{'x'.join(map(str, x.shape))}{' rowwise' if rowwise else ''}: compiled {row['compiled_ms']:.3f} ms; "
          f"best tile {best['tile']} {best['ms']:.3f} ms, {moved / best['ms'] / 1e9:.2f} TB/s")
    return row


def grouped_main(output: Path, commit: str | None) -> None:
    dtype = torch.float8_e4m3fn if torch.cuda.get_device_capability() >= (8, 9) else E5M2
    offsets = uneven_group_ends(GROUPED_ROWS, GROUPS)
    results = {"activations": [], "weights": []}
    for features in GROUPED_FEATURES:
        x = torch.randn(GROUPED_ROWS, features, device="cuda", dtype=torch.bfloat16)
        for rowwise in (False, True):
            def reference(x, offsets, rowwise=rowwise):
                """The casts as ``cast_per_group`` returns them: transposed and its scales, then the rowwise."""
                casts = quantize_for_grouped_backward_reference(x[0], offsets, dtype, rowwise)
                return tuple(t[None] for t in casts[:4 if rowwise else 2])

            results["activations"].append(time_grouped_cast(x[None], offsets, dtype, rowwise, reference))
    for shape in EXPERT_WEIGHTS:
        weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        ends = torch.full((1,), shape[1], dtype=torch.int32, device="cuda")

        def reference(weight, ends):
            """The cast as ``cast_per_group`` returns it."""
            out_t, scale = quantize_weight_columns_reference(weight, dtype)
            return out_t, scale[:, None]

        results["weights"].append(time_grouped_cast(weight, ends, dtype, False, reference))
    record = kernel_record("fp8-grouped-cast", commit, results, format=str(dtype), group_ends=offsets.tolist())
    output.write_text(json.dumps(record, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="results as JSON")
    parser.add_argument("--grouped", action="store_true", help="the MoE experts' grouped casts instead")
    parser.add_argument("--commit", help="the commit measured, where the checkout has no git metadata")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA device")
    if args.grouped:
        return grouped_main(args.output, args.commit)
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
    args.output.write_text(json.dumps(kernel_record("fp8-cast", args.commit, results), indent=1) + "\n")


if __name__ == "__main__":
    main()
