"""FP8 MoE experts as grouped GEMMs (``torch._scaled_grouped_mm``, rowwise scales), emulated on CPU with the GPU
path's quantisation: against the exact experts and the per-expert loop, the weight gradient's per-expert scaling,
experts without tokens, the op's own contract on meta tensors (the calls the GPU makes, checked without one), one
compiled graph for any token counts, a tiny mixture training next to its non-FP8 twin, and on an sm_90 GPU the real
op against the emulation."""

from __future__ import annotations

import pytest
import torch

from nanotron.models.moe.model import GroupedExperts, _grouped_layout
from nanotron.nn.fp8 import E4M3, FP8ExpertMatmul, FP8RangeCounts, quantize, quantize_per_group
from nanotron.nn.fp8 import grouped as fp8_grouped
from support.configs import moe_config
from support.distributed import run_distributed
from support.runs import train_fp8_model
from support.tiers import require_gpu

COUNTS = [5, 19, 0, 24]  # one expert without tokens, none a multiple of 16


def experts(hidden: int = 32, ffn: int = 16, num_experts: int = 4, dtype=torch.float32) -> GroupedExperts:
    torch.manual_seed(0)
    module = GroupedExperts(num_experts, hidden, ffn).to(dtype)
    torch.nn.init.normal_(module.gate_up_proj, std=0.1)
    torch.nn.init.normal_(module.down_proj, std=0.1)
    return module


def run(module: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The output and the gradients of the input and both weights."""
    module.zero_grad()
    x = x.clone().requires_grad_()
    out = module(x, counts)
    out.backward(grad)
    return out.detach(), x.grad, module.gate_up_proj.grad.clone(), module.down_proj.grad.clone()


def counting_grouped_products(monkeypatch) -> list[int]:
    """Counts the calls of ``fp8_grouped_mm`` (two per grouped product and direction: 2 forward, 4 backward)."""
    calls = []
    real = fp8_grouped.fp8_grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_grouped, "fp8_grouped_mm", counted)
    return calls


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_grouped_fp8_experts_are_within_fp8_rounding_of_the_exact_experts(monkeypatch):
    """Output, input gradient and both weight gradients within e4m3's rounding (2^-4 per operand) of the fp32
    experts; the grouped products ran (no per-expert loop)."""
    calls = counting_grouped_products(monkeypatch)
    module, counts = experts(), torch.tensor(COUNTS)
    x, grad = torch.randn(48, 32), torch.randn(48, 32)
    exact = run(module, x, counts, grad)
    module.expert_matmul = FP8ExpertMatmul()
    grouped = run(module, x, counts, grad)
    assert len(calls) == 6
    for name, got, want in zip(("output", "dx", "dW gate_up", "dW down"), grouped, exact):
        assert relative_error(got, want) < 0.1, name
        assert not torch.equal(got, want), name  # FP8 really rounded
    assert not grouped[2][2].any() and not grouped[3][2].any()  # the expert without tokens gets no gradient


@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 48, 0], [16, 16, 0, 16]], ids=["mixed", "one-expert", "aligned"])
def test_grouped_products_equal_the_per_expert_rowwise_loop(monkeypatch, counts):
    """The grouped products quantise with the same scales as the loop of per-expert ``_FP8Linear`` products with the
    rowwise recipe and e4m3 gradients (each expert's padded tokens per row and per feature, each expert's weight
    per row and per column), and multiply each expert's dequantised values in fp32 alike: equal, bit for bit,
    experts without tokens included."""
    calls = counting_grouped_products(monkeypatch)
    module, counts = experts(), torch.tensor(counts)
    x, grad = torch.randn(48, 32), torch.randn(48, 32)
    module.expert_matmul = FP8ExpertMatmul()
    grouped = run(module, x, counts, grad)
    module.grouped_mm = False
    loop = run(module, x, counts, grad)
    assert len(calls) == 6  # the grouped run only
    for got, want in zip(grouped, loop):
        assert torch.equal(got, want)


def test_the_weight_gradient_scales_each_expert_over_its_own_tokens():
    """``dW_e = g_eᵀ x_e`` sums over expert e's tokens only, so its operands are scaled per (expert, feature) over
    those tokens. With one expert's values 10^5 times the other's, the small expert's weight gradient stays within
    e4m3's rounding of the exact one (3%); scaled per feature over all tokens, its values fall to FP8's subnormals
    and zero, and its gradient is 45% off. (e4m3's subnormals reach 2^-9 below its smallest normal value: at a
    factor of 10^3 the global scales still cost little, 3.7% against 3.3%; from 10^4 on they do.)"""
    torch.manual_seed(0)
    x, grad = torch.randn(64, 32), torch.randn(64, 48)
    x[:32] *= 1e5
    grad[:32] *= 1e5
    offsets = torch.tensor([32, 64], dtype=torch.int32)
    exact = grad[32:].t() @ x[32:]

    g_cols, g_scale = quantize_per_group(grad, offsets, E4M3)
    x_cols, x_scale = quantize_per_group(x, offsets, E4M3)
    per_group = fp8_grouped.fp8_grouped_mm(g_cols.t().contiguous(), g_scale.flatten(), x_cols.t().contiguous().t(),
                                           x_scale.flatten(), offsets, torch.float32)[1]
    g_all, g_all_scale = quantize(grad, E4M3, 0)
    x_all, x_all_scale = quantize(x, E4M3, 0)
    over_all_tokens = (g_all.float() / g_all_scale)[32:].t() @ (x_all.float() / x_all_scale)[32:]

    assert g_scale.shape == (2, 48) and x_scale.shape == (2, 32)
    assert relative_error(per_group, exact) < 0.05
    assert relative_error(over_all_tokens, exact) > 0.3


def test_the_grouped_layout_aligns_every_group_without_reading_the_counts():
    """Every expert's group starts at a multiple of 16 rows (the weight gradient's reduced dimension, which the op
    needs 16-byte aligned), holds its tokens in order, and the last group runs to the end of a buffer whose size
    depends on the token count only; the padding is zeros."""
    counts = torch.tensor(COUNTS)
    x = torch.randn(48, 8)
    padded, rows, offsets = _grouped_layout(x, counts, 16)
    assert padded.shape == (48 + 4 * 16, 8) and offsets.dtype == torch.int32
    assert offsets.tolist() == [16, 48, 64, 112]
    starts = [0, 16, 48, 64]
    for expert, (start, chunk) in enumerate(zip(starts, x.split(COUNTS))):
        assert torch.equal(padded[start:start + COUNTS[expert]], chunk)
    assert torch.equal(padded[rows], x) and padded.abs().sum() == x.abs().sum()


@pytest.mark.skipif(not hasattr(torch, "_scaled_grouped_mm"), reason="this torch has no torch._scaled_grouped_mm")
def test_the_gpu_calls_meet_the_ops_contract_on_meta_tensors(monkeypatch):
    """On meta tensors the grouped linear's forward product and backward (the bodies of its ops, whose registered
    shapes the module sees on meta) make the calls of the GPU path, through ``torch._scaled_grouped_mm``'s meta
    function: its checks (e4m3 operands, ``a`` row-major and ``b`` column-major with 16-byte strides, fp32 scales of
    the shapes it wants, int32 offsets, bf16 output) accept all six calls of the experts' two products, and they
    meet the CUDA kernel's further checks (trailing dimension of ``a`` and both of ``b`` multiples of 16). The meta
    checks are live: a row-major ``b`` is refused. No host sync: a ``.tolist()`` of meta tensors would fail."""
    calls = []
    real = torch._scaled_grouped_mm

    def recorded(a, b, scale_a, scale_b, offs=None, **kwargs):
        calls.append((a.shape, b.shape))
        return real(a, b, scale_a, scale_b, offs=offs, **kwargs)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", recorded)
    with torch.device("meta"):
        module = GroupedExperts(4, 64, 32).bfloat16()
        x = torch.empty(37, 64, dtype=torch.bfloat16, requires_grad=True)
        counts = torch.empty(4, dtype=torch.int64)
        x_grouped, _, offsets = _grouped_layout(x, counts, fp8_grouped.GROUPED_ALIGNMENT)
        hidden = torch.empty(x_grouped.shape[0], 32, dtype=torch.bfloat16)
    module.expert_matmul = FP8ExpertMatmul()
    out = module(x, counts)
    out.sum().backward()
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and module.gate_up_proj.grad.shape == module.gate_up_proj.shape
    assert module.down_proj.grad.shape == module.down_proj.shape
    for operand, weight in ((x_grouped, module.gate_up_proj), (hidden, module.down_proj)):
        (xq, x_scale), (wq, w_scale) = quantize(operand, E4M3, -1), quantize(weight, E4M3, -1)
        out = fp8_grouped.grouped_linear_product(xq, x_scale.squeeze(-1), wq, w_scale.squeeze(-1), offsets,
                                                         operand.dtype)
        grads = fp8_grouped.grouped_linear_gradient_products(out, operand, weight, offsets)
        assert [g.shape for g in grads] == [operand.shape, weight.shape]
    assert len(calls) == 6
    for a_shape, b_shape in calls:
        assert a_shape[-1] % 16 == 0 and b_shape[-2] % 16 == 0 and b_shape[-1] % 16 == 0, (a_shape, b_shape)

    a = torch.empty(48, 64, dtype=E4M3, device="meta")
    b_row_major = torch.empty(4, 64, 32, dtype=E4M3, device="meta")
    with pytest.raises(RuntimeError, match="column major"):
        real(a, b_row_major, torch.empty(48, device="meta"), torch.empty(4, 32, device="meta"),
             offs=torch.empty(4, dtype=torch.int32, device="meta"), out_dtype=torch.bfloat16)


def test_experts_off_a_multiple_of_16_take_the_per_expert_loop(monkeypatch):
    """The op needs every feature dimension a multiple of 16: experts of another width run the loop, which pads."""
    calls = counting_grouped_products(monkeypatch)
    module, counts = experts(hidden=32, ffn=24), torch.tensor(COUNTS)
    module.expert_matmul = FP8ExpertMatmul()
    out, *_ = run(module, torch.randn(48, 32), counts, torch.randn(48, 32))
    assert not calls and out.isfinite().all()


def test_counting_the_casts_ranges_takes_the_per_expert_loop(monkeypatch):
    """``fp8.log_out_of_range`` (a diagnostic) counts every cast; the grouped op takes tensors only, so the experts
    run the loop then, and count its casts: each expert's two products, forward and backward."""
    calls = counting_grouped_products(monkeypatch)
    module, counts = experts(), torch.tensor(COUNTS)
    module.expert_matmul = FP8ExpertMatmul(FP8RangeCounts())
    out, *_ = run(module, torch.randn(48, 32), counts, torch.randn(48, 32))
    recorded = module.expert_matmul.ranges.counts
    assert not calls and out.isfinite().all()
    assert (recorded[:, 2] > 0).all()  # inputs, weights and gradients were all cast and counted


@pytest.mark.slow
def test_compiled_grouped_experts_keep_one_graph_whatever_their_token_counts():
    """Compiled, the grouped experts trace without a graph break (the emulation is an opaque op; the layout reads
    no count on the host), and new token counts, experts without tokens included, compile nothing new; the results
    equal the eager ones."""
    from torch._dynamo.utils import counters

    module = experts()
    module.expert_matmul = FP8ExpertMatmul()
    compiled = torch.compile(module)
    torch._dynamo.reset()
    counters.clear()
    for step, counts in enumerate([COUNTS, [20, 20, 4, 4], [0, 48, 0, 0], [16, 16, 16, 0]]):
        counts = torch.tensor(counts)
        x, grad = torch.randn(48, 32), torch.randn(48, 32)
        for got, want in zip(run(compiled, x, counts, grad), run(module, x, counts, grad)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs == 1
    assert not counters["graph_break"]


def _train_counting_grouped_products(config: dict) -> dict:
    """``train_fp8_model`` on this rank, with the number of grouped FP8 products it ran."""
    calls = []
    real = fp8_grouped.fp8_grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    fp8_grouped.fp8_grouped_mm = counted
    try:
        return train_fp8_model(config) | {"grouped_products": len(calls)}
    finally:
        fp8_grouped.fp8_grouped_mm = real


@pytest.mark.full_tier
def test_a_tiny_mixture_trains_with_grouped_fp8_experts_next_to_its_twin(tiny_data, tmp_path):
    """The tiny LlaMoE with ``fp8.recipe: rowwise``: its experts run the grouped products (two MoE layers, six
    grouped products each per micro-batch), it learns, and its loss stays within 2% of the non-FP8 twin's; with its
    experts split over tp=2 (each rank's slice of the feed-forward width) it runs them too and follows tp=1."""
    def config(name: str, enabled: bool, tp: int = 1) -> dict:
        return moe_config(tiny_data, tmp_path / name, tp=tp) | {"fp8": {"enabled": enabled, "recipe": "rowwise"}}

    plain, low = (run_distributed(_train_counting_grouped_products, 1, config=config(name, enabled))[0]
                  for name, enabled in (("plain", False), ("fp8", True)))
    tp2 = run_distributed(_train_counting_grouped_products, 2, config=config("tp2", True, tp=2))
    micro_batches = len(low["records"]) * config("fp8", True)["tokens"]["batch_accumulation_per_replica"]
    assert plain["grouped_products"] == 0 and len(low["experts"]) == 2
    assert low["grouped_products"] == 2 * 6 * micro_batches
    first, last = plain["records"][0]["lm_loss"], plain["records"][-1]["lm_loss"]
    assert last < first - 0.5 and low["records"][-1]["lm_loss"] < low["records"][0]["lm_loss"] - 0.5
    assert low["records"][-1]["lm_loss"] != last
    assert abs(low["records"][-1]["lm_loss"] - last) <= 0.02 * last
    assert [rank["grouped_products"] for rank in tp2] == [low["grouped_products"]] * 2
    for a, b in zip(low["records"], tp2[0]["records"], strict=True):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=5e-3), a["step"]


@pytest.mark.skipif(not hasattr(torch, "_scaled_grouped_mm"), reason="this torch has no torch._scaled_grouped_mm")
def test_scaled_grouped_mm_matches_the_emulation_on_the_gpu(monkeypatch):
    """On an H100/H200 the real op against the emulation on the same GPU tensors: the same FP8 values and scales,
    so the bf16 results differ by the op's accumulation (order, and the forward's fast accumulation) and bf16
    rounding only."""
    require_gpu((9, 0), exact=True)  # the grouped FP8 products run on Hopper
    module = experts(hidden=256, ffn=512, num_experts=8, dtype=torch.bfloat16).cuda()
    module.expert_matmul = FP8ExpertMatmul()
    counts = torch.tensor([300, 0, 17, 511, 64, 1, 100, 31], device="cuda")
    x, grad = (torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    real = run(module, x, counts, grad)
    monkeypatch.setattr(fp8_grouped, "_runs_scaled_grouped_mm", lambda device: False)
    monkeypatch.setattr(FP8ExpertMatmul, "groups", staticmethod(lambda x, *weights: True))
    emulated = run(module, x, counts, grad)
    for name, got, want in zip(("output", "dx", "dW gate_up", "dW down"), real, emulated):
        assert relative_error(got, want) < 2 ** -7, name


@pytest.mark.skipif(not hasattr(torch, "_scaled_grouped_mm"), reason="this torch has no torch._scaled_grouped_mm")
def test_compiled_grouped_experts_give_the_eager_gradients_on_the_gpu():
    """The experts compiled as a model compiles them (``module.compile()``) give eager's output and gradients on an
    H100/H200: the gradients reach the experts' weights (an ``autograd.Function`` there once lost them all: relative
    error 1). The compiled SwiGLU rounds once where eager rounds per op, which moves a few FP8 casts of its output by
    a step: the output and the down projection's gradient differ by about 1.4% (0.4% in bf16), the rest not at all."""
    require_gpu((9, 0), exact=True)  # the grouped FP8 products run on Hopper
    module = experts(hidden=256, ffn=512, num_experts=8, dtype=torch.bfloat16).cuda()
    module.expert_matmul = FP8ExpertMatmul()
    counts = torch.tensor([300, 0, 17, 511, 64, 1, 100, 31], device="cuda")
    x, grad = (torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    eager = run(module, x, counts, grad)
    module.compile(fullgraph=True)
    compiled = run(module, x, counts, grad)
    for name, got, want in zip(("output", "dx", "dW gate_up", "dW down"), compiled, eager):
        assert want.norm() > 0 and relative_error(got, want) < 0.03, name
