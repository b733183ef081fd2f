"""The README's performance table keeps runs of one shape with other settings apart (the 1B shape at 32k plain and
with document masking are two comparisons, neither replacing the other), and marks the MFU of a document-masked run,
which counts attention as full causal attention and so overstates."""

from __future__ import annotations

import sys

from helpers import ROOT

SCRIPTS = ROOT / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import benchmark_record  # noqa: E402
import benchmark_table  # noqa: E402


def _record(recorded_at: str, tokens: float, mfu: float, overrides: list[str]) -> dict:
    systems = {"nanotron": {"tokens_per_sec": tokens, "tokens_per_sec_per_gpu": tokens, "mfu": mfu,
                            "peak_memory_gb": 70.9, "activation_memory_gb": 48.5, "overrides": overrides}}
    return benchmark_record.build_record(
        date="2026-12-03", recorded_at=recorded_at, preset="llama1b", gpu="NVIDIA H200", world_size=1, commit="abc",
        dirty=False, torch_version="2.11", versions={}, command="python scripts/benchmark.py --data d",
        sequence_length=32768, micro_batch_size=1, accumulation=1, steps=3, warmup=2, systems=systems,
        reference="nanotron")


def test_runs_of_one_shape_with_other_overrides_are_both_shown_and_document_masking_is_marked(tmp_path):
    plain = tmp_path / "2026-12-03-h200-llama1b-seq32k.json"
    masked = tmp_path / "2026-12-03-h200-qwen2-1b-seq32k-docmask.json"
    records = [(plain, _record("2026-12-03T11:10:47+00:00", 33_004.0, 0.462, ["model.compile=true"])),
               (masked, _record("2026-12-03T11:12:06+00:00", 72_610.0, 1.017,
                                ["model.compile=true", "model.model_config._use_doc_masking=true"]))]
    table = benchmark_table.render(records, tmp_path)
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert rows == [
        f"| [2026-12-03, H200, llama1b, 32768 × 1]({plain.name}) | nanotron | 33,004 | 33,004 | 46.2% | 70.9 | 48.5 "
        "| — |",
        f"| [2026-12-03, H200, llama1b, 32768 × 1]({masked.name}) | nanotron | 72,610 | 72,610 | 101.7%‡ | 70.9 | 48.5 "
        "| — |",
    ]
    assert table.endswith(benchmark_table.DOC_MASKING_NOTE)
    assert benchmark_table.DOC_MASKING_NOTE not in benchmark_table.render(records[:1], tmp_path)
