import torch
from torch import nn

from nanotron.config import LRSchedulerArgs, OptimizerArgs
from nanotron.optim.optimizer import MixedPrecisionAdamW, no_weight_decay


def args(**kw):
    return OptimizerArgs(learning_rate_scheduler=LRSchedulerArgs(learning_rate=1e-2), **kw)


def test_weight_decay_groups():
    assert no_weight_decay("layers.0.input_layernorm.weight", torch.ones(4), None)
    assert no_weight_decay("embed_tokens.weight", torch.ones(4, 4), None)
    assert not no_weight_decay("layers.0.attn.qkv_proj.weight", torch.ones(4, 4), None)
    assert no_weight_decay("layers.0.attn.qkv_proj.weight", torch.ones(4, 4), ["qkv"])
    assert not no_weight_decay("norm.weight", torch.ones(4), ["qkv"])


def test_bf16_model_updates_fp32_masters_and_copies_back():
    param = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = MixedPrecisionAdamW({"w": param}, args(weight_decay=0.0))
    assert opt.masters["w"].dtype == torch.float32
    for _ in range(3):
        (param.float() * 1e-3).sum().backward()
        opt.main_gradients()
        opt.step(1e-5)
        opt.zero_grad()
    # 3 Adam steps of 1e-5 are invisible in bf16 around 1.0 but kept by the fp32 master.
    assert torch.equal(param, torch.ones(8, dtype=torch.bfloat16))
    torch.testing.assert_close(opt.masters["w"], torch.full((8,), 1 - 3e-5), rtol=0, atol=1e-7)


SCALES = torch.rand(64, generator=torch.Generator().manual_seed(0)) + 1.0


def _accumulated_gradient(accumulate_in_fp32: bool) -> torch.Tensor:
    param = nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    opt = MixedPrecisionAdamW({"w": param}, args(accumulate_grad_in_fp32=accumulate_in_fp32))
    for scale in SCALES:
        (param * scale.item() / 64).sum().backward()
    return opt.main_gradients()["w"]


def test_fp32_accumulation_is_closer_to_the_exact_sum():
    # Each micro-batch gradient is itself bf16; the exact sum is over those rounded values.
    exact = sum(torch.tensor(s.item() / 64, dtype=torch.bfloat16).double() for s in SCALES)
    fp32 = (_accumulated_gradient(True).double() - exact).abs().max()
    bf16 = (_accumulated_gradient(False).double() - exact).abs().max()
    assert fp32 < 1e-6 and bf16 > 100 * fp32 and bf16 > 1e-3


def test_state_round_trip_keeps_fp32_moments():
    param = nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    opt = MixedPrecisionAdamW({"w": param}, args())
    param.float().pow(2).sum().backward()
    opt.main_gradients()
    opt.step(1e-2)
    saved = {k: {s: t.clone() for s, t in v.items()} for k, v in opt.state_tensors().items()}
    assert saved["w"]["exp_avg"].dtype == torch.float32 and set(saved["w"]) == {"exp_avg", "exp_avg_sq", "master"}

    fresh_param = nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    fresh = MixedPrecisionAdamW({"w": fresh_param}, args())
    fresh.load_state_tensors(saved, step=opt.step_count)
    assert fresh.step_count == 1
    for key, value in fresh.state_tensors()["w"].items():
        assert torch.equal(value, saved["w"][key]), key
    assert torch.equal(fresh_param, param)
