import pytest
import torch
import torch.distributed as dist
from torch import nn

from nanotron.config import LRSchedulerArgs, OptimizerArgs
from nanotron.optim.optimizer import build_optimizer, no_weight_decay
from nanotron.parallel.placement import annotate_placements


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in this process (the optimizer reduces over a data-parallel group)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def args(**kw):
    return OptimizerArgs(learning_rate_scheduler=LRSchedulerArgs(learning_rate=1e-2), **kw)


def build(params: dict[str, nn.Parameter], group, **kw):
    holder = nn.Module()
    for name, param in params.items():
        holder.register_parameter(name, param)
    annotate_placements(holder)
    return build_optimizer(params, args(**kw), bucket_mb=1.0, groups={("dp", "cp", "ep"): group})


def test_weight_decay_groups():
    assert no_weight_decay("layers.0.input_layernorm.weight", torch.ones(4), None)
    assert no_weight_decay("embed_tokens.weight", torch.ones(4, 4), None)
    assert not no_weight_decay("layers.0.attn.qkv_proj.weight", torch.ones(4, 4), None)
    assert no_weight_decay("layers.0.attn.qkv_proj.weight", torch.ones(4, 4), ["qkv"])
    assert not no_weight_decay("norm.weight", torch.ones(4), ["qkv"])


def test_decayed_and_exempt_parameters_live_in_separate_buckets(group):
    params = {"w": nn.Parameter(torch.ones(4, 4)), "norm": nn.Parameter(torch.ones(4))}
    buckets, optimizer = build(params, group, weight_decay=0.5)
    decays = {name: bucket.weight_decay for bucket in buckets.buckets for name in bucket.names}
    assert decays == {"w": True, "norm": False}
    for param in params.values():  # zero gradients: only weight decay moves the weights
        (param * 0).sum().backward()
    buckets.final_micro_batch = True
    buckets.finish_reduction()
    optimizer.step(1e-1)
    assert torch.all(params["w"] < 1) and torch.equal(params["norm"], torch.ones(4))


@pytest.mark.parametrize("remainders", [True, False])
def test_bf16_model_updates_fp32_masters_and_copies_back(group, remainders):
    """Masters held as an fp32 copy or as the bf16 weights' remainders keep what the weights cannot."""
    param = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    buckets, optimizer = build({"w": param}, group, weight_decay=0.0, store_param_remainders=remainders)
    assert optimizer.master_state[0].dtype == (torch.int16 if remainders else torch.float32)
    for _ in range(3):
        (param.float() * 1e-3).sum().backward()
        buckets.finish_reduction()
        optimizer.step(1e-5)
        buckets.zero()
    # 3 Adam steps of 1e-5 are invisible in bf16 around 1.0 but kept by the fp32 master.
    assert torch.equal(param, torch.ones(8, dtype=torch.bfloat16))
    torch.testing.assert_close(optimizer.master(0), torch.full((8,), 1 - 3e-5), rtol=0, atol=1e-7)


def test_parameter_without_gradient_in_a_step_has_zero_gradient(group):
    used, unused = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    buckets, _ = build({"used": used, "unused": unused}, group)
    (used * unused).sum().backward()
    buckets.finish_reduction()
    assert torch.equal(buckets.gradient("unused"), torch.ones(4))
    buckets.zero()
    (used * 3).sum().backward()  # "unused" gets no gradient this step: its buffer must not keep the last one
    buckets.final_micro_batch = True
    buckets.finish_reduction()
    assert torch.equal(buckets.gradient("used"), torch.full((4,), 3.0))
    assert torch.equal(buckets.gradient("unused"), torch.zeros(4))


def test_adamw_update_matches_torch_adamw():
    from nanotron.optim.adamw import AdamWHyperparameters, adamw_update_

    generator = torch.Generator().manual_seed(0)
    reference = nn.Parameter(torch.randn(1000, generator=generator))
    torch_adamw = torch.optim.AdamW([reference], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    master, weights = reference.detach().clone(), torch.empty(1000, dtype=torch.bfloat16)
    exp_avg, exp_avg_sq, initial = torch.zeros(1000), torch.zeros(1000), master.clone()
    for step in range(1, 6):
        grad, clip = torch.randn(1000, generator=generator), torch.tensor(0.5 if step % 2 else 1.0)
        reference.grad = grad * clip
        torch_adamw.step()
        hyper = AdamWHyperparameters.at_step(step, 3e-3, 0.9, 0.95, 1e-8, 0.1, clip, torch.device("cpu"))
        adamw_update_(master, grad, exp_avg, exp_avg_sq, weights, hyper)
    torch.testing.assert_close(master, reference.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg_sq, torch_adamw.state[reference]["exp_avg_sq"], rtol=1e-6, atol=1e-12)
    assert torch.equal(weights, master.to(torch.bfloat16))
    assert (master - initial).abs().mean() > 1e-3  # the weights moved


def test_global_grad_norm_is_accurate_for_large_gradients(group):
    from types import SimpleNamespace

    from nanotron.optim.clip import GlobalGradNorm

    # fp32 norms summed sequentially drift by ~1e-4 at this size; the global norm must not.
    params = {"big": nn.Parameter(torch.zeros(4_000_000)), "small": nn.Parameter(torch.zeros(10))}
    buckets, _ = build(params, group)
    generator = torch.Generator().manual_seed(0)
    grads = {name: torch.randn(p.shape, generator=generator) * 1e-3 for name, p in params.items()}
    sum((p * grads[name]).sum() for name, p in params.items()).backward()
    buckets.finish_reduction()
    context = SimpleNamespace(coordinates={"pp": 0, "dp": 0, "ep": 0, "cp": 0, "tp": 0},
                              sizes={"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": 1},
                              device=torch.device("cpu"))
    exact = torch.cat([g.double() for g in grads.values()]).norm().item()
    assert abs(GlobalGradNorm(buckets, context)().item() - exact) / exact < 1e-7


def test_coalesced_joins_only_views_that_follow_each_other_in_one_buffer():
    from nanotron.optim.clip import coalesced

    buffer, other = torch.arange(20.0), torch.arange(5.0)
    pieces = [buffer[0:3], buffer[3:8], buffer[10:12], buffer[12:20], other[0:2], other[2:5]]
    joined = coalesced(pieces)
    assert [(p.storage_offset(), p.numel()) for p in joined] == [(0, 8), (10, 10), (0, 5)]
    assert joined[0]._base is buffer and joined[2]._base is other
    assert torch.equal(torch.cat(joined), torch.cat(pieces))


SCALES = torch.rand(64, generator=torch.Generator().manual_seed(0)) + 1.0


def _accumulated_gradient(group, accumulate_in_fp32: bool) -> torch.Tensor:
    param = nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    buckets, _ = build({"w": param}, group, accumulate_grad_in_fp32=accumulate_in_fp32)
    for scale in SCALES:
        (param * scale.item() / 64).sum().backward()
    return buckets.gradient("w")


def test_fp32_accumulation_is_closer_to_the_exact_sum(group):
    # Each micro-batch gradient is itself bf16; the exact sum is over those rounded values.
    exact = sum(torch.tensor(s.item() / 64, dtype=torch.bfloat16).double() for s in SCALES)
    fp32 = (_accumulated_gradient(group, True).double() - exact).abs().max()
    bf16 = (_accumulated_gradient(group, False).double() - exact).abs().max()
    assert fp32 < 1e-6 and bf16 > 100 * fp32 and bf16 > 1e-3


def test_state_round_trip_keeps_fp32_moments(group):
    param = nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    buckets, optimizer = build({"w": param}, group)
    param.float().pow(2).sum().backward()
    optimizer.step(1e-2)
    (saved,) = [{name: {k: t.clone() for k, t in kinds.items()} for name, kinds in states.items()}
                for states in optimizer.bucket_states()]
    assert saved["w"]["exp_avg"].dtype == torch.float32 and set(saved["w"]) == {"exp_avg", "exp_avg_sq", "master"}

    fresh_param = nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    _, fresh = build({"w": fresh_param}, group)
    fresh.load_bucket_states(lambda name, kind, out: out.copy_(saved[name][kind]), step=optimizer.step_count)
    assert fresh.step_count == 1
    (restored,) = list(fresh.bucket_states())
    for key, value in restored["w"].items():
        assert torch.equal(value, saved["w"][key]), key
    assert torch.equal(fresh_param, param)


def test_fp32_parameter_among_bf16_ones_keeps_its_precision(group):
    """State a model keeps in fp32 (state-space decay rates, router weights) gets buckets of its own dtype."""
    # Both are decayed matrices, so they used to share a bucket, which took the dtype of its first parameter (w).
    params = {"a_log": nn.Parameter(torch.full((2, 4), 1.0001)),
              "w": nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))}
    buckets, optimizer = build(params, group)
    assert {b.params.dtype for b in buckets.buckets} == {torch.bfloat16, torch.float32}
    assert params["a_log"].dtype == torch.float32 and torch.equal(params["a_log"], torch.full((2, 4), 1.0001))
    (params["w"].float().sum() + params["a_log"].sum()).backward()
    buckets.final_micro_batch = True
    buckets.finish_reduction()
    optimizer.step(1e-5)
    step = (params["a_log"] - 1.0001).abs()
    assert params["a_log"].dtype == torch.float32 and torch.all((step > 5e-6) & (step < 2e-5))  # invisible in bf16


@pytest.mark.slow
def test_the_weights_are_freed_with_their_buckets_and_optimizer(group):
    """The gradient hooks must not keep the buckets, and through them the weights, alive (a process that trains
    twice, as the benchmark does, kept every earlier model)."""
    import gc
    import weakref

    param = nn.Parameter(torch.ones(8))
    buckets, optimizer = build({"w": param}, group)
    (param * 2).sum().backward()
    buckets.finish_reduction()
    optimizer.step(1e-3)
    alive = weakref.ref(param)
    del param, buckets, optimizer
    gc.collect()
    assert alive() is None
