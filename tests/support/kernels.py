"""Kernel checks, each against its plain-torch reference: run on the CPU through Triton's interpreter
(``run_with_triton_interpreter``) and on a GPU by ``test_cuda_kernels.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from support import ROOT


def fresh_python(code: str, **environment: str) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh process with ``environment`` added, the tests folder on its ``PYTHONPATH`` (so
    that it imports ``support`` and the test files)."""
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **environment, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=600)


def run_with_triton_interpreter(code: str) -> None:
    """Run ``code`` in a fresh Python with Triton's interpreter on (it is chosen when Triton is imported): how the
    CPU checks the GPU's Triton kernels against their plain-torch references. On a GPU host the CUDA tests check the
    kernels themselves, and the interpreter is not run: torch 2.11's ``wrap_triton`` refuses the interpreter's
    kernels, so every such check failed there."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the kernels themselves (tests/test_cuda_kernels.py and the CUDA tests beside this one)")
    done = fresh_python(code, TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr[-3000:]


def check_swiglu_kernel(device: str = "cpu") -> None:
    """The fused backward's kernel against the reference, fp32 and bf16, on a width that is not a multiple of its
    block."""
    from nanotron.nn.swiglu import swiglu_backward_fused, swiglu_backward_reference

    generator = torch.Generator(device).manual_seed(0)
    gate_up = torch.randn(3, 37, 2 * 1000, device=device, generator=generator)
    grad = torch.randn(3, 37, 1000, device=device, generator=generator)
    torch.testing.assert_close(swiglu_backward_fused(gate_up, grad), swiglu_backward_reference(gate_up, grad),
                               rtol=1e-5, atol=1e-6)
    bf16 = gate_up.bfloat16(), grad.bfloat16()
    torch.testing.assert_close(swiglu_backward_fused(*bf16), swiglu_backward_reference(*bf16))


def check_cast_both_layouts(device: str = "cpu") -> None:
    """``quantize_both_layouts`` (the Triton kernel on CUDA, or under Triton's interpreter on the CPU) against the
    plain-torch cast, bit for bit, in both formats: on a shape that is not a multiple of the kernel's tile, with
    values beyond the format's range (saturated). Off CUDA the inputs are grid points of the format times a power of
    two, so that no rounding happens: the interpreter rounds some values at the top of a binade down a whole binade
    (31.49 to 16 in e5m2), so rounding is left to the CUDA run, where the values are random."""
    from nanotron.nn.fp8 import E4M3, E5M2
    from nanotron.nn.fp8.cast_kernels import CAST_BLOCK_C, CAST_BLOCK_R, cast_both_layouts

    generator = torch.Generator().manual_seed(0)
    rows, columns = CAST_BLOCK_R + 7, CAST_BLOCK_C + 9
    for dtype in (E4M3, E5M2):
        finfo = torch.finfo(dtype)
        values = torch.randn(rows, columns, generator=generator) * 8
        if device == "cpu":
            values = values.to(dtype).float()  # grid points
        x = (values / 4).to(torch.bfloat16)
        x[0, 0], x[-1, -1] = finfo.max, -finfo.max  # four times the format's range at a scale of 4
        x = x.to(device)
        scale = torch.tensor(4.0, device=device)
        expected = (x.float() * scale).clamp(finfo.min, finfo.max).to(dtype)
        for record_amax in (True, False):
            out, out_t, amax = cast_both_layouts(x, scale, dtype, record_amax)
            assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), dtype
            assert torch.equal(out_t.view(torch.uint8), expected.t().contiguous().view(torch.uint8)), dtype
            assert amax.item() == (x.float().abs().max().item() if record_amax else 0)
            assert out[0, 0].float().item() == finfo.max


def check_chunked_scan(device: str = "cpu") -> None:
    """The chunked scan equals the loop, forward and every gradient, in fp32 and with bf16 activations, on shapes
    whose length and channels are not multiples of the kernels' blocks and a d_state that is not a power of 2; and
    token-by-token decoding with the carried state equals it over 256 tokens."""
    from nanotron.nn.selective_scan import BLOCK_D, BLOCK_T, chunked_selective_scan, selective_scan_reference

    generator = torch.Generator(device).manual_seed(0)
    for batch, length, channels, d_state in ((2, 2 * BLOCK_T + 5, BLOCK_D + 8, 16), (1, 3, 7, 5)):
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            def random(*shape, dtype=dtype):
                return torch.randn(*shape, device=device, generator=generator).to(dtype).requires_grad_()
            x, B, C = random(batch, length, channels), random(batch, length, d_state), random(batch, length, d_state)
            delta = torch.nn.functional.softplus(random(batch, length, channels, dtype=torch.float32)).detach()
            delta.requires_grad_()
            A = (-3 * torch.rand(channels, d_state, device=device, generator=generator)).requires_grad_()
            inputs = (x, delta, A, B, C)
            y, last = chunked_selective_scan(*inputs)
            reference, reference_last = selective_scan_reference(*inputs, torch.zeros(channels, device=device))
            assert y.dtype == dtype  # the kernels' output is rounded to the activations' dtype
            torch.testing.assert_close(y.float(), reference, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(last, reference_last, rtol=1e-5, atol=1e-5)
            upstream = torch.randn(y.shape, device=device, generator=generator).to(dtype)
            grads = torch.autograd.grad(y, inputs, upstream)
            expected = torch.autograd.grad(reference, inputs, upstream.float())
            for name, grad, want in zip(("x", "delta", "A", "B", "C"), grads, expected):
                assert grad.dtype == want.dtype, name
                error = (grad.float() - want.float()).abs().max() / want.float().abs().max()
                assert error < tolerance, (name, dtype, error.item())
    # Decoding one token at a time with the carried state (generation) gives the parallel scan's outputs.
    x, delta = (f(1, 256, 8, device=device, generator=generator) for f in (torch.randn, torch.rand))
    A = -torch.rand(8, 4, device=device, generator=generator)
    B, C = (torch.randn(1, 256, 4, device=device, generator=generator) for _ in range(2))
    parallel, _ = chunked_selective_scan(x, delta, A, B, C)
    state, steps = None, []
    for t in range(256):
        y, state = selective_scan_reference(x[:, t:t + 1], delta[:, t:t + 1], A, B[:, t:t + 1], C[:, t:t + 1],
                                            torch.zeros(8, device=device), state)
        steps.append(y)
    # 256 steps one at a time against the chunked order, exp against exp2: fp32 rounding, up to 4e-5 on H200.
    torch.testing.assert_close(torch.cat(steps, dim=1), parallel, rtol=1e-4, atol=1e-4)


def check_causal_conv(device: str = "cpu") -> None:
    """The conv + SiLU kernels equal the reference, forward and every gradient, in fp32 and bf16, with and without
    a bias, reading x as the first half of a wider tensor (as the mixer passes in_proj's output), on a length and a
    channel count that are not multiples of the kernels' blocks."""
    from nanotron.nn.causal_conv1d import BLOCK_C, BLOCK_T, causal_conv1d_silu_reference, conv_forward

    generator = torch.Generator(device).manual_seed(0)
    batch, length, channels = 2, BLOCK_T + 13, BLOCK_C + 5
    for bias in (True, False):
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):  # bf16: dpre is rounded to it
            def random(*shape, dtype=dtype):
                return torch.randn(*shape, device=device, generator=generator).to(dtype).requires_grad_()
            wide, weight = random(batch, length, 2 * channels), random(channels, 1, 4)
            inputs = [wide, weight] + ([random(channels)] if bias else [])
            x = wide[..., :channels]
            out = conv_forward(x, weight, inputs[2] if bias else None)  # the kernels on any device, not a dispatch
            reference = causal_conv1d_silu_reference(x, weight, inputs[2] if bias else None)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), reference.float(), rtol=tolerance, atol=tolerance)
            upstream = torch.randn(out.shape, device=device, generator=generator).to(dtype)
            grads = torch.autograd.grad(out, inputs, upstream)
            expected = torch.autograd.grad(reference, inputs, upstream)
            assert not grads[0][..., channels:].any()
            for name, grad, want in zip(("x", "weight", "bias"), grads, expected):
                assert grad.dtype == want.dtype, name
                error = (grad.float() - want.float()).abs().max() / want.float().abs().max()
                assert error < tolerance, (name, dtype, bias, error.item())


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def check_compiled_passes(device: str) -> None:
    """The compiled passes give the plain ones' losses and gradients (bf16, a padded vocabulary, a chunk size that
    does not divide the tokens): run on CUDA by test_cuda_kernels.py, where the compiler writes Triton kernels."""
    from nanotron.parallel.linear_cross_entropy import ChunkPasses, linear_cross_entropy

    generator = torch.Generator(device).manual_seed(0)
    tokens, hidden_size, padded, vocab_size = 3000, 256, 5008, 5000
    hidden = torch.randn(tokens, hidden_size, device=device, generator=generator).bfloat16()
    weight = (torch.randn(padded, hidden_size, device=device, generator=generator) * 0.05).bfloat16()
    labels = torch.randint(0, vocab_size, (tokens,), device=device, generator=generator)
    mask = torch.rand(tokens, device=device, generator=generator) > 0.1
    initialized = dist.is_initialized()
    if not initialized:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for passes in (ChunkPasses(), ChunkPasses.compiled()):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss, losses, _ = linear_cross_entropy(h, w, labels, mask / mask.sum(), dist.group.WORLD, vocab_size,
                                                   1024, passes)
            loss.backward()
            results.append((loss, losses, h.grad, w.grad))
    finally:
        if not initialized:
            dist.destroy_process_group()
    for name, compiled, plain, tolerance in zip(("loss", "token losses", "grad hidden", "grad weight"), results[1],
                                                results[0], (1e-6, 1e-6, 2 ** -8, 2 ** -8)):
        assert compiled.dtype == plain.dtype, name
        assert relative_error(compiled, plain) < tolerance, name


def check_softmax_statistics_kernel(device: str = "cpu") -> None:
    """The fused loss's statistics kernel against the reference: fp32 and bf16 logits, blocks that split a row or
    cover it, padding columns, a rank holding none of the real columns, and targets on other ranks (label -1)."""
    from nanotron.parallel.linear_cross_entropy import softmax_statistics_fused, softmax_statistics_reference

    generator = torch.Generator(device).manual_seed(0)
    logits = torch.randn(37, 1000, device=device, generator=generator) * 4
    labels = torch.randint(0, 990, (37,), device=device, generator=generator)
    labels[::5] = -1
    for dtype in (torch.float32, torch.bfloat16):
        for valid_columns in (1000, 990, 0):
            for block in (128, 1024):
                z, local = logits.to(dtype), labels.clamp(max=max(valid_columns - 1, -1))
                fused = softmax_statistics_fused(z, local, valid_columns, block)
                expected = softmax_statistics_reference(z, local, valid_columns)
                torch.testing.assert_close(fused, expected, rtol=1e-6, atol=0, msg=f"{dtype} {valid_columns} {block}")
