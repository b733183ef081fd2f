"""FlashAttention-4's kernels as nanotron calls them, against an fp32 reference on a GPU (skipped without CUDA and the
``fa4`` extra; ``test_flash_attention.py`` checks the rest on the CPU): outputs and gradients of causal, grouped-query,
sliding-window, document-masked and context-parallel-chunk attention in bf16, within bf16's error of the reference,
and no further from it than torch's bf16 SDPA under the same mask."""

from __future__ import annotations

import pytest
import torch

from nanotron.nn import flash_attention
from nanotron.nn.attention import AttentionMasks, FlashMask, attend
from support.kernels import relative_error
from support.tiers import require_gpu

SEQUENCE = 2048
CASES = {  # name: (q heads, kv heads, head dim, window, documents?, query runs of cp rank 1 of 2)
    "causal": (16, 16, 128, None, False, None),
    "gqa": (32, 8, 64, None, False, None),
    "window": (32, 8, 64, 300, False, None),
    "documents": (32, 8, 64, None, True, None),
    "documents and window": (16, 8, 128, 200, True, None),
    "cp chunks": (32, 8, 64, None, False, ((512, 512), (1024, 512))),
}


def _documents(generator: torch.Generator) -> torch.Tensor:
    """Two rows of packed documents of 1 to 699 tokens."""
    lengths = torch.randint(1, 700, (2, SEQUENCE), generator=generator)
    ends = lengths.cumsum(1)
    starts = torch.zeros(2, SEQUENCE, dtype=torch.long)
    for row in range(2):
        cuts = ends[row][ends[row] < SEQUENCE]
        starts[row, cuts] = 1
    return starts.cumsum(1).cuda()


def _run(q, k, v, grad, mask):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = attend(*leaves, mask)
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("case", CASES)
def test_fa4_matches_an_fp32_reference_within_bf16_error(case):
    require_gpu((9, 0))
    if flash_attention.unavailable(torch.device("cuda"), torch.bfloat16, 64) is not None:
        pytest.skip(flash_attention.unavailable(torch.device("cuda"), torch.bfloat16, 64))
    q_heads, kv_heads, head_dim, window, documented, runs = CASES[case]
    generator = torch.Generator().manual_seed(0)
    queries = SEQUENCE if runs is None else sum(length for _, length in runs)
    shapes = [(2, q_heads, queries, head_dim), (2, kv_heads, SEQUENCE, head_dim), (2, kv_heads, SEQUENCE, head_dim),
              (2, q_heads, queries, head_dim)]
    q, k, v, grad = (torch.randn(shape, generator=generator).cuda() for shape in shapes)
    documents = _documents(generator) if documented else None
    if runs is None:
        masks = [AttentionMasks.of_sequence(SEQUENCE, q.device, documents=documents, flash=flash)
                 for flash in (True, False)]
    else:
        rows = torch.cat([torch.arange(first, first + length) for first, length in runs]).cuda()
        masks = [AttentionMasks(rows, torch.arange(SEQUENCE, device="cuda"), query_runs=runs, flash=flash)
                 for flash in (True, False)]
    fa4 = masks[0].for_window(window)
    assert isinstance(fa4, FlashMask)
    dense = masks[1].dense(window)  # the reference: SDPA's math in fp64 with the rule's dense mask
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = _run(q.double(), k.double(), v.double(), grad.double(), dense)
    bf16 = [x.bfloat16() for x in (q, k, v, grad)]
    got, baseline = _run(*bf16, fa4), _run(*bf16, dense)  # and torch's bf16 SDPA under the same mask
    for name, g, b, e in zip(("out", "dq", "dk", "dv"), got, baseline, expected):
        error, torch_error = relative_error(g.double(), e), relative_error(b.double(), e)
        assert error < 1e-2, (name, error)
        assert error <= 1.5 * torch_error + 1e-3, (name, error, torch_error)
