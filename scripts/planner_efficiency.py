"""The step-time planner's efficiency table from the committed single-GPU records, and its check against records.

    python scripts/planner_efficiency.py            # write src/nanotron/planning/efficiency.json, print the check

Each record of ``TABLE`` becomes one entry (``planning/efficiency.py`` says how its speed is derived). The check
predicts the step of every record of ``CHECKED`` with the planner: those in the table from the table without
their own entry (leave one out: the speed of the nearest other shape), the others from the whole table.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from benchmark import nanotron_config

from nanotron.layout import Layout
from nanotron.models.registry import spec_for_config
from nanotron.planning.cluster import CLUSTERS, TB
from nanotron.planning.efficiency import TABLE as TABLE_PATH
from nanotron.planning.efficiency import Efficiency, Entry, hardware_flops
from nanotron.planning.step_time import predict, update_seconds

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# (record, system): the measurements the table is made of, one per family and shape.
TABLE = [
    ("2026-12-04-h200-llama1b-remainders-peers.json", "nanotron"),
    ("2026-12-04-h200-llama1b-seq8192-held-gradients.json", "nanotron"),
    ("2026-12-03-h200-llama1b-seq32k.json", "nanotron"),
    ("2026-12-03-h200-llama1b-seq128k-selective.json", "nanotron"),
    ("2026-12-04-h200-llama8b-fp8-false-held-gradients.json", "nanotron"),
    ("2026-12-04-h200-mixtral-remainders-default-peers.json", "nanotron"),
    ("2026-12-04-h200-mamba1.4b-llama1.4b.json", "nanotron"),
    ("2026-12-04-h200-mamba130m-llama130m.json", "nanotron"),
    ("2026-12-04-h200-llama1b-fp8-delayed-held-gradients.json", "nanotron-fp8"),
    ("2026-12-04-h200-llama8b-fp8-true-held-gradients.json", "nanotron"),
]
# Records the check predicts: the table's 1B, 8B, mixtral and 32k rows (left out in turn) and records of other
# micro-batch sizes, GPUs and attention kernels that the table does not hold.
CHECKED = [
    ("2026-12-04-h200-llama1b-remainders-peers.json", "nanotron"),
    ("2026-12-04-h200-llama8b-fp8-false-held-gradients.json", "nanotron"),
    ("2026-12-04-h200-mixtral-remainders-default-peers.json", "nanotron"),
    ("2026-12-03-h200-llama1b-seq32k.json", "nanotron"),
    ("2026-12-03-h200-llama1b-seq128k-selective.json", "nanotron"),
    ("2026-12-04-h200-llama1b-mbs8-held-gradients.json", "nanotron"),
    ("2026-12-06-h100-80gb-hbm3-llama1b-house.json", "nanotron"),
    ("2026-12-06-h100-80gb-hbm3-llama1b-seq32k-fa4.json", "nanotron-torch-attention"),
    ("2026-12-06-h100-80gb-hbm3-mixtral-fa4.json", "nanotron"),
    ("2026-12-06-h100-80gb-hbm3-llama1b-zero3-vs-zero0.json", "nanotron-versus"),
    ("2026-12-06-h100-80gb-hbm3-mixtral-peers.json", "nanotron"),
    ("2026-12-06-h100-80gb-hbm3-qwen3-1.7b-peers.json", "nanotron"),
    ("2026-12-06-h100-80gb-hbm3-qwen3-moe-peers.json", "nanotron"),
    ("2026-12-06-h100-80gb-hbm3-deepseek-v3-peers.json", "nanotron"),
    ("2026-12-06-h200-llama8b-zero3-vs-zero0.json", "nanotron-versus"),
    ("2026-12-06-h200-mixtral.json", "nanotron"),
    ("2026-12-06-h200-llama1b-mbs4-fa4.json", "nanotron-torch-attention"),
    ("2026-12-06-h200-llama1b-seq32k-fa4.json", "nanotron-torch-attention"),
    ("2026-12-06-h100-80gb-hbm3-qwen3-moe-bf16-moments-peers.json", "nanotron-bf16-moments"),
    ("2026-12-06-h100-80gb-hbm3-deepseek-v3-bf16-moments-peers.json", "nanotron-bf16-moments"),
]


def record_run(name: str, system: str):
    """(record, its system's results, the config it trained, its one-GPU layout, the cluster preset of its GPU)."""
    record = json.loads((RESULTS / name).read_text())
    result = record["systems"][system]
    args = argparse.Namespace(sequence_length=record["sequence_length"], micro_batch_size=record["micro_batch_size"],
                              accumulation=record["accumulation"], steps=1, warmup=0, data="unused", save_to=None)
    config = nanotron_config(args, result["preset"], list(result["overrides"]))
    cluster = CLUSTERS["h100" if "H100" in record["gpu"] else "h200"]
    return record, result, config, Layout.from_config(config), cluster


def table_entry(name: str, system: str) -> Entry:
    record, result, config, layout, cluster = record_run(name, system)
    layers = range(len(spec_for_config(config.model.model_config).costs(
        config.model.model_config, config.model.model_config.vocab_size, layout.sequence_length).layer_flops))
    flops = hardware_flops(config, layout, layers, head=True)[0] * layout.accumulation
    computing = result["step_time_s"] - update_seconds(config, layout, cluster, 0)
    return Entry(family=spec_for_config(config.model.model_config).name,
                 precision="fp8" if config.fp8 is not None and config.fp8.enabled else "bf16",
                 hidden_size=config.model.model_config.hidden_size, sequence_length=layout.sequence_length,
                 micro_batch_size=layout.micro_batch_size, recompute=config.parallelism.recompute, gpu=record["gpu"],
                 step_time_s=round(result["step_time_s"], 4), tflops=round(flops / computing / TB, 1),
                 source=name)


def checked_rows(table: list[Entry]) -> list[dict]:
    """Per checked record: its shape, measured and predicted step and the entry the prediction used."""
    from nanotron.planning.efficiency import nearest

    rows = []
    for name, system in CHECKED:
        record, result, config, layout, cluster = record_run(name, system)
        others = [e for e in table if e.source != name]
        predicted = predict(config, layout, cluster, Efficiency(cluster.gpu.peak_tflops, tuple(others))).step
        rows.append({"record": name, "system": system, "gpu": record["gpu"], "measured_s": result["step_time_s"],
                     "predicted_s": predicted,
                     "error": predicted / result["step_time_s"] - 1, "from": nearest(config, layout, others).source,
                     "held_out": len(others) == len(table)})
    return rows


def main() -> None:
    table = [table_entry(name, system) for name, system in TABLE]
    TABLE_PATH.write_text(json.dumps({
        "about": "Effective hardware TFLOP/s of the forwards and backwards per family and shape, from the records "
                 "in benchmarks/results (source); written by scripts/planner_efficiency.py.",
        "entries": [asdict(entry) for entry in table]}, indent=1) + "\n")
    print("| record | measured s | predicted s | error | speed from |")
    print("|---|---|---|---|---|")
    for row in checked_rows(table):
        print(f"| {row['record']} ({row['system']}) | {row['measured_s']:.4f} | {row['predicted_s']:.4f} | "
              f"{row['error']:+.1%} | {row['from']}{'' if row['held_out'] else ' (own row left out)'} |")


if __name__ == "__main__":
    main()
