"""Training throughput of nanotron, side by side with a plain Hugging Face ``transformers`` loop, on CUDA.

    python scripts/benchmark.py --data work/data/tokenized --output bench.json [--preset llama1b] [--steps 20]
    torchrun --nproc_per_node=2 scripts/benchmark.py --data ... --output ... --override parallelism.dp=2

Both systems train the same model shape on the same batches (bf16 weights; nanotron with fp32 master weights and
fp32 gradient accumulation, Hugging Face with fused AdamW and SDPA attention). Step times are measured with CUDA
events after ``--warmup`` steps and the median is reported, with tokens/s, tokens/s/GPU, TFLOP/s/GPU, MFU
(FLOPs/token from the model family: for Llama 6·parameters + 6·layers·hidden·sequence, for a mixture of experts
the parameters a token uses) and peak memory (the largest over ranks, and each rank's).
The Hugging Face loop runs only on a single process, eagerly unless ``--hf-compile``; for Mamba presets
``--mamba-ssm`` trains the authors' model with its CUDA kernels instead. ``--versus`` and ``--versus-override``
train a second nanotron run in the same command, another preset (a Llama of the Mamba's size) or the same one with
other overrides (FP8 against bf16), and report the tokens/s ratio; ``--torchao`` trains the compiled Hugging Face
loop twice, in bf16 and with torchao's float8 training, as the peer of nanotron's FP8. Results go to ``--output``
(JSON) and markdown rows are printed.

    python scripts/benchmark.py --data ... --output fp8.json --override fp8.enabled=true \
      --versus-override fp8.enabled=false --torchao tensorwise
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
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
    "llama130m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "num_key_value_heads": 12, "vocab_size": 50280, "tie_word_embeddings": True},
    "llama1.4b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                  "num_key_value_heads": 16, "vocab_size": 50280, "tie_word_embeddings": True},
}
# nanotron config keys -> transformers config keys where they differ; the markers have no counterpart.
HF_NAMES = {"moe_num_experts": "num_local_experts", "is_llama_config": None, "is_llamoe_config": None}


def timed(step_fn, steps: int, warmup: int) -> list[float]:
    """Seconds per step, measured with CUDA events, warm-up excluded."""
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step_fn(i)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def summary(times: list[float], tokens_per_step: int, world: int, flops_per_token: float, peak: float | None) -> dict:
    step = statistics.median(times)
    per_gpu = tokens_per_step / step / world
    tflops = per_gpu * flops_per_token / 1e12
    return {"step_time_s": step, "tokens_per_sec": tokens_per_step / step, "tokens_per_sec_per_gpu": per_gpu,
            "tflops_per_gpu": tflops, "mfu": tflops * 1e12 / peak if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}


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
    if args.save_to:
        overrides += [f"checkpoints.checkpoints_path={args.save_to}", "checkpoints.async_save=true",
                      "checkpoints.keep_last_n=1"]
    return config_from_dict(apply_overrides(raw, overrides))


def run_nanotron(args, preset: str, overrides: list[str], profile: Path | None = None) -> tuple[dict, list[dict]]:
    from nanotron.optim.lr_schedule import learning_rate_at
    from nanotron.trainer import Trainer

    trainer = Trainer(nanotron_config(args, preset, overrides))
    config = trainer.config
    loader = trainer._loader(config.data_stages[0])
    batches = [loader.next_step() for _ in range(2)]  # reused: data loading is not what is measured
    schedule = config.optimizer.learning_rate_scheduler
    torch.cuda.reset_peak_memory_stats()

    def step(i):
        trainer.train_step(batches[i % 2], learning_rate_at(i + 1, schedule, config.tokens.train_steps))

    times = timed(step, args.steps, args.warmup)
    if profile:
        write_profile(step, profile)
    saves = time_saves(trainer) if args.save_to else None
    result = summary(times, config.global_batch_tokens, trainer.pc.world_size, trainer.flops_per_token, trainer.peak_flops)
    per_rank = peak_memory_per_rank()
    return result | {"peak_memory_gb": max(per_rank), "peak_memory_gb_per_rank": per_rank,
                     "parameters": trainer.num_parameters, "flops_per_token": trainer.flops_per_token,
                     "layout": trainer.pc.sizes, "saves": saves}, batches[0]


def time_saves(trainer, repeats: int = 2) -> dict:
    """Seconds a checkpoint save blocks training, foreground then background, and until each is on disk."""
    import time

    background = trainer.async_saver
    result = {}
    for label, saver in (("foreground", None), ("background", background)):
        trainer.async_saver = saver
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


def peak_memory_per_rank() -> list[float]:
    """Every rank's peak allocated memory in GB, in rank order (pipeline stages and shards differ)."""
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 1e9], device="cuda")
    if not dist.is_initialized():
        return [peak.item()]
    peaks = [torch.empty_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    return [p.item() for p in peaks]


def write_profile(step_fn, path: Path, steps: int = 3) -> None:
    """Where a few steps' GPU time goes (torch profiler): operators, then kernels grouped by name, per step."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for i in range(steps):
            step_fn(i)
        torch.cuda.synchronize()
    operators = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
    kernels: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us() / 1e3
    total = sum(ms for _, ms in kernels.values())
    lines = [f"GPU kernel time per step: {total / steps:.1f} ms", "ms/step  calls/step  kernel"]
    for name, (calls, ms) in sorted(kernels.items(), key=lambda item: -item[1][1])[:80]:
        lines.append(f"{ms / steps:8.2f}  {calls / steps:10.1f}  {name[:150]}")
    path.write_text(operators + "\n\n" + "\n".join(lines) + "\n\n" + idle_gaps(profiler, steps) + "\n")


def idle_gaps(profiler, steps: int, shown: int = 25) -> str:
    """When the GPU waits for the host: the gaps between one kernel's end and the next one's start, in total per
    step and the longest, each with the kernels around it (what the host was launching late)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in profiler.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
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


def run_hf(args, micro_batches: list[dict], flops_per_token: float, peak: float | None,
           float8_recipe: str | None = None) -> dict:
    """The ``transformers`` model of the preset in a plain loop; with ``float8_recipe``, its decoder layers' linears
    converted to torchao's float8 training (the LM head stays bf16, as nanotron's FP8 keeps it)."""
    import transformers

    preset = {HF_NAMES.get(key, key): value for key, value in PRESETS[args.preset].items()}
    preset.pop(None, None)
    family = "Mixtral" if "num_local_experts" in preset else "Llama"
    experts = {"experts_implementation": args.hf_experts} if family == "Mixtral" else {}
    config = getattr(transformers, f"{family}Config")(**preset, max_position_embeddings=args.sequence_length,
                                                      attn_implementation="sdpa", dtype=torch.bfloat16, **experts)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).to("cuda", torch.bfloat16).train()
    if float8_recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8_recipe),
                                   module_filter_fn=lambda module, name: name.startswith("model.layers."))
    layers = model.model.layers if args.hf_compile else None
    return train_peer(args, model, lambda input_ids: model(input_ids=input_ids).logits, layers, micro_batches,
                      flops_per_token, peak)


def run_mamba_ssm(args, micro_batches: list[dict], flops_per_token: float, peak: float | None) -> dict:
    """The authors' ``mamba_ssm`` model (its CUDA selective scan, causal-conv1d and fused add-norm kernels)."""
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    preset = PRESETS[args.preset]
    config = MambaConfig(d_model=preset["d_model"], n_layer=preset["num_hidden_layers"],
                         vocab_size=preset["vocab_size"], ssm_cfg={"layer": "Mamba1", **preset["ssm_cfg"]},
                         rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8,
                         tie_embeddings=preset["tie_word_embeddings"])
    torch.manual_seed(0)
    model = MambaLMHeadModel(config, device="cuda", dtype=torch.bfloat16).train()
    return train_peer(args, model, lambda input_ids: model(input_ids).logits, None, micro_batches, flops_per_token,
                      peak)


def train_peer(args, model, logits_of, compiled_layers, micro_batches: list[dict], flops_per_token: float,
               peak: float | None) -> dict:
    """A plain loop on one GPU: bf16 weights, fused AdamW, the same batches, clipping and accumulation."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batches = [{k: v.cuda() for k, v in mb.items()} for mb in micro_batches]

    def loss_of(logits, labels):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    if compiled_layers is not None:  # as nanotron's model.compile: every decoder layer and the loss
        # Each Hugging Face layer holds its own layer_idx, so each compiles once: allow one graph per layer.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(compiled_layers))
        for layer in compiled_layers:
            layer.compile()
        loss_of = torch.compile(loss_of)
    torch.cuda.reset_peak_memory_stats()

    def step(_):
        for mb in batches:
            loss = loss_of(logits_of(mb["input_ids"]), mb["labels"])
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    tokens = sum(mb["input_ids"].numel() for mb in batches)
    return summary(timed(step, args.steps, args.warmup), tokens, 1, flops_per_token, peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a preprocessed folder (token ids < the vocabulary)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama1b")
    parser.add_argument("--versus", choices=sorted(PRESETS),
                        help="also train this nanotron preset on the same batches and report the tokens/s ratio")
    parser.add_argument("--versus-override", nargs="*", default=[],
                        help="overrides applied after --override to the second run (its preset: --versus, else "
                             "--preset), e.g. fp8.enabled=false")
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face loop")
    parser.add_argument("--hf-compile", action="store_true",
                        help="compile the Hugging Face decoder layers and loss (by default its loop runs eagerly)")
    parser.add_argument("--hf-experts", default="grouped_mm",
                        help="transformers' experts implementation for MoE presets (grouped_mm, batched_mm, eager)")
    parser.add_argument("--torchao", choices=("tensorwise", "rowwise"),
                        help="train the compiled Hugging Face loop in bf16, then with torchao's float8 training of "
                             "this recipe, and report its ratio (install torchao first)")
    parser.add_argument("--mamba-ssm", action="store_true",
                        help="for a Mamba preset, train mamba_ssm's model (its CUDA kernels) instead of transformers'")
    parser.add_argument("--profile", type=Path, help="also write the profiler table of 3 nanotron steps here")
    parser.add_argument("--override", nargs="*", default=[], help="nanotron config overrides (section.key=value)")
    parser.add_argument("--save-to", type=Path, help="also time checkpoint saves (foreground, background) into here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: the benchmark needs a CUDA device")
    mamba = bool(PRESETS[args.preset].get("is_mamba_config"))
    if args.mamba_ssm and not mamba:
        sys.exit(f"error: --mamba-ssm needs a Mamba preset, not {args.preset}")
    if mamba and not (args.mamba_ssm or args.no_hf):
        sys.exit(f"error: {args.preset} has no transformers loop here; pass --mamba-ssm (the authors' kernels) "
                 "or --no-hf")
    if args.torchao and (mamba or args.no_hf):
        sys.exit("error: --torchao trains the Hugging Face loop: drop --no-hf, and use a transformer preset")
    args.hf_compile = args.hf_compile or bool(args.torchao)  # float8 pays only compiled

    nanotron, micro_batches = run_nanotron(args, args.preset, args.override, args.profile)
    results = {"preset": args.preset, "sequence_length": args.sequence_length, "micro_batch_size": args.micro_batch_size,
               "accumulation": args.accumulation, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "hf_compiled": args.hf_compile, "nanotron": nanotron}
    rows, ratios = [(" ".join([args.preset, *args.override]), nanotron)], []
    if args.versus or args.versus_override:
        gc.collect()
        torch.cuda.empty_cache()
        preset = args.versus or args.preset
        second = run_nanotron(args, preset, args.override + args.versus_override)[0]
        label = " ".join([preset, *args.versus_override])
        results["versus"] = {"preset": preset, "overrides": args.versus_override, "nanotron": second,
                             "ratio": nanotron["tokens_per_sec"] / second["tokens_per_sec"]}
        rows.append((label, second))
        ratios.append((rows[0][0], label, results["versus"]["ratio"]))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 and (args.mamba_ssm or not args.no_hf):
        from nanotron.metrics import peak_flops

        peak = peak_flops(torch.device("cuda"), torch.bfloat16)
        peers = [("mamba_ssm", run_mamba_ssm, {})] if args.mamba_ssm else [("hf", run_hf, {})]
        if args.torchao:
            peers.append((f"hf_torchao_{args.torchao}", run_hf, {"float8_recipe": args.torchao}))
        for name, run_peer, options in peers:
            gc.collect()
            torch.cuda.empty_cache()
            results[name] = run_peer(args, micro_batches, nanotron["flops_per_token"], peak, **options)
            rows.append((name, results[name] | {"layout": "1 GPU"}))
        first = peers[0][0]
        results["speedup"] = nanotron["tokens_per_sec"] / results[first]["tokens_per_sec"]
        ratios.append((rows[0][0], first, results["speedup"]))
        for name, _, _ in peers[1:]:  # torchao's float8 against the same loop in bf16
            results[f"{name}_ratio"] = results[name]["tokens_per_sec"] / results[first]["tokens_per_sec"]
            ratios.append((name, first, results[f"{name}_ratio"]))
    if not dist.is_initialized() or dist.get_rank() == 0:
        args.output.write_text(json.dumps(results, indent=2))
        print("| run | layout | tokens/s | tokens/s/GPU | MFU | peak memory (GB) |")
        for label, row in rows:
            print(f"| {label} | {row['layout']} | {row['tokens_per_sec']:,.0f} | {row['tokens_per_sec_per_gpu']:,.0f} "
                  f"| {row['mfu'] or 0:.1%} | {row['peak_memory_gb']:.1f} |")
        for numerator, denominator, ratio in ratios:
            print(f"{numerator} / {denominator}: {ratio:.2f}x tokens/s")


if __name__ == "__main__":
    main()
