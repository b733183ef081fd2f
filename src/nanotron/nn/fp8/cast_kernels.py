"""The FP8 casts as Triton kernels, and the tiles they run in (each the fastest or near it of those timed on an H200:
docs/benchmarks.md, ``scripts/benchmark_fp8_cast.py``): the output gradient cast in both layouts from one read of
each tile (``cast_both_layouts``), and the grouped backward's casts per (group, feature) in two passes
(``cast_per_group``). Each equals its plain-torch reference bit for bit (``casts.quantize``,
``grouped.quantize_for_grouped_backward_reference``, ``grouped.quantize_weight_columns_reference``): the CUDA tests
and Triton's interpreter check it. Defined where Triton loads (``nn/kernels.py``)."""

from __future__ import annotations

import torch

from nanotron.nn.fp8.scaling import GROUPED_ALIGNMENT, fp8_scale
from nanotron.nn.kernels import tl, triton, triton_op, wrap_triton

if triton is not None:
    # A tile of 32 rows × 128 columns on 4 warps: of eight tiles timed on an H200 at the 1B model's gradient shapes,
    # within 8% of the fastest at each shape in every run (docs/benchmarks.md; the tiles differ by microseconds).
    CAST_BLOCK_R, CAST_BLOCK_C, CAST_WARPS = 32, 128, 4

    @triton.jit
    def _cast_both_layouts_kernel(x_ptr, scale_ptr, out_ptr, out_t_ptr, amax_ptr, rows, columns,
                                  FP8_MAX: tl.constexpr, RECORD_AMAX: tl.constexpr, BLOCK_R: tl.constexpr,
                                  BLOCK_C: tl.constexpr):
        # FP8_MAX is a compile-time constant: torch.compile passes a Python float argument as fp64, and Triton
        # cannot lower an fp64 clamp followed by a cast to FP8.
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < rows) & (c[None, :] < columns)
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * columns + c[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.clamp(x * tl.load(scale_ptr), -FP8_MAX, FP8_MAX).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + r[:, None].to(tl.int64) * columns + c[None, :], y, mask=mask)
        tl.store(out_t_ptr + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(y), mask=tl.trans(mask))
        if RECORD_AMAX:
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))  # non-negative floats: order-free

    @triton_op("nanotron::fp8_cast_both_layouts", mutates_args={})
    def cast_both_layouts(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, record_amax: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [rows, columns] times ``scale``, clamped and cast to ``dtype``, row-major and transposed, and
        ``x``'s amax in fp32 (zero unless ``record_amax``)."""
        rows, columns = x.shape
        out = torch.empty((rows, columns), dtype=dtype, device=x.device)
        out_t = torch.empty((columns, rows), dtype=dtype, device=x.device)
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(rows, CAST_BLOCK_R), triton.cdiv(columns, CAST_BLOCK_C))
        wrap_triton(_cast_both_layouts_kernel)[grid](x.contiguous(), scale, out, out_t, amax, rows, columns,
                                                     FP8_MAX=torch.finfo(dtype).max, RECORD_AMAX=record_amax,
                                                     BLOCK_R=CAST_BLOCK_R, BLOCK_C=CAST_BLOCK_C, num_warps=CAST_WARPS)
        return out, out_t, amax


if triton is not None:
    # Tiles of whole 16-row blocks: GROUPED_BLOCKS blocks of GROUPED_ALIGNMENT rows × GROUPED_BLOCK_C columns. Of the
    # seven tiles ``scripts/benchmark_fp8_cast.py --grouped`` sweeps, 128 × 64 on 4 warps was the fastest at every
    # mixtral shape on an H200 (benchmarks/results/kernels/2026-12-03-h200-fp8-grouped-cast.json).
    GROUPED_BLOCKS, GROUPED_BLOCK_C, GROUPED_WARPS = 8, 64, 4

    @triton.jit
    def _block_groups(first_rows, ends, groups):
        """The group of each 16-row block starting at ``first_rows``: how many of the groups' ``ends`` lie at or
        before its first row (``searchsorted(offsets, row, right=True)``), the last group for the blocks past the
        last end (none, where the last end is the last row, but the blocks past the rows: their values are masked to
        zeros). It takes the ends loaded, not their pointer: torch.compile's analysis takes a pointer passed to a
        function as written, and would copy the offsets before every call."""
        return tl.minimum(tl.sum((ends[None, :] <= first_rows[:, None]).to(tl.int32), axis=1), groups - 1)

    @triton.jit
    def _grouped_amax_kernel(x_ptr, offsets_ptr, group_amax_ptr, row_amax_ptr, rows, columns, groups,
                             ROW_AMAX: tl.constexpr, GROUPS: tl.constexpr, BLOCKS: tl.constexpr,
                             BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        # A tile [BLOCKS, BLOCK_ROWS, BLOCK_C] of matrix ``batch``: each 16-row block lies in one group, and the tile's
        # blocks may lie in several. Atomic max of non-negative floats: the order of the tiles does not matter.
        batch = tl.program_id(2).to(tl.int64)
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        r = block[:, None] * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[None, :]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, :, None] < rows) & (c[None, None, :] < columns)
        x = tl.load(x_ptr + (batch * rows + r[:, :, None]) * columns + c[None, None, :], mask=mask, other=0.0)
        magnitudes = tl.abs(x.to(tl.float32))
        ends = tl.load(offsets_ptr + tl.arange(0, GROUPS), mask=tl.arange(0, GROUPS) < groups, other=2**31 - 1)
        group = _block_groups(block * BLOCK_ROWS, ends, groups)
        block_amax = tl.max(magnitudes, axis=1)  # [BLOCKS, BLOCK_C]
        if tl.min(group, axis=0) == tl.max(group, axis=0):  # the usual tile, inside one group: one atomic per column
            tl.atomic_max(group_amax_ptr + (batch * groups + tl.min(group, axis=0)) * columns + c,
                          tl.max(block_amax, axis=0), mask=c < columns)
        else:
            tl.atomic_max(group_amax_ptr + (batch * groups + group[:, None]) * columns + c[None, :], block_amax,
                          mask=(c < columns)[None, :])
        if ROW_AMAX:
            tl.atomic_max(row_amax_ptr + batch * rows + r, tl.max(magnitudes, axis=2), mask=r < rows)

    @triton.jit
    def _grouped_cast_kernel(x_ptr, offsets_ptr, column_scale_ptr, row_scale_ptr, out_t_ptr, out_ptr, rows, columns,
                             groups, FP8_MAX: tl.constexpr, ROWWISE: tl.constexpr, GROUPS: tl.constexpr,
                             BLOCKS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        # FP8_MAX a compile-time constant, as in _cast_both_layouts_kernel. The tile is read once; its per-(group,
        # column) scales are loaded once per 16-row block.
        batch = tl.program_id(2).to(tl.int64)
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        r = block[:, None] * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[None, :]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, :, None] < rows) & (c[None, None, :] < columns)
        x = tl.load(x_ptr + (batch * rows + r[:, :, None]) * columns + c[None, None, :], mask=mask,
                    other=0.0).to(tl.float32)
        ends = tl.load(offsets_ptr + tl.arange(0, GROUPS), mask=tl.arange(0, GROUPS) < groups, other=2**31 - 1)
        group = _block_groups(block * BLOCK_ROWS, ends, groups)
        scale = tl.load(column_scale_ptr + (batch * groups + group[:, None]) * columns + c[None, :],
                        mask=(c < columns)[None, :], other=0.0)
        y = tl.clamp(x * scale[:, None, :], -FP8_MAX, FP8_MAX).to(out_t_ptr.dtype.element_ty)
        tl.store(out_t_ptr + (batch * columns + c[:, None, None]) * rows + r[None, :, :], tl.permute(y, (2, 0, 1)),
                 mask=tl.permute(mask, (2, 0, 1)))
        if ROWWISE:
            row_scale = tl.load(row_scale_ptr + batch * rows + r, mask=r < rows, other=0.0)
            y = tl.clamp(x * row_scale[:, :, None], -FP8_MAX, FP8_MAX).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + (batch * rows + r[:, :, None]) * columns + c[None, None, :], y, mask=mask)

    def _cast_per_group(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                        tile: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``cast_per_group``'s two passes at ``tile`` (16-row blocks, columns, warps; the benchmark sweeps it)."""
        batch, rows, columns = x.shape
        groups = offsets.shape[0]
        x = x.contiguous()
        blocks, block_c, warps = tile
        grid = (triton.cdiv(rows, blocks * GROUPED_ALIGNMENT), triton.cdiv(columns, block_c), batch)
        sizes = dict(GROUPS=triton.next_power_of_2(groups), BLOCKS=blocks, BLOCK_ROWS=GROUPED_ALIGNMENT,
                     BLOCK_C=block_c, num_warps=warps)
        group_amax = torch.zeros((batch, groups, columns), dtype=torch.float32, device=x.device)
        row_amax = torch.zeros((batch, rows) if rowwise else (0,), dtype=torch.float32, device=x.device)
        _grouped_amax_kernel[grid](x, offsets, group_amax, row_amax, rows, columns, groups, ROW_AMAX=rowwise, **sizes)
        column_scale, row_scale = fp8_scale(group_amax, dtype), fp8_scale(row_amax, dtype)
        out_t = torch.empty((batch, columns, rows), dtype=dtype, device=x.device)
        out = torch.empty((batch, rows, columns) if rowwise else (0,), dtype=dtype, device=x.device)
        _grouped_cast_kernel[grid](x, offsets, column_scale, row_scale, out_t, out, rows, columns, groups,
                                   FP8_MAX=torch.finfo(dtype).max, ROWWISE=rowwise, **sizes)
        return out_t, column_scale, out, row_scale

    @torch.library.custom_op("nanotron::fp8_cast_per_group", mutates_args=())
    def cast_per_group(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Matrices ``x`` [batch, rows, columns], their rows grouped by ``offsets`` (int32 cumulative ends, every
        group whole 16-row blocks, the last end ``rows``), cast to ``dtype`` as ``quantize_per_group`` casts each:
        returns them transposed [batch, columns, rows] with their scales [batch, groups, columns], and where
        ``rowwise`` also row-major with one scale per row, as ``quantize(x, dtype, -1)`` (scales [batch, rows]; else
        both empty). Two passes over ``x``: the amaxes (atomics), then the casts, each tile read once and written in
        both layouts.

        An opaque op, not a ``triton_op``: traced into a compiled backward as a ``triton_op``, the kernels' outputs
        came out wrong on an H200 (the input gradient of the compiled grouped linear was zero where eager was right),
        so the compiler calls the op as it runs eagerly, which the CUDA tests check against the plain casts."""
        return _cast_per_group(x, offsets, dtype, rowwise, (GROUPED_BLOCKS, GROUPED_BLOCK_C, GROUPED_WARPS))

    @cast_per_group.register_fake
    def _(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, rows, columns = x.shape
        return (x.new_empty((batch, columns, rows), dtype=dtype),
                x.new_empty((batch, offsets.shape[0], columns), dtype=torch.float32),
                x.new_empty((batch, rows, columns) if rowwise else (0,), dtype=dtype),
                x.new_empty((batch, rows) if rowwise else (0,), dtype=torch.float32))
