"""The step-time planner's kernel table: the speed of every kernel class a training step runs, measured on this GPU at
the points that price the benchmark shapes and their tensor-, expert- and context-parallel splits
(``planning/kernels.py`` states the kernels, their dims and how the planner interpolates between the points).

    python scripts/planner_kernels.py                 # CUDA: write src/nanotron/planning/kernel_tables/<gpu>.json
    python scripts/planner_kernels.py --check T.json  # print the planner's predictions of the records from table T
    python scripts/planner_kernels.py --config-file C --tp 1 2 --output T.json   # one config's shape (CPU: tests)

Each point is timed after one warm-up call, with CUDA events (wall clock on a CPU), over enough calls to last about
``--budget-ms`` (at most 20): a GEMM in the layout ``F.linear`` and its backward use (forward ``x W^T``, input
gradient ``g W``, weight gradient ``g^T x``), the attention core's forward and its backward through the model's own
``attend`` (SDPA's causal kernel, or FlashAttention-4 where the config's ``model.attention_backend`` runs it; the
backward's time is that of forward and backward less the forward's), the experts' forward and backward through the
model's ``GroupedExperts`` (grouped GEMMs on CUDA), and the elementwise bandwidth of one fused ``addcmul`` (three reads
and a write) over an activation. After recording on a GPU whose records are committed, the check's table is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmark import nanotron_config
from benchmark_record import git_commit
from planner_efficiency import CHECKED, record_run

from nanotron.config import Config, load_config
from nanotron.layout import Layout
from nanotron.models.moe.model import GroupedExperts
from nanotron.nn.attention import AttentionMasks, attend
from nanotron.nn.flash_attention import use_flash_attention
from nanotron.planning import kernels as k
from nanotron.planning.step_time import predict, update_seconds

# (preset, sequence, micro-batch): the shapes of the single-GPU records the planner is checked against.
SHAPES = [("llama1b", 4096, 4), ("llama8b", 4096, 1), ("mixtral", 4096, 2), ("llama1b", 32768, 1),
          ("llama1b", 131072, 1)]
TP = (1, 2, 4, 8)
EP = (2, 4, 8)  # for a mixture of experts, at tp 1
CP = (2, 4)  # for sequences of 32k tokens and more, at tp 1
MAX_CALLS = 20


def preset_config(preset: str, sequence_length: int, micro_batch_size: int, overrides: list[str]) -> Config:
    args = argparse.Namespace(sequence_length=sequence_length, micro_batch_size=micro_batch_size, accumulation=1,
                              steps=1, warmup=0, data="unused", save_to=None)
    return nanotron_config(args, preset, ["model.compile=true", *overrides])


def layouts(config: Config, tp: tuple[int, ...]) -> list[Layout]:
    """The splits of ``config`` whose kernels the table prices: ``tp``'s sizes, and at tp 1 ``EP``'s for a mixture of
    experts and ``CP``'s for sequences of 32k tokens and more."""
    base = Layout.from_config(config)
    splits = [replace(base, tp=size, sequence_parallel=size > 1) for size in tp]
    if config.model.model_config.moe is not None:
        splits += [replace(base, ep=size) for size in EP]
    if base.sequence_length >= 32768:
        splits += [replace(base, cp=size) for size in CP]
    return splits


def points(configs: list[Config], tp: tuple[int, ...]) -> dict[tuple[str, tuple[int, ...]], Config]:
    """(kind, dims) of every point that prices the kernels of ``configs`` at their splits (each kernel's own dims and
    the powers of two around them), with the first config that needs it (the attention's heads and the model dtype
    are read from it)."""
    found: dict[tuple[str, tuple[int, ...]], Config] = {}
    for config in configs:
        layers = range(config.model.model_config.num_hidden_layers)
        for layout in layouts(config, tp):
            for kernel in k.micro_batch_kernels(config, layout, layers, head=True):
                for point in [*k.corners(kernel.dims), tuple(round(d) for d in kernel.dims)]:
                    found.setdefault((k.measured_kind(kernel.kind), point), config)
    return found


def timed(call, device: torch.device, budget: float) -> float:
    """Seconds per call of ``call`` after one warm-up call, over enough calls to last about ``budget`` seconds."""
    call()
    if device.type == "cuda":
        def clock(calls: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                call()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
    else:
        def clock(calls: int) -> float:
            start = time.perf_counter()
            for _ in range(calls):
                call()
            return (time.perf_counter() - start) / calls
    once = clock(1)
    return clock(max(1, min(MAX_CALLS, round(budget / max(once, 1e-9))))) if once < budget else once


def gemm(kind: str, dims: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """(call, FLOPs) of a GEMM of ``kind`` at (m, n, k), in the layout the linear's autograd uses."""
    m, n, inner = dims
    if kind == k.GEMM_FORWARD:
        x, w = torch.randn(m, inner, dtype=dtype, device=device), torch.randn(n, inner, dtype=dtype, device=device)
        return (lambda: F.linear(x, w)), 2.0 * m * n * inner
    if kind == k.GEMM_INPUT_GRADIENT:
        g, w = torch.randn(m, inner, dtype=dtype, device=device), torch.randn(inner, n, dtype=dtype, device=device)
        return (lambda: g @ w), 2.0 * m * n * inner
    g, x = torch.randn(inner, m, dtype=dtype, device=device), torch.randn(inner, n, dtype=dtype, device=device)
    return (lambda: g.t() @ x), 2.0 * m * n * inner


def attention_inputs(config: Config, dims: tuple[int, ...], device: torch.device):
    """(q, k, v, mask, forward FLOPs) of an attention core at (sequence, head dim) with the config's heads, over
    sequences of at least the config's micro-batch tokens, and the mask the model uses."""
    sequence, head_dim = dims
    c, dtype = config.model.model_config, config.model.torch_dtype()
    batch = max(1, config.tokens.micro_batch_size * config.tokens.sequence_length // sequence)
    q = torch.randn(batch, c.num_attention_heads, sequence, head_dim, dtype=dtype, device=device, requires_grad=True)
    kv = [torch.randn(batch, c.num_key_value_heads, sequence, head_dim, dtype=dtype, device=device,
                      requires_grad=True) for _ in range(2)]
    flash = use_flash_attention(config.model.attention_backend, device, dtype, head_dim)
    mask = AttentionMasks.of_sequence(sequence, device, flash=flash).for_window(None)
    return q, *kv, mask, 2.0 * batch * c.num_attention_heads * head_dim * sequence * sequence


def measure(kind: str, dims: tuple[int, ...], config: Config, device: torch.device, budget: float
            ) -> tuple[float, float]:
    """(seconds, work) of one point: FLOPs in the planner's count, bytes for the elementwise bandwidth."""
    dtype = config.model.torch_dtype()
    if kind.startswith("gemm."):
        call, flops = gemm(kind, dims, dtype, device)
        return timed(call, device, budget), flops
    if kind.startswith("attention."):
        q, key, value, mask, flops = attention_inputs(config, dims, device)
        forward = timed(lambda: attend(q, key, value, mask), device, budget)
        if kind == k.ATTENTION_FORWARD:
            return forward, flops
        grad = torch.randn_like(q)
        both = timed(lambda: torch.autograd.grad(attend(q, key, value, mask), (q, key, value), grad), device, budget)
        return max(both - forward, 1e-9), 2 * flops
    if kind.startswith("experts."):
        experts, per_expert, hidden, ffn = dims
        module = GroupedExperts(experts, hidden, ffn, config.model.model_config.hidden_act).to(device, dtype)
        for weight in module.parameters():
            torch.nn.init.normal_(weight, std=0.02)
        x = torch.randn(experts * per_expert, hidden, dtype=dtype, device=device, requires_grad=True)
        counts = torch.full((experts,), per_expert, device=device)
        flops = 6.0 * experts * per_expert * hidden * ffn
        forward = timed(lambda: module(x, counts), device, budget)
        if kind == k.EXPERTS_FORWARD:
            return forward, flops
        grad = torch.randn(experts * per_expert, hidden, dtype=dtype, device=device)
        inputs = (x, *module.parameters())
        both = timed(lambda: torch.autograd.grad(module(x, counts), inputs, grad), device, budget)
        return max(both - forward, 1e-9), 2 * flops
    (elements,) = dims
    a, b, c = (torch.randn(elements, dtype=dtype, device=device) for _ in range(3))
    return timed(lambda: torch.addcmul(c, a, b), device, budget), 4.0 * elements * dtype.itemsize


def record(configs: list[Config], tp: tuple[int, ...], device: torch.device, budget: float) -> list[dict]:
    """Every point's entry, measured in turn, with progress on stdout."""
    wanted = points(configs, tp)
    print(f"{len(wanted)} points on {device}", flush=True)
    entries, start = [], time.perf_counter()
    for index, ((kind, dims), config) in enumerate(sorted(wanted.items(), key=lambda item: item[0]), 1):
        seconds, work = measure(kind, dims, config, device, budget)
        entries.append({"kind": kind, "dims": list(dims), "seconds": seconds, "work": work})
        if index % 25 == 0 or index == len(wanted):
            print(f"  {index}/{len(wanted)} after {time.perf_counter() - start:.0f} s: {kind} {dims} "
                  f"{work / seconds / 1e12:.1f} T/s", flush=True)
    return entries


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def table_name(gpu: str) -> str:
    """The cluster preset (``cluster.GPU.table``) whose table a GPU's measurements are."""
    return next((name for name in ("h100", "h200") if name.upper() in gpu.upper()), gpu.lower().replace(" ", "-"))


def checked_rows(table: k.KernelTable) -> list[dict]:
    """Per committed single-GPU record of the table's GPU that the table prices: the measured step, the planner's
    prediction from the table and from its power-of-two points alone (each kernel interpolated, as a shape the
    recorder was not given), and where the predicted step goes (the kernels' seconds by class, the update's)."""
    grid, rows = table.grid_only(), []
    for name, system in CHECKED:
        record_data, result, config, layout, cluster = record_run(name, system)
        if record_data["gpu"] != table.gpu or table.refusal(config) is not None:
            continue
        kernels = k.micro_batch_kernels(config, layout, range(config.model.model_config.num_hidden_layers), True)
        seconds = {kind: 0.0 for kind in ("gemm", "attention", "experts", "elementwise")}
        for kernel in kernels:
            seconds[kernel.kind.split(".")[0]] += table.seconds([kernel]) * layout.accumulation
        rows.append({"record": name, "system": system, "attention": result.get("attention", "torch"),
                     "measured_s": result["step_time_s"], "predicted_s": predict(config, layout, cluster, table).step,
                     "interpolated_s": predict(config, layout, cluster, grid).step,
                     "parts": seconds | {"update": update_seconds(config, layout, cluster, 0)}})
    return rows


def check(table: k.KernelTable) -> None:
    """Prints ``checked_rows``: the predictions against the records, then where each predicted step goes."""
    print(f"kernels: {table.source} ({table.gpu}, attention {table.attention})")
    print("| record | measured s | predicted s | error | interpolated s | error |")
    print("|---|---|---|---|---|---|")
    rows = checked_rows(table)
    for row in rows:
        note = f", ran {row['attention']} attention" if row["attention"] != table.attention else ""
        cells = [f"{row[key]:.4f} | {row[key] / row['measured_s'] - 1:+.1%}"
                 for key in ("predicted_s", "interpolated_s")]
        print(f"| {row['record']} ({row['system']}{note}) | {row['measured_s']:.4f} | {' | '.join(cells)} |")
    if not rows:
        print(f"(no committed record of a {table.gpu} that the table prices)")
        return
    parts = list(rows[0]["parts"])
    print("\n| record | " + " | ".join(f"{part} s" for part in parts) + " |")
    print("|---|" + "---|" * len(parts))
    for row in rows:
        print(f"| {row['record']} | " + " | ".join(f"{row['parts'][part]:.4f}" for part in parts) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", default=None, help="record this config's shape instead of the presets'")
    parser.add_argument("--tp", type=int, nargs="+", default=list(TP), help="tensor-parallel splits to price")
    parser.add_argument("--output", default=None, help="default: src/nanotron/planning/kernel_tables/<gpu>.json")
    parser.add_argument("--budget-ms", type=float, default=20.0, help="time each point over about this long")
    parser.add_argument("--check", default=None, metavar="TABLE", help="only print the check of this table")
    parser.add_argument("--commit", default=None, help="the commit measured, where the checkout has no git")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides of the presets' shapes (model.attention_backend=torch: SDPA's kernels "
                             "where FlashAttention-4 is installed)")
    args = parser.parse_args()
    if args.check is not None:
        if not Path(args.check).is_file():
            parser.error(f"--check {args.check}: no such table (recorded ones: {k.TABLES}/<gpu>.json)")
        check(k.KernelTable.read(Path(args.check)))
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configs = ([load_config(args.config_file, args.override)] if args.config_file else
               [preset_config(*shape, args.override) for shape in SHAPES])
    entries = record(configs, tuple(args.tp), device, args.budget_ms / 1e3)
    gpu = gpu_name(device)
    backend = {use_flash_attention(c.model.attention_backend, device, c.model.torch_dtype(),
                                   c.model.model_config.head_dim) for c in configs}
    output = Path(args.output) if args.output else k.TABLES / f"{table_name(gpu)}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    header = json.dumps({
        "about": "Measured kernel speeds for the step-time planner (planning/kernels.py): work (FLOPs, bytes for "
                 "the elementwise kinds) over seconds per point; written by scripts/planner_kernels.py.",
        "gpu": gpu, "torch": torch.__version__, "commit": args.commit or (git_commit() or ("unknown", False))[0],
        "attention": "fa4" if backend == {True} else "torch",
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)}, indent=1)
    lines = ",\n".join("  " + json.dumps(entry) for entry in entries)  # one point a line
    output.write_text(f'{header[:-2]},\n "entries": [\n{lines}\n ]\n}}\n')
    print(f"wrote {output}", flush=True)
    check(k.KernelTable.read(output))


if __name__ == "__main__":
    main()
