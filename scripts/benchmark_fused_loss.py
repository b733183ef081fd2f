"""The LM head and its loss on one CUDA device: logits in full against the fused, chunked head and loss.

    python scripts/benchmark_fused_loss.py --output fused_loss.json

At the Llama 1B head (hidden 2048, vocabulary 128256, bf16) and micro-batches of 4096-token sequences, each variant
runs the head's forward and backward from the final norm's output: ``full`` is the trainer's path with
``model.loss_chunk_tokens: 0`` (``F.linear``, then the loss of ``training/objective.py``'s ``micro_batch_loss`` on the
logits, compiled or not), ``fused-N`` is ``parallel/linear_cross_entropy.py`` with chunks of N tokens. Reported per
variant: the median time of forward + backward (ms, CUDA events), the peak memory it allocates above its inputs
(GB), and the largest relative error of its loss and gradients against the fp32 computation. ``floor`` is the time
of the three matmuls alone (logits, input gradient, weight gradient) at the full size.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from benchmark_record import kernel_parser, kernel_record, median_cuda_ms

from nanotron.parallel.cross_entropy import vocab_parallel_token_losses
from nanotron.parallel.linear_cross_entropy import ChunkPasses, linear_cross_entropy

HIDDEN, VOCAB, SEQUENCE = 2048, 128256, 4096


def weighted_loss(logits, labels, token_weights, group):
    """The trainer's loss on full logits: per-token losses (vocabulary-parallel), weighted and summed."""
    return (token_weights * vocab_parallel_token_losses(logits, labels, group, VOCAB)).sum()


def full(compiled: bool):
    """The head as the model applies it (eager), then the loss (compiled with ``model.compile``, as the trainer
    does)."""
    loss = torch.compile(weighted_loss) if compiled else weighted_loss
    return lambda hidden, weight, labels, token_weights, group: loss(F.linear(hidden, weight), labels,
                                                                     token_weights, group)


def fused(chunk: int, compiled: bool):
    passes = ChunkPasses.compiled() if compiled else ChunkPasses()
    return lambda hidden, weight, labels, token_weights, group: linear_cross_entropy(
        hidden, weight, labels, token_weights, group, VOCAB, chunk, passes)[0]


def timed(step, repeats: int) -> tuple[float, float]:
    """(median ms, peak GB allocated above what was allocated before) of ``step()``, after three warm-up calls."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = median_cuda_ms(step, repeats, warmup=0)
    return ms, (torch.cuda.max_memory_allocated() - before) / 1e9


def matmul_floor(hidden: torch.Tensor, weight: torch.Tensor, generator: torch.Generator, repeats: int) -> float:
    """Median ms of the three products of the head at full size: logits, input gradient, weight gradient."""
    grad_logits = torch.randn(hidden.shape[0], VOCAB, device="cuda", generator=generator).bfloat16()
    return timed(lambda: (hidden @ weight.t(), grad_logits @ weight, grad_logits.t() @ hidden), repeats)[0]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def main() -> None:
    parser = kernel_parser(__doc__, repeats=10)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=generator) * 0.02).bfloat16().requires_grad_()
    results = []
    for micro_batch in args.micro_batch_sizes:
        hidden = torch.randn(micro_batch, SEQUENCE, HIDDEN, device="cuda", generator=generator).bfloat16()
        hidden.requires_grad_()
        labels = torch.randint(0, VOCAB, (micro_batch, SEQUENCE), device="cuda", generator=generator)
        mask = torch.rand(micro_batch, SEQUENCE, device="cuda", generator=generator) > 0.05
        token_weights = mask / mask.sum()

        exact_inputs = [hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()]
        exact = full(False)(*exact_inputs, labels, token_weights, group)
        exact = (exact.detach(), *torch.autograd.grad(exact, exact_inputs))
        del exact_inputs

        floor = matmul_floor(hidden.detach().flatten(0, 1), weight.detach(), generator, args.repeats)
        results.append({"micro_batch": micro_batch, "variant": "floor", "ms": floor})
        print(f"mbs {micro_batch} {'floor':24s} {floor:7.2f} ms", flush=True)

        variants = {"full": lambda: full(False), "full-compiled": lambda: full(True)}
        for chunk in args.chunks:
            variants[f"fused-{chunk}"] = lambda chunk=chunk: fused(chunk, False)
            variants[f"fused-{chunk}-compiled"] = lambda chunk=chunk: fused(chunk, True)
        for name, make in variants.items():
            loss_fn = make()

            def step():
                loss = loss_fn(hidden, weight, labels, token_weights, group)
                return loss.detach(), *torch.autograd.grad(loss, (hidden, weight))

            error = max(relative_error(a, b) for a, b in zip(step(), exact))
            ms, peak = timed(step, args.repeats)
            results.append({"micro_batch": micro_batch, "variant": name, "ms": ms, "peak_gb": peak,
                            "relative_error": error})
            print(f"mbs {micro_batch} {name:24s} {ms:7.2f} ms  {peak:6.2f} GB  error {error:.2e}", flush=True)
            torch._dynamo.reset()
    if args.output:
        args.output.write_text(json.dumps(kernel_record("fused-loss", args.commit, results), indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
