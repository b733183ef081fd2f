"""Training throughput of nanotron, side by side with what a user would train the same model with instead, on CUDA.

    python scripts/benchmark.py --data work/data/tokenized [--preset llama1b] [--peer hf liger torchtitan] [--steps 20]
    torchrun --nproc_per_node=2 scripts/benchmark.py --data ... --override parallelism.dp=2

Every system trains the same model shape on the same batches: nanotron (fp32 master weights and fp32 gradient
accumulation) and, on a single process, the peers of ``--peer`` (``scripts/benchmark_peers.py``): by default the Hugging
Face ``transformers`` loop with its decoder layers and loss compiled (``hf``); ``hf-eager``, the same loop eagerly;
``liger``, that model with Liger's kernels; ``torchtitan``, torchtitan's own model of the family (Llama, Mixtral as its
Llama 4, Qwen3, DeepSeek-V3); ``mamba-ssm``, the authors' Mamba with its CUDA kernels (Mamba presets); ``--no-peers``,
none. Step times are measured with CUDA events after ``--warmup`` steps and the median is reported, with tokens/s,
tokens/s/GPU, TFLOP/s/GPU, MFU (FLOPs per token in Megatron-LM's convention, from nanotron's model family: the LM head
counted, the input-embedding lookup not; for a mixture of experts the parameters a token uses; under document masking
the attention pairs inside the batches' documents), peak memory (the largest over ranks, and each rank's), and how much
of the peak the weights, gradients and optimizer state take (``state_memory_gb``: what is allocated when a step starts,
plus the gradients a loop frees after each update) and the rest, the activations (``activation_memory_gb``), and what
the forward holds when the backward starts (``kept_for_backward_gb``: unlike the peak, it does not depend on when a loop
allocates its gradients).

``--versus`` and ``--versus-override`` train a second nanotron run in the same command, another preset (a Llama of
the Mamba's size) or the same one with other overrides (FP8 against bf16); ``--torchao`` also trains the compiled
Hugging Face loop with torchao's float8 training, the peer of nanotron's FP8. Every run writes its record to
``benchmarks/results/<date>-<gpu>-<name>.json`` (``scripts/benchmark_record.py``; ``--output`` writes a copy) and
prints its rows; ``scripts/benchmark_table.py`` writes the performance tables from the records.

    python scripts/benchmark.py --data ... --name fp8-torchao --override fp8.enabled=true \
      --versus-override fp8.enabled=false --torchao tensorwise

``--muon`` trains the preset with Muon and then with AdamW, on the same batches in the same call (records
``nanotron-muon`` and ``nanotron-adamw``): the step-time overhead of Muon's Newton-Schulz and its gathers.

    python scripts/benchmark.py --data ... --preset llama1b --no-peers --muon --name muon-llama1b
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from benchmark_peers import LIBRARIES, PEERS, build_peer, library_problem, peer_problem
from benchmark_record import (
    RESULTS,
    BackwardStart,
    build_record,
    command_line,
    git_commit,
    installed_versions,
    memory_fields,
    nanotron_names,
    write_record,
)
from benchmark_table import HEADER, record_label, record_rows

ROOT = Path(__file__).resolve().parents[1]
NANOTRON_RUNS: list[str] = []  # the presets of the nanotron runs this process has built, in order
PRESETS = {
    "llama1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0},
    "llama8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0},
    # Mixtral's architecture at 1B active / 3.5B total parameters: 8 experts of ffn 4096, top-2, in every layer.
    "mixtral": {"is_llama_config": False, "is_llamoe_config": True, "hidden_size": 2048, "intermediate_size": 4096,
                "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                "tie_word_embeddings": False, "rope_theta": 1000000.0, "moe_num_experts": 8, "num_experts_per_tok": 2},
    # The state-spaces Mamba-1 130M and 1.4B shapes (GPT-NeoX vocabulary) and Llamas of about their size.
    "mamba130m": {"is_mamba_config": True, "d_model": 768, "num_hidden_layers": 24, "vocab_size": 50280,
                  "ssm_cfg": {"d_state": 16, "d_conv": 4, "expand": 2}, "tie_word_embeddings": True},
    "mamba1.4b": {"is_mamba_config": True, "d_model": 2048, "num_hidden_layers": 48, "vocab_size": 50280,
                  "ssm_cfg": {"d_state": 16, "d_conv": 4, "expand": 2}, "tie_word_embeddings": True},
    # Qwen3-1.7B's shape (1.72B parameters, tied embeddings; heads of 128 over a hidden size of 2048) and a
    # Qwen3-MoE of Qwen3-30B-A3B's layer on 16 layers with 32 experts, top-8 (3.34B parameters, 1.22B used per
    # token), which fits one H200 with its optimizer state.
    "qwen3-1.7b": {"is_llama_config": False, "is_qwen3_config": True, "hidden_size": 2048, "intermediate_size": 6144,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1000000.0},
    "qwen3-moe": {"is_llama_config": False, "is_qwen3_config": True, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                  "moe_config": {"num_experts": 32, "top_k": 8, "moe_intermediate_size": 768}},
    # DeepSeek-V3's layer (MLA without a q compression, as its 16B sibling; 64 fine-grained experts of ffn 704, top-6,
    # sigmoid routing with the balancing bias, 2 shared experts, the first layer dense) on 10 layers: 3.19B
    # parameters, 0.73B used per token, which fits one GPU of 80 GB with its optimizer state.
    "deepseek-v3": {"is_llama_config": False, "is_deepseek_v3_config": True, "hidden_size": 2048,
                    "intermediate_size": 10944, "num_hidden_layers": 10, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "vocab_size": 102400, "tie_word_embeddings": False,
                    "rope_theta": 10000.0, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
                    "num_experts_per_tok": 6, "moe_intermediate_size": 704, "routed_scaling_factor": 1.0,
                    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    "llama130m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "num_key_value_heads": 12, "vocab_size": 50280, "tie_word_embeddings": True},
    "llama1.4b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                  "num_key_value_heads": 16, "vocab_size": 50280, "tie_word_embeddings": True},
}


def timed(step_fn, steps: int, warmup: int) -> tuple[list[float], int]:
    """Seconds per step, warm-up excluded, with the steps run back to back as a training loop runs them: no
    synchronisation between them, so a host that queues the next step while the GPU finishes one hides its launches.
    Each step's time is the GPU's, from the end of the step before to its own (CUDA events recorded between steps,
    read after the last). Also the bytes allocated when the first timed step starts (the optimizer state exists by
    then: ``--warmup`` is at least 1)."""
    for i in range(warmup):
        step_fn(i)
    torch.cuda.synchronize()
    step_start = torch.cuda.memory_allocated()
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    ends[0].record()
    for i in range(steps):
        step_fn(warmup + i)
        ends[i + 1].record()
    torch.cuda.synchronize()
    return [before.elapsed_time(end) / 1e3 for before, end in zip(ends, ends[1:])], step_start


def summary(times: list[float], tokens_per_step: int, world: int, flops_per_token: float, peak: float | None) -> dict:
    step = statistics.median(times)
    per_gpu = tokens_per_step / step / world
    tflops = per_gpu * flops_per_token / 1e12
    return {"step_time_s": step, "tokens_per_sec": tokens_per_step / step, "tokens_per_sec_per_gpu": per_gpu,
            "tflops_per_gpu": tflops, "mfu": tflops * 1e12 / peak if peak else None}


def measured_memory(step_start: int, baseline: int, freed_gradient_bytes: int, backward: BackwardStart) -> dict:
    """Peak, state and activation memory of the run just timed, on this rank and over all ranks (the largest; a
    rank without a loss, a pipeline stage before the last, has no ``kept_for_backward_gb``)."""
    mine = {"peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}
    mine |= memory_fields(torch.cuda.max_memory_allocated(), step_start, baseline, freed_gradient_bytes,
                          backward.bytes)
    result = {}
    for key, value in mine.items():
        ranks = [None if r != r else r for r in per_rank(float("nan") if value is None else value)]
        known = [r for r in ranks if r is not None]
        result |= {key: max(known) if known else None, f"{key}_per_rank": ranks}
    return result


def per_rank(value: float) -> list[float]:
    """``value`` of every rank, in rank order (pipeline stages and shards differ)."""
    if not dist.is_initialized():
        return [value]
    mine = torch.tensor([value], device="cuda", dtype=torch.float64)
    values = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(values, mine)
    return [v.item() for v in values]


def precision(config) -> str:
    """``fp8`` for FP8 linears, else the model dtype (``bf16``, ``fp32``)."""
    if config.fp8 is not None and config.fp8.enabled:
        return "fp8"
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(config.model.dtype, config.model.dtype)


def adam_moments(config) -> str:
    """The dtype of the optimizer's Adam moments (``bf16`` is a lower-precision option), as ``precision`` writes it."""
    return {"bfloat16": "bf16", "float32": "fp32"}[config.optimizer.adam_moments_dtype]


def masters(config) -> str:
    """How the optimizer holds the fp32 masters of the model's weights: ``remainders`` (the bf16 weights plus 16 bits,
    ``optimizer.store_param_remainders``) or ``fp32`` copies."""
    from nanotron.optim.param_remainders import stores_remainders

    dtype = getattr(torch, config.model.dtype)
    return "remainders" if stores_remainders(dtype, config.optimizer.store_param_remainders) else "fp32"


def nanotron_config(args, preset: str, overrides: list[str]):
    """The bench config (examples/config_llama1b_bench.yaml) with the preset's model, the command's shape and
    ``overrides`` (section.key=value)."""
    import yaml

    from nanotron.config import apply_overrides, config_from_dict

    raw = yaml.safe_load((ROOT / "examples" / "config_llama1b_bench.yaml").read_text())
    model = dict(PRESETS[preset])
    if not model.get("is_mamba_config"):  # a transformer: the bench Llama with the preset's fields
        model = raw["model"]["model_config"] | model | {"max_position_embeddings": args.sequence_length}
    raw["model"]["model_config"] = model
    overrides = [
        f"tokens.sequence_length={args.sequence_length}", f"tokens.micro_batch_size={args.micro_batch_size}",
        f"tokens.batch_accumulation_per_replica={args.accumulation}",
        f"tokens.train_steps={args.steps + args.warmup}", "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
        f"data_stages.0.data.dataset.dataset_folder={args.data}", "checkpoints.save_final_state=false",
        "checkpoints.checkpoint_interval=100000", "parallelism.replica_check_interval=null",
    ] + overrides
    # Each run of the process is a run of its own, with its own folder (and run lock), the same on every rank.
    NANOTRON_RUNS.append(preset)
    folder = args.save_to or f"{raw['checkpoints']['checkpoints_path']}-run{len(NANOTRON_RUNS)}"
    overrides += [f"checkpoints.checkpoints_path={folder}"]
    if args.save_to:
        overrides += ["checkpoints.async_save=true", "checkpoints.keep_last_n=1"]
    return config_from_dict(apply_overrides(raw, overrides))


def nanotron_run(args, preset: str, overrides: list[str]):
    """A trainer of the benchmark's config, its first two batches (reused: data loading is not what is measured), a
    step function that queues step ``i`` and then reads back the one queued before, as the training loop does, and
    the last step queued on each batch (filled by the steps)."""
    from nanotron.optim.lr_schedule import learning_rate_at
    from nanotron.trainer import Trainer

    trainer = Trainer(nanotron_config(args, preset, overrides))
    config = trainer.config
    loader = trainer.loader(config.data_stages[0])
    batches = [loader.next_step() for _ in range(2)]
    schedule = config.optimizer.learning_rate_scheduler
    last_of_batch = {}
    queued = []

    def step(i):
        pending = trainer.train_step(batches[i % 2], learning_rate_at(i + 1, schedule, config.tokens.train_steps))
        if queued:
            trainer.finish_step(queued.pop())
        queued.append(pending)
        last_of_batch[i % 2] = pending  # its statistics are read after the timed steps

    return trainer, batches, step, last_of_batch


def run_nanotron(args, preset: str, overrides: list[str]) -> tuple[dict, list]:
    from nanotron.training.objective import ATTENTION_FLOPS

    baseline = torch.cuda.memory_allocated()
    trainer, batches, step, last_of_batch = nanotron_run(args, preset, overrides)
    config = trainer.config
    torch.cuda.reset_peak_memory_stats()
    backward = BackwardStart(torch.cuda.memory_allocated)

    def watched_step(i):
        backward.new_step()
        step(i)

    with watched_losses(trainer, backward):
        times, step_start = timed(watched_step, args.steps, args.warmup)
    # Gradient buffers outlive the step; gradients held without a buffer are freed after each update.
    memory = measured_memory(step_start, baseline, trainer.buckets.held_gradient_bytes(), backward)
    saves = time_saves(trainer) if args.save_to else None
    flops_per_token, counted = trainer.flops_per_token, {}
    attention_flops = [pending.readings.values().get(ATTENTION_FLOPS) for pending in last_of_batch.values()]
    if attention_flops and all(flops is not None for flops in attention_flops):  # document masking: the 2 batches' mean
        tokens = config.global_batch_tokens * len(attention_flops)
        flops_per_token = trainer.costs.masked_flops_per_token(tokens, sum(attention_flops).item())
        counted = {"causal_flops_per_token": trainer.flops_per_token}
    result = summary(times, config.global_batch_tokens, trainer.pc.world_size, flops_per_token,
                     trainer.step_log.peak_flops)
    fp8 = config.fp8.recipe if precision(config) == "fp8" else None
    return result | memory | counted | {"preset": preset, "overrides": overrides, "precision": precision(config),
                                        "fp8_recipe": fp8, "adam_moments": adam_moments(config),
                                        "masters": masters(config), "optimizer": config.optimizer.name,
                                        "attention": "fa4" if getattr(trainer.model, "flash_attention", False)
                                        else "torch",
                                        "parameters": trainer.num_parameters,
                                        "flops_per_token": flops_per_token, "layout": trainer.pc.sizes,
                                        "saves": saves}, batches[0]


def examine_nanotron(args, preset: str, overrides: list[str], profile: Path | None,
                     activations: Path | None) -> None:
    """``--profile`` and ``--activations`` of the first nanotron run, from a trainer built again after every timed
    run: runs timed after a profiled one in the same process were slower (Mamba 130M: 18%, docs/benchmarks.md)."""
    trainer, _, step, _ = nanotron_run(args, preset, overrides)
    for i in range(args.warmup):
        step(i)
    if profile:
        write_profile(step, profile)
    if activations:
        write_activations(trainer, step, activations)


def peer_batches(micro_batches: list) -> list[dict]:
    return [{"input_ids": mb.input_ids.cuda(), "labels": mb.labels.cuda()} for mb in micro_batches]


def run_peer(args, name: str, peer: str, micro_batches: list, flops_per_token: float, peak: float | None,
             float8_recipe: str | None = None) -> dict:
    """A peer on one GPU on nanotron's first batch: the same tokens per step, FLOPs per token and peak FLOP/s."""
    baseline = torch.cuda.memory_allocated()
    loop = build_peer(peer, PRESETS[args.preset], args.sequence_length, "cuda", args.hf_experts, float8_recipe)
    try:
        batches = peer_batches(micro_batches)
        freed, backward = {}, BackwardStart(torch.cuda.memory_allocated)
        torch.cuda.reset_peak_memory_stats()
        step = loop.step_function(batches, freed, backward)
        times, step_start = timed(step, args.steps, args.warmup)
        memory = measured_memory(step_start, baseline, freed["gradient_bytes"], backward)
    finally:
        loop.restore()
    tokens = sum(mb["input_ids"].numel() for mb in batches)
    return summary(times, tokens, 1, flops_per_token, peak) | memory | {"layout": "1 GPU"}


def profile_peer(args, name: str, peer: str, micro_batches: list, float8_recipe: str | None = None) -> None:
    """The peer's profile in ``--profile-peers``/<name>.txt, from a loop built again after every timed run."""
    loop = build_peer(peer, PRESETS[args.preset], args.sequence_length, "cuda", args.hf_experts, float8_recipe)
    try:
        step = loop.step_function(peer_batches(micro_batches), {}, BackwardStart(torch.cuda.memory_allocated))
        for i in range(args.warmup):
            step(i)
        args.profile_peers.mkdir(parents=True, exist_ok=True)
        write_profile(step, args.profile_peers / f"{name}.txt")
    finally:
        loop.restore()


def time_saves(trainer, repeats: int = 2) -> dict:
    """Seconds a checkpoint save blocks training, foreground then background, and until each is on disk."""
    import time

    background = trainer.checkpoints.async_saver
    result = {}
    for label, saver in (("foreground", None), ("background", background)):
        trainer.checkpoints.async_saver = saver
        blocking, total = [], []
        for _ in range(repeats):
            trainer.progress.step += 1
            torch.cuda.synchronize()
            start = time.perf_counter()
            trainer.save()
            blocking.append(time.perf_counter() - start)
            trainer.wait_for_saves()
            total.append(time.perf_counter() - start)
        result[label] = {"blocking_s": blocking, "total_s": total}
    return result


def write_profile(step_fn, path: Path, steps: int = 3) -> None:
    """Where a few steps' GPU time goes (torch profiler): operators, then kernels grouped by name, per step."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for i in range(steps):
            step_fn(i)
        torch.cuda.synchronize()
    operators = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
    kernels: dict[str, list[float]] = {}
    for event in gpu_kernels(profiler):
        entry = kernels.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us() / 1e3
    total = sum(ms for _, ms in kernels.values())
    lines = [f"GPU kernel time per step: {total / steps:.1f} ms", "ms/step  calls/step  kernel"]
    for name, (calls, ms) in sorted(kernels.items(), key=lambda item: -item[1][1])[:80]:
        lines.append(f"{ms / steps:8.2f}  {calls / steps:10.1f}  {name[:150]}")
    path.write_text(operators + "\n\n" + "\n".join(lines) + "\n\n" + idle_gaps(profiler, steps) + "\n")


def live_blocks() -> dict[int, int]:
    """The caching allocator's allocated blocks: address -> requested bytes."""
    return {block["address"]: block["requested_size"] for segment in torch.cuda.memory_snapshot()
            for block in segment["blocks"] if block["state"] == "active_allocated"}


@contextlib.contextmanager
def loss_replaced(trainer, replacement):
    """The step's language-model loss (its step term's ``compute``, called once the model's forward is done)
    replaced by ``replacement(compute)`` within the block, restored after it."""
    term = trainer.program.objective_at(1).language_model
    term.compute = replacement(term.compute)
    try:
        yield
    finally:
        del term.compute  # the class's again


def watched_losses(trainer, backward: BackwardStart):
    """``backward`` watches every language-model loss the trainer computes."""
    def watching(loss):
        def watched(*args, **kwargs):
            result = loss(*args, **kwargs)
            if result[0] is not None:
                backward.watch(result[0])
            return result
        return watched

    return loss_replaced(trainer, watching)


def write_activations(trainer, step_fn, path: Path) -> None:
    """What one step's forward keeps for its backward, seen when the loss is about to be computed: the allocations
    made since the step started and still alive, grouped by size (largest total first). Sizes name their tensors:
    with ``t`` tokens per micro-batch, ``t·h·2`` bytes is a bf16 hidden state, ``t·ffn·2`` an MLP activation."""
    seen = {}

    def observing(loss):
        def observed(*args, **kwargs):
            if not seen:
                seen.update(live_blocks())
            return loss(*args, **kwargs)
        return observed

    torch.cuda.synchronize()
    before = live_blocks()
    with loss_replaced(trainer, observing):
        step_fn(0)
    sizes: dict[int, int] = {}
    for address, size in seen.items():
        if address not in before:
            sizes[size] = sizes.get(size, 0) + 1
    total = sum(size * count for size, count in sizes.items())
    lines = [f"kept by the forward at the loss: {total / 1e9:.2f} GB in {sum(sizes.values())} allocations",
             "    GB   count  bytes each"]
    for size, count in sorted(sizes.items(), key=lambda item: -item[0] * item[1]):
        lines.append(f"{size * count / 1e9:6.2f}  {count:6d}  {size}")
    path.write_text("\n".join(lines) + "\n")


def gpu_kernels(profiler) -> list:
    """The profile's GPU events without the annotations that span kernels on the GPU's timeline (an optimizer's
    ``Optimizer.step#AdamW.step``), which would count those kernels twice and hide the gaps between them."""
    return [event for event in profiler.events()
            if event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation]


def idle_gaps(profiler, steps: int, shown: int = 25) -> str:
    """When the GPU waits for the host: the gaps between one kernel's end and the next one's start, in total per
    step and the longest, each with the kernels around it (what the host was launching late)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in gpu_kernels(profiler))
    gaps, busy_until, before = [], None, None
    for start, end, name in spans:
        if busy_until is not None and start > busy_until:
            gaps.append(((start - busy_until) / 1e3, before, name))
        if busy_until is None or end > busy_until:
            busy_until, before = end, name
    idle = sum(gap for gap, _, _ in gaps)
    lines = [f"GPU idle between kernels per step: {idle / steps:.1f} ms in {len(gaps) / steps:.0f} gaps, "
             f"{len(spans) / steps:.0f} kernels"]
    for low, high in ((0, 0.01), (0.01, 0.05), (0.05, 0.2), (0.2, float("inf"))):
        within = [g for g, _, _ in gaps if low <= g < high]
        lines.append(f"  gaps of {low}-{high} ms: {len(within) / steps:.0f} per step, {sum(within) / steps:.2f} ms")
    lines.append("longest (ms): after kernel  ->  before kernel")
    for gap, after, following in sorted(gaps, reverse=True)[:shown]:
        lines.append(f"{gap:6.3f}  {after[:70]}  ->  {following[:70]}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a preprocessed folder (token ids < the vocabulary)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama1b")
    parser.add_argument("--peer", nargs="+", choices=sorted(PEERS), default=["hf"],
                        help="systems trained beside nanotron on one GPU (default: hf, the compiled transformers "
                             "loop): hf, hf-eager, liger (transformers + Liger kernels), torchtitan (Llama, Mixtral, "
                             "Qwen3, DeepSeek-V3), mamba-ssm (Mamba presets)")
    parser.add_argument("--no-peers", "--no-hf", dest="no_peers", action="store_true", help="train nanotron only")
    parser.add_argument("--versus", choices=sorted(PRESETS),
                        help="also train this nanotron preset on the same batches and report the tokens/s ratio")
    parser.add_argument("--versus-override", nargs="*", default=[],
                        help="overrides applied after --override to the second run (its preset: --versus, else "
                             "--preset), e.g. fp8.enabled=false")
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (at least 1)")
    parser.add_argument("--hf-experts", default="grouped_mm",
                        help="transformers' experts implementation for MoE presets (grouped_mm, batched_mm, eager)")
    parser.add_argument("--torchao", choices=("tensorwise", "rowwise"),
                        help="also train the compiled Hugging Face loop with torchao's float8 training of this "
                             "recipe (needs --peer hf, its bf16 counterpart; install torchao first)")
    parser.add_argument("--profile", type=Path, help="also write the profiler table of 3 nanotron steps here")
    parser.add_argument("--profile-peers", type=Path,
                        help="also write each peer's profiler table of 3 steps into this folder, as <system>.txt")
    parser.add_argument("--activations", type=Path,
                        help="also write what the forward keeps for the backward, by allocation size, here")
    parser.add_argument("--override", nargs="*", default=[], help="nanotron config overrides (section.key=value)")
    parser.add_argument("--muon", action="store_true",
                        help="train nanotron with Muon (optimizer.name=muon) and, in the same call, with AdamW on the "
                             "same batches (--versus-override optimizer.name=adamw): Muon's step-time overhead")
    parser.add_argument("--save-to", type=Path, help="also time checkpoint saves (foreground, background) into here")
    parser.add_argument("--name", help="the record's name: benchmarks/results/<date>-<gpu>-<name>.json (default: "
                                       "the preset)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where records go")
    parser.add_argument("--output", type=Path, help="also write the record here")
    parser.add_argument("--commit", help="the measured code's commit, for a copy of the tree without git metadata")
    args = parser.parse_args(argv)
    args.peer = [] if args.no_peers else list(dict.fromkeys(args.peer))
    if args.muon:
        args.override = [*args.override, "optimizer.name=muon"]
        args.versus_override = [*args.versus_override, "optimizer.name=adamw"]
    return args


def argument_problem(args: argparse.Namespace, world_size: int) -> str | None:
    """What is wrong with the command, found before anything is allocated."""
    if args.warmup < 1:
        return "--warmup must be at least 1: the memory split is read once the optimizer state exists"
    if args.torchao and "hf" not in args.peer:
        return "--torchao compares torchao's float8 with the compiled Hugging Face loop: keep --peer hf"
    if world_size > 1:
        return None  # peers run on one process only
    problems = [peer_problem(peer, args.preset, PRESETS[args.preset]) for peer in args.peer]
    if args.torchao:
        problems.append(library_problem("torchao"))
    return next((problem for problem in problems if problem is not None), None)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else argv
    environment = dict(os.environ)  # as launched: the compiler sets variables of its own later
    args = parse_args(arguments)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    problem = argument_problem(args, world)
    if problem is not None:
        sys.exit(f"error: {problem}")
    commit = (args.commit, False) if args.commit else git_commit(ROOT)
    if commit is None:
        sys.exit(f"error: {ROOT} is not a git checkout: pass --commit with the measured code's commit")
    if not torch.cuda.is_available():
        sys.exit("error: the benchmark needs a CUDA device")

    first, micro_batches = run_nanotron(args, args.preset, args.override)
    second = None
    if args.versus or args.versus_override:
        free_memory()
        second = run_nanotron(args, args.versus or args.preset, args.override + args.versus_override)[0]
    first_name, second_name = nanotron_names(first, second)
    systems = {first_name: first} | ({second_name: second} if second is not None else {})
    runs = []  # the peers: (name, peer, float8 recipe)
    if world == 1:
        from nanotron.metrics import peak_flops

        peak = peak_flops(torch.device("cuda"), torch.bfloat16)
        runs = [(PEERS[peer], peer, None) for peer in args.peer]
        peer_flops = first.get("causal_flops_per_token", first["flops_per_token"])  # peers attend across documents
        if args.torchao:
            runs.append((f"torchao-float8-{args.torchao}", "hf", args.torchao))
        for name, peer, recipe in runs:
            free_memory()
            systems[name] = run_peer(args, name, peer, micro_batches, peer_flops, peak, recipe)
    # Profiles and the census after every timed run, each system built again.
    if args.profile or args.activations:
        free_memory()
        examine_nanotron(args, args.preset, args.override, args.profile, args.activations)
    for name, peer, recipe in runs if args.profile_peers else []:
        free_memory()
        profile_peer(args, name, peer, micro_batches, recipe)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if world > 1 and args.peer:
        print(f"peers ({', '.join(args.peer)}) train on one process only: not run with {world} processes")
    now = datetime.datetime.now(datetime.timezone.utc)
    record = build_record(
        date=datetime.date.today().isoformat(), recorded_at=now.isoformat(timespec="seconds"), preset=args.preset,
        gpu=torch.cuda.get_device_name(), world_size=world, commit=commit[0], dirty=commit[1],
        torch_version=torch.__version__,
        versions=installed_versions(LIBRARIES),
        command=command_line([Path(__file__).resolve().relative_to(ROOT).as_posix(), *arguments], environment),
        sequence_length=args.sequence_length, micro_batch_size=args.micro_batch_size, accumulation=args.accumulation,
        steps=args.steps, warmup=args.warmup, systems=systems, reference=first_name)
    path = write_record(record, args.results_dir, args.name or args.preset)
    if args.output:
        args.output.write_text(json.dumps(record, indent=2) + "\n")
    print("\n".join([HEADER, *record_rows(record, record_label(record)), f"record: {path}"]))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        # The trainer's process group and loader workers outlive an exception, and the interpreter then waits for
        # them at exit forever: a failed run reports and ends.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
