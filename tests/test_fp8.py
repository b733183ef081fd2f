"""FP8 linears (emulated on CPU, quantised exactly as on the GPU): quantisation error bounds, the forward and the
three backward products against a hand-written quantised reference and the high-precision linear on non-square
shapes with real upstream gradients, a tiny model training close to its bf16-free twin, and tp=2 against tp=1."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config_dict

from distributed import run_distributed, run_distributed_each

from nanotron.nn.fp8 import E4M3, E5M2, FP8Matmul, FP8Recipe, quantize


@pytest.mark.parametrize("dtype, relative", [(E4M3, 2 ** -4), (E5M2, 2 ** -3)])
def test_quantize_dequantize_error_is_within_the_format_bound(dtype, relative):
    x = torch.randn(64, 48) * 3
    q, scale = quantize(x, dtype)
    assert q.dtype == dtype and scale.numel() == 1
    assert q.float().abs().max() == torch.finfo(dtype).max  # the scale fills the range
    back = q.float() / scale
    normal = x.abs() * scale > torch.finfo(dtype).tiny  # values in the format's normal range
    assert ((back - x).abs()[normal] <= relative * x.abs()[normal] + 1e-12).all()
    rows, row_scales = quantize(x, dtype, dim=-1)
    assert row_scales.shape == (64, 1) and (rows.float().abs().amax(-1) == torch.finfo(dtype).max).all()


def _by_hand(x, w, g, gradient_dtype):
    """Tensorwise FP8 products written out: quantise each operand, dequantise, multiply in fp32."""
    def qd(t, dtype):
        amax = t.abs().max()
        scale = torch.finfo(dtype).max / amax
        return (t * scale).clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype).float() / scale

    xd, wd, gd = qd(x, E4M3), qd(w, E4M3), qd(g, gradient_dtype)
    return xd @ wd.t(), gd @ wd, gd.t() @ xd


@pytest.mark.parametrize("gradient_format", ["e5m2", "e4m3"])
def test_forward_and_backward_products_on_non_square_shapes(gradient_format):
    torch.manual_seed(0)
    gradient_dtype = {"e5m2": E5M2, "e4m3": E4M3}[gradient_format]
    x = torch.randn(2, 12, 40, requires_grad=True)  # 24 tokens, 40 in, 56 out: every dim different
    w = (torch.randn(56, 40) * 0.1).requires_grad_()
    b = torch.randn(56, requires_grad=True)
    g = torch.randn(2, 12, 56) * torch.linspace(0.1, 3, 56)  # a real, uneven upstream gradient
    y = FP8Matmul(FP8Recipe(gradient_dtype))(x, w, b)
    y.backward(g)
    out, dx, dw = _by_hand(x.detach().reshape(24, 40), w.detach(), g.reshape(24, 56), gradient_dtype)
    assert torch.allclose(y.detach().reshape(24, 56), out + b.detach(), atol=1e-5)
    assert torch.allclose(x.grad.reshape(24, 40), dx, atol=1e-5)
    assert torch.allclose(w.grad, dw, atol=1e-5)
    assert torch.allclose(b.grad, g.sum((0, 1)))

    exact_x, exact_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.linear(exact_x, exact_w, b.detach()).backward(g)
    for fp8, exact, bound in ((y.detach(), torch.nn.functional.linear(x, w, b).detach(), 0.08),
                              (x.grad, exact_x.grad, 0.15), (w.grad, exact_w.grad, 0.15)):
        assert (fp8 - exact).norm() / exact.norm() < bound


def test_rowwise_scaling_is_closer_than_tensorwise_on_outlier_rows():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    x[3] *= 1e6  # one outlier token: tensorwise scaling crushes every other row towards zero
    w = torch.randn(48, 64) * 0.05
    exact = x @ w.t()
    errors = {}
    for rowwise in (False, True):
        y = FP8Matmul(FP8Recipe(E5M2, rowwise))(x, w)
        rest = torch.arange(32) != 3
        errors[rowwise] = ((y - exact)[rest].norm() / exact[rest].norm()).item()
    assert errors[True] < 0.1 < errors[False]


def _train(config: dict) -> list[dict]:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    converted = sum(isinstance(getattr(m, "matmul", None), FP8Matmul) for m in trainer.model.modules())
    trainer.train()
    if trainer.pc.rank != 0:
        return []
    records = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    return [{"converted": converted, **record} for record in records]


def test_a_tiny_model_trains_in_fp8_within_two_percent_of_its_twin(tiny_data, tmp_path):
    steps = 100
    configs = [tiny_config_dict(tiny_data, tmp_path / name, tokens={"train_steps": steps}, fp8={"enabled": enabled})
               for name, enabled in (("plain", False), ("fp8", True))]
    plain, fp8 = (run_distributed(_train, 1, config=config)[0] for config in configs)
    assert plain[0]["converted"] == 0 and fp8[0]["converted"] == 2 * 4  # qkv, o, gate_up, down in 2 layers
    assert plain[-1]["lm_loss"] < plain[0]["lm_loss"] - 2.0  # the twin learns
    assert abs(fp8[-1]["lm_loss"] - plain[-1]["lm_loss"]) <= 0.02 * plain[-1]["lm_loss"]


def test_fp8_at_tp_2_follows_tp_1(tiny_data, tmp_path):
    def config(name, tp, mode="ALL_REDUCE"):
        return tiny_config_dict(tiny_data, tmp_path / name, tokens={"train_steps": 6}, fp8={"enabled": True},
                                parallelism={"tp": tp, "tp_mode": mode})

    (reference,) = [r for r in run_distributed(_train, 1, config=config("tp1", 1)) if r]
    for ranks in run_distributed_each(_train, 2, [{"config": config("tp2", 2)},
                                                  {"config": config("tp2_sp", 2, "REDUCE_SCATTER")}]):
        (records,) = [r for r in ranks if r]
        for a, b in zip(reference, records, strict=True):
            # Each TP rank scales its own shards (amax over its slice): close, not bit-identical.
            assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=2e-3), a["step"]
