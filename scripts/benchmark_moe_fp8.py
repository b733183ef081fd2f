"""The MoE experts' forward and backward in FP8 on CUDA: nanotron's grouped path beside torchao's, and bf16.

    python scripts/benchmark_moe_fp8.py --output moe_fp8.json [--commit C]

At the mixtral preset's expert shapes (8 experts, hidden 2048, ffn 4096) and one micro-batch's assignments (2 × 4096
tokens, top-2: 16,384 rows in 8 uneven groups), one layer's experts (gate|up product, SwiGLU, down product), forward
and backward, compiled as the trainer compiles a layer, three ways:

- ``bf16``: ``GroupedExperts`` on ``torch._grouped_mm``;
- ``nanotron-fp8``: the same module with ``FP8ExpertMatmul`` (``nn/fp8/grouped.py``): rowwise e4m3 casts by Triton
  kernels, each expert's tokens padded to 16 rows, two ``torch._scaled_grouped_mm`` products each way;
- ``torchao-fp8``: torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (``torchao.prototype.moe_training``: rowwise
  e4m3 with power-of-two scales, its own fused casts) for both products, on the same padded layout.

Times are medians of CUDA events (ms) over ``--repeats`` steps; each FP8 way's output and gradients (input, both
weights) are given as relative error norms against the bf16 way's, which a wrong backward would show.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from benchmark_record import kernel_record, median_cuda_ms

from nanotron.models.moe.model import GroupedExperts, _grouped_layout
from nanotron.nn.fp8 import GROUPED_ALIGNMENT
from nanotron.nn.fp8.grouped import FP8ExpertMatmul
from nanotron.nn.glu import glu

EXPERTS, HIDDEN, FFN, ROWS = 8, 2048, 4096, 16384


def torchao_experts(experts: GroupedExperts, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``experts`` on ``x`` grouped by expert, each product torchao's FP8 grouped GEMM."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as fp8_grouped_mm

    padded, rows, ends = _grouped_layout(x, tokens_per_expert, GROUPED_ALIGNMENT)
    hidden = glu(fp8_grouped_mm(padded, experts.gate_up_proj.transpose(-2, -1), ends,
                                pad_token_groups_for_grouped_mm=False), experts.activation)
    out = fp8_grouped_mm(hidden, experts.down_proj.transpose(-2, -1), ends, pad_token_groups_for_grouped_mm=False)
    return out.index_select(0, rows)


def variants() -> dict:
    fp8 = GroupedExperts(EXPERTS, HIDDEN, FFN)
    fp8.expert_matmul = FP8ExpertMatmul()
    return {"bf16": (GroupedExperts(EXPERTS, HIDDEN, FFN), lambda e, x, t: e(x, t)),
            "nanotron-fp8": (fp8, lambda e, x, t: e(x, t)),
            "torchao-fp8": (GroupedExperts(EXPERTS, HIDDEN, FFN), torchao_experts)}


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).norm() / reference.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="results as JSON")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--commit", help="the commit measured, where the checkout has no git metadata")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA device")
    generator = torch.Generator("cuda").manual_seed(0)
    # Uneven groups, as a router gives them: shares from random logits.
    shares = torch.randn(EXPERTS, device="cuda", generator=generator).mul(0.5).softmax(0)
    tokens_per_expert = (shares * ROWS).floor().long()
    tokens_per_expert[0] += ROWS - tokens_per_expert.sum()
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
    grad = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
    weights = {"gate_up_proj": torch.randn(EXPERTS, 2 * FFN, HIDDEN, device="cuda", generator=generator) * 0.02,
               "down_proj": torch.randn(EXPERTS, HIDDEN, FFN, device="cuda", generator=generator) * 0.01}
    results, reference = {}, None
    for name, (experts, forward) in variants().items():
        experts = experts.to(device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for parameter, value in weights.items():
                getattr(experts, parameter).copy_(value)
        leaf = x.clone().requires_grad_()
        results[name], out = {}, None
        for run in (torch.compile(forward), forward):  # eager where the compiler refuses the way: said in the record

            def step(run=run):
                leaf.grad = None
                experts.zero_grad(set_to_none=True)
                out = run(experts, leaf, tokens_per_expert)
                out.backward(grad)
                return out

            try:
                out = step()
                break
            except Exception as error:  # torchao absent, or its op refused
                results[name].setdefault("errors", []).append(f"{type(error).__name__}: {str(error).splitlines()[0]}")
        if out is None:
            print(f"{name}: {results[name]}")
            continue
        values = {"output": out.detach(), "grad_input": leaf.grad.clone(),
                  **{f"grad_{p}": getattr(experts, p).grad.clone() for p in weights}}
        results[name] |= {"compiled": run is not forward, "ms": median_cuda_ms(step, args.repeats)}
        if reference is None:
            reference = values
        else:
            results[name]["relative_error"] = {key: relative_error(values[key], reference[key]) for key in values}
        print(f"{name}: {results[name]}")
    base = results["bf16"]["ms"]
    for result in results.values():
        if "ms" in result:
            result["versus_bf16"] = base / result["ms"]
    record = kernel_record("moe-fp8-experts", args.commit, results, experts=EXPERTS, hidden=HIDDEN, ffn=FFN,
                           rows=ROWS, tokens_per_expert=tokens_per_expert.tolist())
    args.output.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
