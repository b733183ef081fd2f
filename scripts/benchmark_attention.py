"""Causal attention alone on one CUDA device, at long sequences: which kernel a long-context step can count on.

    python scripts/benchmark_attention.py --output attention.json

At the Llama 1B attention shape (32 query heads over 8 key/value heads, head dimension 64, bf16, one sequence) each
variant runs forward, then forward + backward, of causal attention: ``sdpa-<backend>`` is
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` held to one backend (``default`` lets torch
choose, as the model does); ``sdpa-repeat-cudnn`` repeats the key/value heads first (the path for backends without
grouped heads); ``sdpa-cudnn-contiguous`` copies the heads-first views the model hands over into contiguous
tensors; ``flex`` is compiled flex attention with a causal ``BlockMask`` (the path of sliding windows and document
masking). Reported per variant: median milliseconds (CUDA events) and TFLOP/s over the causal FLOPs (``2·s²·d`` per
head forward; the backward counted as twice the forward, as the MFU of a training step counts it).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from benchmark_fused_loss import timed
from benchmark_record import kernel_parser, kernel_record
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa(backend: str | None, repeat: bool = False, contiguous: bool = False):
    def run(q, k, v, _mask):
        if contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if repeat:
            k, v = k.repeat_interleave(HEADS // KV_HEADS, dim=1), v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not repeat)
        with sdpa_kernel([BACKENDS[backend]]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not repeat)
    return run


def flex():
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v, mask: compiled(q, k, v, block_mask=mask, enable_gqa=True)


def main() -> None:
    parser = kernel_parser(__doc__, repeats=5)
    parser.add_argument("--sequence-lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    args = parser.parse_args()
    variants = {f"sdpa-{name}": sdpa(name) for name in BACKENDS}
    variants |= {"sdpa-default": sdpa(None), "sdpa-repeat-cudnn": sdpa("cudnn", repeat=True),
                 "sdpa-cudnn-contiguous": sdpa("cudnn", contiguous=True), "flex": flex()}
    results = []
    for length in args.sequence_lengths:
        q = torch.randn(1, length, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(1, length, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        for tensor in (q, k, v):
            tensor.requires_grad_()
        grad = torch.randn_like(q)
        mask = torch.compile(create_block_mask)(lambda b, h, qi, ki: qi >= ki, None, None, length, length,
                                                device="cuda")  # as the model builds it: no dense mask
        forward_flops = 2 * length * length * HEAD_DIM * HEADS  # causal: half of 4·s²·d
        for name, attention in variants.items():
            try:
                forward = timed(lambda: attention(q, k, v, mask), args.repeats)[0]
                both = timed(lambda: torch.autograd.grad(attention(q, k, v, mask), (q, k, v), grad), args.repeats)[0]
            except RuntimeError as error:  # a backend that refuses this shape
                results.append({"sequence_length": length, "variant": name, "error": str(error).split("\n")[0]})
                print(f"s {length:6d} {name:18s} refused: {str(error).splitlines()[0][:120]}", flush=True)
                continue
            row = {"sequence_length": length, "variant": name, "forward_ms": forward, "forward_backward_ms": both,
                   "forward_tflops": forward_flops / forward / 1e9,
                   "forward_backward_tflops": 3 * forward_flops / both / 1e9}
            results.append(row)
            print(f"s {length:6d} {name:18s} fwd {forward:8.2f} ms {row['forward_tflops']:6.0f} TFLOP/s   "
                  f"fwd+bwd {both:8.2f} ms {row['forward_backward_tflops']:6.0f} TFLOP/s", flush=True)
    record = kernel_record("attention", args.commit, results, shape={"heads": HEADS, "kv_heads": KV_HEADS,
                                                                     "head_dim": HEAD_DIM, "batch": 1,
                                                                     "dtype": "bfloat16"})
    if args.output:
        args.output.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
