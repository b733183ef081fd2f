"""The grouped FP8 experts' backward casts as Triton kernels (``cast_per_group``: one pass for the amaxes, one that
reads each tile once and writes both layouts) against the plain-torch casts they replace (``quantize_per_group``,
``quantize`` per row, the weight's per-column cast), bit for bit: under Triton's interpreter on the CPU, and on a
CUDA device, where ``fp8_grouped_linear`` with the kernels also equals its plain-torch path."""

from __future__ import annotations

import pytest
import torch

from support.kernels import run_with_triton_interpreter
from support.tiers import require_gpu

COUNTS = [5, 19, 0, 24, 40]  # one expert without tokens (16 zero rows once aligned), none a multiple of 16
E4M3_MAX = 448.0


def grouped_input(rows: int, columns: int, offsets: torch.Tensor, tokens: torch.Tensor, device: str,
                  generator: torch.Generator) -> torch.Tensor:
    """bf16 [rows, columns] grouped by ``offsets``, zero outside the ``tokens`` rows (the alignment's padding), each
    group at its own magnitude. On the CPU every scale is a power of two and every scaled value on e4m3's grid, so
    that no cast rounds: Triton's interpreter rounds some values at the top of a binade down a whole binade. Every
    row then holds ±448·2^-e (its group's e) in column 0, and every (group, column c) 448·2^-(e+c%3) in the group's
    first row, above the others (e4m3 values of at least 2^-2, times 2^-(e+c%3)). On CUDA the values are random."""
    from nanotron.nn.fp8 import E4M3, group_of_rows

    group = group_of_rows(offsets, rows)
    exponent = (group % 3).float()[:, None] + (torch.arange(columns) % 3).float()[None, :]
    base = torch.randn(rows, columns, generator=generator) * 16
    if device == "cpu":
        base = base.clamp(-440, 440).to(E4M3).float()
        base = torch.where(base.abs() < 0.25, 0.0, base)
        base[:, 0] = E4M3_MAX * torch.where(torch.rand(rows, generator=generator) < 0.5, -1.0, 1.0)
        base[torch.cat([offsets.new_zeros(1), offsets[:-1]]).clamp(max=rows - 1).long(), 1:] = E4M3_MAX
    x = base * 2.0 ** -exponent
    token_rows = torch.zeros(rows, dtype=torch.bool)
    token_rows[tokens] = True
    return torch.where(token_rows[:, None], x, 0.0).to(torch.bfloat16).to(device)


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what


def check_cast_per_group(device: str = "cpu") -> None:
    """``cast_per_group`` against the plain-torch casts, bit for bit (FP8 values and scales): the experts' layout of
    ``COUNTS`` (an empty expert's 16 zero rows, tiles spanning several groups, a last tile past the rows), a group
    without rows at all, feature counts that are not a multiple of the tile, and the weight's batch of matrices."""
    from nanotron.models.moe.model import _grouped_layout
    from nanotron.nn.fp8 import E4M3, GROUPED_ALIGNMENT, quantize, quantize_per_group
    from nanotron.nn.fp8.cast_kernels import GROUPED_BLOCK_C, GROUPED_BLOCKS, cast_per_group

    generator = torch.Generator().manual_seed(0)
    layout = _grouped_layout(torch.zeros(sum(COUNTS), 1), torch.tensor(COUNTS), GROUPED_ALIGNMENT)
    rows = layout[0].shape[0]
    assert rows % (GROUPED_BLOCKS * GROUPED_ALIGNMENT) and layout[2].tolist() == [16, 48, 64, 96, 176]
    cases = [(rows, layout[2], layout[1]), (80, torch.tensor([32, 32, 80]), torch.arange(80))]
    for columns in (48, GROUPED_BLOCK_C + 16):
        for rows, offsets, tokens in cases:
            x = grouped_input(rows, columns, offsets, tokens, device, generator)
            offsets = offsets.to(torch.int32).to(device)
            out_t, column_scale, out, row_scale = cast_per_group(x[None], offsets, E4M3, True)
            want, want_column_scale = quantize_per_group(x, offsets, E4M3)
            want_rows, want_row_scale = quantize(x, E4M3, -1)
            assert_same_fp8(out_t[0], want.t().contiguous(), f"per group, {rows}x{columns}")
            assert torch.equal(column_scale[0], want_column_scale), f"group scales, {rows}x{columns}"
            assert_same_fp8(out[0], want_rows, f"rowwise, {rows}x{columns}")
            assert torch.equal(row_scale[0], want_row_scale.squeeze(-1)), f"row scales, {rows}x{columns}"
            alone = cast_per_group(x[None], offsets, E4M3, False)
            assert torch.equal(alone[0], out_t) and torch.equal(alone[1], column_scale) and not alone[2].numel()

    weight = torch.stack([grouped_input(32, 48, torch.tensor([32]), torch.arange(32), device, generator)
                          for _ in range(3)])
    out_t, scale, _, _ = cast_per_group(weight, torch.tensor([32], dtype=torch.int32, device=device), E4M3, False)
    want, want_scale = quantize(weight.transpose(-2, -1), E4M3, -1)
    assert_same_fp8(out_t, want.contiguous(), "weight")
    assert torch.equal(scale[:, 0], want_scale.squeeze(-1)), "weight scales"


def check_grouped_linear(device: str = "cpu") -> None:
    """``fp8_grouped_linear``'s output and gradients with the backward's casts as kernels (three ``cast_per_group``
    calls: the output gradient in both layouts, the input, the weight) equal those of its plain-torch casts, bit for
    bit: the same FP8 values and scales in the same layouts reach the same grouped products. On the CPU (Triton's
    interpreter) ``available`` is made to say yes, and the products are the emulation's."""
    from unittest import mock

    from nanotron.models.moe.model import _grouped_layout
    from nanotron.nn.fp8 import cast_kernels
    from nanotron.nn.fp8 import grouped as fp8_grouped

    generator = torch.Generator().manual_seed(1)
    counts = torch.tensor(COUNTS)
    _, tokens, offsets = _grouped_layout(torch.zeros(sum(COUNTS), 1), counts, fp8_grouped.GROUPED_ALIGNMENT)
    rows = int(offsets[-1])
    x = grouped_input(rows, 32, offsets, tokens, device, generator)
    grad = grouped_input(rows, 48, offsets, tokens, device, generator)
    weight = torch.stack([grouped_input(48, 32, torch.tensor([48]), torch.arange(48), device, generator)
                          for _ in COUNTS])
    offsets = offsets.to(device)

    def run() -> list[torch.Tensor]:
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fp8_grouped.fp8_grouped_linear(xi, wi, offsets)
        out.backward(grad)
        return [out, xi.grad, wi.grad]

    casts = []
    kernel = cast_kernels.cast_per_group
    with mock.patch.object(cast_kernels, "cast_per_group", lambda *args: casts.append(args[3]) or kernel(*args)), \
            mock.patch.object(fp8_grouped, "available", lambda device: True):
        with_kernels = run()
    assert casts == [True, False, False]
    with mock.patch.object(fp8_grouped, "available", lambda device: False):
        plain = run()
    for name, got, want in zip(("output", "dx", "dW"), with_kernels, plain):
        assert torch.equal(got, want) and got.abs().sum() > 0, name


def check_compiled_grouped_linear() -> None:
    """Compiled whole with the kernels (``fullgraph``: ``cast_per_group`` is an opaque op with its shapes registered,
    so the compiled backward calls it as eager code does), ``fp8_grouped_linear`` gives eager's output and gradients
    bit for bit on the CPU (the compiler's kernels are C++ here)."""
    from unittest import mock

    from nanotron.models.moe.model import _grouped_layout
    from nanotron.nn.fp8 import grouped as fp8_grouped

    generator = torch.Generator().manual_seed(2)
    _, tokens, offsets = _grouped_layout(torch.zeros(sum(COUNTS), 1), torch.tensor(COUNTS),
                                         fp8_grouped.GROUPED_ALIGNMENT)
    rows = int(offsets[-1])
    x, grad = (grouped_input(rows, columns, offsets, tokens, "cpu", generator) for columns in (32, 48))
    weight = torch.stack([grouped_input(48, 32, torch.tensor([48]), torch.arange(48), "cpu", generator)
                          for _ in COUNTS])

    def forward(xi: torch.Tensor, wi: torch.Tensor) -> torch.Tensor:
        return fp8_grouped.fp8_grouped_linear(xi, wi, offsets)

    results = []
    with mock.patch.object(fp8_grouped, "available", lambda device: True):
        for run in (forward, torch.compile(forward, fullgraph=True)):
            xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
            out = run(xi, wi)
            out.backward(grad)
            results.append([out, xi.grad, wi.grad])
    for name, eager, compiled in zip(("output", "dx", "dW"), *results):
        assert torch.equal(compiled, eager) and eager.abs().sum() > 0, name


@pytest.mark.slow
def test_the_grouped_cast_kernels_equal_the_plain_casts_under_the_interpreter():
    run_with_triton_interpreter("from test_fp8_grouped_cast import check_cast_per_group; check_cast_per_group()")


@pytest.mark.slow
def test_the_grouped_linear_with_the_cast_kernels_equals_its_plain_casts_under_the_interpreter():
    run_with_triton_interpreter("from test_fp8_grouped_cast import check_grouped_linear; check_grouped_linear()")


@pytest.mark.slow  # compiling takes most of it; the eager interpreter tests check the same kernels in the quick tier
def test_the_compiled_grouped_linear_with_the_cast_kernels_equals_eager_under_the_interpreter():
    run_with_triton_interpreter("from test_fp8_grouped_cast import check_compiled_grouped_linear; "
                                "check_compiled_grouped_linear()")


def test_the_grouped_cast_kernels_equal_the_plain_casts_on_cuda():
    require_gpu((8, 9))  # FP8 casts
    check_cast_per_group("cuda")


def test_the_grouped_linear_with_the_cast_kernels_equals_its_plain_casts_on_cuda():
    require_gpu((8, 9))  # FP8 casts
    check_grouped_linear("cuda")


def test_the_compiled_grouped_linear_gives_the_eager_gradients_on_cuda():
    """Compiled whole (``fullgraph``: its forward and backward are opaque ops, no graph break), the grouped linear
    gives eager's output and gradients. In its place an ``autograd.Function`` compiled on an H200 gave an output
    detached from its backward: every gradient zero."""
    require_gpu((8, 9))  # FP8 casts
    from nanotron.models.moe.model import _grouped_layout
    from nanotron.nn.fp8 import grouped as fp8_grouped

    torch.manual_seed(0)
    counts = torch.tensor(COUNTS, device="cuda")
    x, _, offsets = _grouped_layout(torch.randn(sum(COUNTS), 64, device="cuda", dtype=torch.bfloat16), counts, 16)
    weight = torch.randn(len(COUNTS), 96, 64, device="cuda", dtype=torch.bfloat16) * 0.05
    grad = torch.randn(x.shape[0], 96, device="cuda", dtype=torch.bfloat16)

    def forward(xi: torch.Tensor, wi: torch.Tensor) -> torch.Tensor:
        return fp8_grouped.fp8_grouped_linear(xi, wi, offsets)

    results = []
    for run in (forward, torch.compile(forward, fullgraph=True)):  # compiled, the backward is compiled with it
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = run(xi, wi)
        out.backward(grad)
        results.append([out.detach().float(), xi.grad.float(), wi.grad.float()])
    for name, eager, compiled in zip(("output", "dx", "dW"), *results):
        assert eager.norm() > 0 and (compiled - eager).norm() <= 1e-6 * eager.norm(), name
