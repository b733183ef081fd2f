"""Parity of the GPU fast paths with their plain-torch references (skipped without CUDA; run on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

from nanotron.optim.adamw import AdamWHyperparameters, adamw_update_, adamw_update_function

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_compiled_adamw_matches_the_reference(moments):
    device = torch.device("cuda")
    compiled = adamw_update_function(device, fused=True, remainders=False)
    assert compiled is not adamw_update_
    generator = torch.Generator(device).manual_seed(0)
    for numel in (1000, 3 * 2**20 + 7):  # two sizes: one compiled kernel serves every shard size
        state = {"master": torch.randn(numel, device=device, generator=generator)}
        state["exp_avg"], state["exp_avg_sq"] = (torch.zeros_like(state["master"], dtype=moments) for _ in range(2))
        fast = {k: v.clone() for k, v in state.items()}
        weights, fast_weights = (torch.empty(numel, dtype=torch.bfloat16, device=device) for _ in range(2))
        for step in range(1, 4):
            grad = torch.randn(numel, device=device, generator=generator)
            hyper = AdamWHyperparameters.at_step(step, 1e-3, 0.9, 0.95, 1e-8, 0.1,
                                                 torch.tensor(0.7, device=device), device)
            adamw_update_(state["master"], grad, state["exp_avg"], state["exp_avg_sq"], weights, hyper)
            compiled(fast["master"], grad, fast["exp_avg"], fast["exp_avg_sq"], fast_weights, hyper)
        if moments == torch.float32:
            for key in state:
                torch.testing.assert_close(fast[key], state[key], rtol=1e-6, atol=1e-7)
        else:  # the fused kernel's fp32 moments may round to the neighbouring bf16 value, and the next steps read it
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(fast[key], state[key], rtol=2**-6, atol=2**-9)
            # each step moves a master by about lr (1e-3); a moment one bf16 step away moves it by under 1%
            torch.testing.assert_close(fast["master"], state["master"], rtol=0, atol=1e-4)
        assert torch.equal(fast_weights, fast["master"].to(torch.bfloat16))


def test_fused_swiglu_backward_matches_the_reference_and_autograd():
    from nanotron.nn.swiglu import swiglu
    from support.kernels import check_swiglu_kernel

    check_swiglu_kernel("cuda")
    generator = torch.Generator("cuda").manual_seed(0)
    gate_up = torch.randn(3, 37, 2 * 1000, device="cuda", generator=generator)
    grad = torch.randn(3, 37, 1000, device="cuda", generator=generator)
    leaf = gate_up.double().requires_grad_()
    gate, up = leaf.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(grad.double())
    eager_leaf = gate_up.clone().requires_grad_()
    swiglu(eager_leaf).backward(grad)
    compiled_leaf = gate_up.clone().requires_grad_()
    torch.compile(swiglu, fullgraph=True)(compiled_leaf).backward(grad)
    for leaf_grad in (eager_leaf.grad, compiled_leaf.grad):
        torch.testing.assert_close(leaf_grad.double(), leaf.grad, rtol=1e-5, atol=1e-6)


def test_fp32_multi_tensor_norm_is_accurate_on_cuda():
    # The global grad-norm relies on this on CUDA (on CPU it accumulates in fp64, see optim/clip.py).
    pieces = [torch.randn(n, device="cuda") * 1e-3 for n in (4_000_000, 10, 263_000_000)]
    norms = torch._foreach_norm(pieces, 2, dtype=torch.float32)
    for piece, norm in zip(pieces, norms):
        exact = piece.double().norm()
        assert abs(norm.double() - exact) / exact < 1e-6


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_grouped_gemm_experts_match_the_loop_in_bf16_forward_and_backward():
    from nanotron.models.moe.model import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(8, 256, 512).cuda().bfloat16()
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    counts = torch.tensor([100, 0, 37, 250, 1, 64, 3, 57], device="cuda")  # uneven, one expert idle
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    upstream = torch.randn_like(x)
    results = []
    for grouped in (False, True):
        experts.grouped_mm = grouped
        inputs = x.clone().requires_grad_()
        out = experts(inputs, counts)
        (out.float() * upstream.float()).sum().backward()
        results.append([out, inputs.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()])
        experts.zero_grad()
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(256, 512, 384), (37, 40, 24)], ids=["aligned", "padded"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_fp8_scaled_mm_matches_the_emulation(rowwise, shape):
    from nanotron.nn.fp8 import E5M2, FP8Matmul, FP8Recipe

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    torch.manual_seed(0)
    tokens, features_in, features_out = shape  # "padded": no dimension a multiple of 16, as MoE experts' tokens
    x = torch.randn(tokens, features_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(features_out, features_in, device="cuda", dtype=torch.bfloat16) * 0.05
    g = torch.randn(tokens, features_out, device="cuda", dtype=torch.bfloat16)
    matmul = FP8Matmul(FP8Recipe(E5M2, rowwise))
    results = []
    # Eager and compiled on CUDA (the compiler builds the Triton cast kernels itself, with its own argument types);
    # on the CPU the same quantisation, multiplied in fp32.
    for device, run in (("cuda", matmul), ("cuda", torch.compile(matmul)), ("cpu", matmul)):
        xi, wi = x.to(device).clone().requires_grad_(), w.to(device).clone().requires_grad_()
        y = run(xi, wi)
        y.backward(g.to(device))
        results.append([t.float().cpu() for t in (y, xi.grad, wi.grad)])
    eager, compiled, emulated = results
    for fast, fast_compiled, reference in zip(eager, compiled, emulated):
        torch.testing.assert_close(fast, reference, rtol=2e-2, atol=2e-2)
        # The compiler computes a scale as reciprocal times the format's maximum, an ulp away from the division, and
        # values of bf16 inputs often sit on a rounding tie of the FP8 grid: a few casts round the other way, by a
        # whole e5m2 step. Compared as a whole, the products agree; a wrong scale or layout is off by far more.
        assert (fast_compiled - fast).norm() <= 1e-2 * fast.norm()


def test_fp8_cast_kernel_matches_the_plain_cast_on_cuda():
    from support.kernels import check_cast_both_layouts

    check_cast_both_layouts("cuda")


def test_chunked_selective_scan_matches_the_loop_on_cuda():
    from support.kernels import check_chunked_scan

    check_chunked_scan("cuda")


def test_causal_conv_kernels_match_the_reference_on_cuda():
    from support.kernels import check_causal_conv

    check_causal_conv("cuda")


def test_compiled_mamba_mixer_matches_the_reference_mixer():
    """The GPU path (compiled mixer: conv and scan kernels) against the same mixer run eagerly with the plain-torch
    conv and loop scan, output and every parameter's gradient, in fp32."""
    import nanotron.models.mamba.model as mamba
    import nanotron.nn.causal_conv1d as conv
    from nanotron.config import MambaConfig, MambaSSMArgs
    from nanotron.nn.selective_scan import selective_scan_reference

    torch.manual_seed(0)
    config = MambaConfig(d_model=96, num_hidden_layers=1, vocab_size=64, ssm_cfg=MambaSSMArgs(d_state=16))
    mixer = mamba.MambaMixer(config).cuda()
    for name, parameter in mixer.named_parameters():
        initial = torch.empty_like(parameter.cpu())
        mamba.mamba_init_rule(name, config, 0.1)(initial, torch.Generator().manual_seed(1))
        with torch.no_grad():
            parameter.copy_(initial)
    h = torch.randn(2, 100, 96, device="cuda")
    upstream = torch.randn(2, 100, 96, device="cuda")

    def run(forward):
        mixer.zero_grad()
        out = forward(h)
        out.backward(upstream)
        return out.detach(), {name: p.grad.clone() for name, p in mixer.named_parameters()}

    fast = run(torch.compile(mixer))
    scan, conv_silu = mamba.selective_scan, conv.causal_conv1d_silu
    mamba.selective_scan, conv.causal_conv1d_silu = selective_scan_reference, conv.causal_conv1d_silu_reference
    try:
        reference = run(mixer)
    finally:
        mamba.selective_scan, conv.causal_conv1d_silu = scan, conv_silu
    torch.testing.assert_close(fast[0], reference[0], rtol=1e-4, atol=1e-5)
    for name, grad in reference[1].items():
        torch.testing.assert_close(fast[1][name], grad, rtol=1e-3, atol=1e-3 * grad.abs().max().item(), msg=name)


def test_compiled_fused_loss_passes_match_the_plain_ones_on_cuda():
    from support.kernels import check_compiled_passes, check_softmax_statistics_kernel

    check_softmax_statistics_kernel("cuda")
    check_compiled_passes("cuda")


@pytest.mark.parametrize("remainders", [False, True])
def test_compiled_muon_elementwise_steps_match_the_plain_ones(remainders):
    from nanotron.optim.muon import _compiled, apply_update_, momentum_step_, scaled_copy_
    from nanotron.optim.param_remainders import joined, split_

    generator = torch.Generator("cuda").manual_seed(0)
    numel = 3 * 2**20 + 7
    grad = torch.randn(numel, device="cuda", generator=generator, dtype=torch.bfloat16)
    multiplier, lr = torch.tensor(0.7, device="cuda"), torch.tensor(2e-3, device="cuda")
    results = []
    for momentum_fn, copy_fn, apply_fn in ((momentum_step_, scaled_copy_, apply_update_),
                                           (_compiled(momentum_step_), _compiled(scaled_copy_),
                                            _compiled(apply_update_))):
        momentum = torch.ones(numel, device="cuda")
        direction, update = torch.empty(numel, device="cuda"), torch.empty(numel, device="cuda")
        masters = torch.randn(numel, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        weights = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
        state = torch.empty(numel, dtype=torch.int16, device="cuda") if remainders else masters.clone()
        if remainders:
            split_(masters, weights, state)
        else:
            weights.copy_(masters)
        momentum_fn(momentum, grad, direction, multiplier, 0.95, True)
        copy_fn(update, direction.to(torch.bfloat16), torch.tensor(0.3, device="cuda"))
        apply_fn(state, weights, update, lr, 0.1, remainders)
        if remainders:
            state = joined(weights, state)
        else:  # the weights are the new fp32 masters, rounded
            assert torch.equal(weights, state.to(torch.bfloat16))
        results.append((momentum, direction, update, state))
    for plain, compiled in zip(*results):  # the compiler may contract a product and a sum: the last bit may differ
        torch.testing.assert_close(compiled, plain, rtol=1e-6, atol=1e-7)
