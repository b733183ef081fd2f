"""The two passes over every gradient outside the backward and the optimizer, on one CUDA device.

    python scripts/benchmark_gradient_passes.py --output gradient_passes.json

The copy: every parameter's first gradient of a step is copied into its slice of the bucket's flat buffer
(``parallel/data_parallel.py``), ``copy_`` against the multi-tensor copy. The norm: the global gradient norm
(``optim/clip.py``) reads the buffer, as one multi-tensor norm over a piece per parameter or over the coalesced
pieces, or as one ``torch.linalg.vector_norm`` per piece. The gradients have the mixtral preset's parameter shapes (16
layers of 8 experts, hidden 2048, ffn 4096; the dense weights and both vocabulary matrices), in bf16; the buffer is
bf16 (one micro-batch, no replica) or fp32 (accumulation). Reported per buffer dtype and method: the median time of
the pass over every gradient (ms, CUDA events) and its bandwidth (bytes read plus bytes written over time).
"""

from __future__ import annotations

import json

import torch
from benchmark_record import kernel_parser, kernel_record, median_cuda_ms

from nanotron.optim.clip import coalesced
from nanotron.parallel.data_parallel import copy_gradient

LAYERS, EXPERTS, HIDDEN, FFN, VOCAB = 16, 8, 2048, 4096, 32000
SHAPES = ([(EXPERTS, 2 * FFN, HIDDEN), (EXPERTS, HIDDEN, FFN), (3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN)] * LAYERS
          + [(VOCAB, HIDDEN)] * 2)
COPIES = {
    "copy_": lambda buffer, grad: buffer.copy_(grad),
    "foreach_copy_": lambda buffer, grad: torch._foreach_copy_([buffer], [grad]),
    "hook (copy_gradient)": copy_gradient,
}
NORMS = {
    "foreach_norm per parameter": lambda pieces: torch._foreach_norm(pieces, 2, dtype=torch.float32),
    "foreach_norm coalesced": lambda pieces: torch._foreach_norm(coalesced(pieces), 2, dtype=torch.float32),
    "vector_norm per parameter": lambda pieces: [torch.linalg.vector_norm(p, dtype=torch.float32) for p in pieces],
    "vector_norm coalesced": lambda pieces: [torch.linalg.vector_norm(p, dtype=torch.float32)
                                             for p in coalesced(pieces)],
}


def measured(kind: str, buffer_dtype: torch.dtype, method: str, ms: float, moved_bytes: int) -> dict:
    print(f"{kind} {buffer_dtype} {method:28s} {ms:6.2f} ms  {moved_bytes / ms / 1e9:5.2f} TB/s", flush=True)
    return {"pass": kind, "buffer_dtype": str(buffer_dtype), "method": method, "ms": ms,
            "tb_per_s": moved_bytes / ms / 1e9}


def main() -> None:
    parser = kernel_parser(__doc__, repeats=20)
    args = parser.parse_args()
    grads = [torch.randn(shape, device="cuda", dtype=torch.bfloat16).flatten() for shape in SHAPES]
    total = sum(g.numel() for g in grads)
    results = []
    for buffer_dtype in (torch.bfloat16, torch.float32):
        buffer = torch.empty(total, device="cuda", dtype=buffer_dtype)
        slices = list(buffer.split([g.numel() for g in grads]))
        size = buffer.element_size()
        for method, copy in COPIES.items():
            ms = median_cuda_ms(lambda: [copy(s, g) for s, g in zip(slices, grads)], args.repeats)
            assert all(torch.equal(s, g.to(buffer_dtype)) for s, g in zip(slices, grads))
            results.append(measured("copy", buffer_dtype, method, ms, total * (grads[0].element_size() + size)))
        exact = torch.linalg.vector_norm(buffer, dtype=torch.float64)
        for method, norm in NORMS.items():
            ms = median_cuda_ms(lambda: norm(slices), args.repeats)
            assert torch.isclose(torch.stack(norm(slices)).double().norm(), exact, rtol=1e-4)
            results.append(measured("norm", buffer_dtype, method, ms, total * size))
    if args.output:
        record = kernel_record("gradient-passes", args.commit, results, gradient_elements=total)
        args.output.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
