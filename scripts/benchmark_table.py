"""Writes the performance tables from the benchmark records, so that the documents show the measured figures.

    python scripts/benchmark_table.py            # rewrite the tables between the markers
    python scripts/benchmark_table.py --check    # exit 1 if a table is not what the records give

docs/benchmarks.md holds the newest record of each comparison (preset, GPU, GPU count, shape, the set of systems and
nanotron's config overrides) in ``benchmarks/results/*.json``; README.md holds the headline: of those, the newest
record beside a peer library for each preset, shape and nanotron precision, where nanotron trains the preset's model
as it is. One row per system, each with its tokens/s ratio to the record's reference system (nanotron) measured in
the same call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmark_record import MFU_CONVENTION, RESULTS, ROOT, gpu_label, record_problems

BEGIN = "<!-- performance table: written by scripts/benchmark_table.py from benchmarks/results; do not edit -->"
END = "<!-- end of performance table -->"
HEADER = ("| record | system | tokens/s | tokens/s/GPU | MFU | peak memory (GB) | activations (GB) | "
          "first row ÷ system |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
OLD_CONVENTION_NOTE = ("† MFU counted 6 FLOPs per parameter including the input-embedding lookup (the convention "
                       "before Megatron-LM's);\nfor an untied model it reads higher than in Megatron-LM's count.")


class RecordError(ValueError):
    pass


def load_records(folder: Path) -> list[tuple[Path, dict]]:
    """Every record in ``folder``; an unreadable or incomplete one is an error."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except ValueError as error:
            raise RecordError(f"{path}: not JSON ({error})") from None
        problems = record_problems(record)
        if problems:
            raise RecordError(f"{path}: {'; '.join(problems)}")
        records.append((path, record))
    return records


def newest_comparisons(records: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """The newest record (by date, then UTC time where recorded) of each comparison, by preset, oldest first."""
    newest = {}
    for path, record in sorted(records, key=lambda item: (item[1]["date"], item[1].get("recorded_at", ""))):
        key = (record["preset"], record["gpu"], record.get("world_size", 1), record["sequence_length"],
               record["micro_batch_size"], model_overrides(record),
               tuple(system_label(name, system) for name, system in sorted(record["systems"].items())))
        newest[key] = (path, record)
    return sorted(newest.values(), key=lambda item: (item[1]["preset"], item[1]["date"], item[0].name))


def headline(comparisons: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """Of ``comparisons``, the newest with a peer (a system not named nanotron) for each preset, GPU, shape and
    precision of nanotron's run, among those that train the preset's model unchanged."""
    newest = {}
    for path, record in sorted(comparisons, key=lambda item: (item[1]["date"], item[1].get("recorded_at", ""))):
        peers = [name for name in record["systems"] if not name.startswith("nanotron")]
        if not peers or model_overrides(record):
            continue
        precision = record["systems"][record["reference"]].get("precision", "bf16")
        key = (record["preset"], record["gpu"], record.get("world_size", 1), record["sequence_length"],
               record["micro_batch_size"], precision)
        newest[key] = (path, record)
    return sorted(newest.values(), key=lambda item: (item[1]["preset"], item[1]["sequence_length"],
                                                     item[1]["micro_batch_size"], item[1]["date"]))


def _number(value, form: str) -> str:
    return "—" if value is None else format(value, form)


def model_overrides(record: dict) -> tuple[str, ...]:
    """The overrides of the record's nanotron run that change what is trained (the model, its parallelism or its
    recompute), written ``key=value`` with the key's last part: compiling and precision have rows of their own."""
    overrides = record["systems"][record.get("reference", "nanotron")].get("overrides") or []
    return tuple(override.rsplit(".", 1)[-1] for override in overrides
                 if override.startswith(("model.model_config.", "parallelism.")))


def system_label(name: str, system: dict) -> str:
    """The system's name, with the labelled options it trained with where its name does not say so: its FP8 recipe,
    bf16 Adam moments and, for nanotron, masters held as fp32 copies (remainders are the default; records written
    before ``masters`` was recorded held copies) and gradient buffers kept where nothing is summed."""
    options = []
    if system.get("precision") == "fp8" and "fp8" not in name:
        options.append(f"FP8 {system['fp8_recipe']}" if system.get("fp8_recipe") else "FP8")
    if system.get("adam_moments") == "bf16" and "moments" not in name:
        options.append("bf16 moments")
    if name.startswith("nanotron") and system.get("masters", "fp32") == "fp32" and "masters" not in name:
        options.append("fp32 master copies")
    buffers = [o for o in system.get("overrides") or [] if o.startswith("optimizer.persistent_gradient_buffers=")]
    if buffers and buffers[-1].endswith("=true"):  # the last override of a key is the one applied
        options.append("persistent gradient buffers")
    return f"{name} ({', '.join(options)})" if options else name


def record_label(record: dict) -> str:
    """Date, GPUs, preset, shape (sequence length × micro-batch size) and model overrides of a record."""
    gpus = record.get("world_size", 1)
    devices = f"{gpus} × {gpu_label(record['gpu'])}" if gpus > 1 else gpu_label(record["gpu"])
    shape = f"{record['sequence_length']} × {record['micro_batch_size']}"
    overrides = model_overrides(record)
    changed = f" ({', '.join(overrides)})" if overrides else ""
    return f"{record['date']}, {devices}, {record['preset']}{changed}, {shape}"


def counted_whole_sequences(system: dict) -> bool:
    """A document-masked nanotron run recorded before its FLOPs counted only the attention inside documents (such
    records lack ``causal_flops_per_token``): its MFU counted causal attention over whole sequences, which the run
    skipped, so it is not shown."""
    masked = any(override.endswith("_use_doc_masking=true") for override in system.get("overrides") or [])
    return masked and "causal_flops_per_token" not in system


def record_rows(record: dict, label: str) -> list[str]:
    """One markdown row per system, the reference first; ``label`` fills the first cell of the first row."""
    dagger = "" if record["convention"] == MFU_CONVENTION else "†"
    names = [record["reference"]] + [name for name in record["systems"] if name != record["reference"]]
    rows = []
    for name in names:
        system = record["systems"][name]
        shown = system["mfu"] is not None and not counted_whole_sequences(system)
        mfu = f"{system['mfu']:.1%}{dagger}" if shown else "—"
        ratio = "—" if name == record["reference"] else f"{record['ratios'][name]:.2f}×"
        rows.append(f"| {label if not rows else ''} | {system_label(name, system)} | {system['tokens_per_sec']:,.0f} | "
                    f"{_number(system.get('tokens_per_sec_per_gpu'), ',.0f')} | {mfu} | "
                    f"{system['peak_memory_gb']:.1f} | {_number(system.get('activation_memory_gb'), '.1f')} | "
                    f"{ratio} |")
    return rows


def render(records: list[tuple[Path, dict]], folder: Path = ROOT, headline_only: bool = False) -> str:
    """The table for a document in ``folder`` (header, rows of the newest comparisons or of the headline, the
    convention note when a row needs it)."""
    shown = newest_comparisons(records)
    if headline_only:
        shown = headline(shown)
    lines = [HEADER]
    for path, record in shown:
        relative = Path(os.path.relpath(path.resolve(), folder.resolve())).as_posix()
        lines += record_rows(record, f"[{record_label(record)}]({relative})")
    if any(record["convention"] != MFU_CONVENTION for _, record in shown):
        lines += ["", OLD_CONVENTION_NOTE]
    return "\n".join(lines)


def replace_table(text: str, table: str, name: str) -> str:
    """``text`` (of the document ``name``) with what lies between the markers replaced by ``table``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise RecordError(f"{name} needs the markers {BEGIN!r} and {END!r}, once each, in that order")
    before, rest = text.split(BEGIN)
    after = rest.split(END)[1]
    return f"{before}{BEGIN}\n{table}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a table differs from the records")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="the document of the headline table")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "benchmarks.md",
                        help="the document of the full table")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        records = load_records(args.results)
        documents = {path: (path.read_text(), render(records, path.parent, headline_only))
                     for path, headline_only in ((args.readme, True), (args.page, False))}
        updated = {path: replace_table(text, table, path.name) for path, (text, table) in documents.items()}
    except (OSError, RecordError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stale = [path for path, text in updated.items() if text != documents[path][0]]
    if args.check:
        for path in stale:
            print(f"error: the performance table in {path} differs from {args.results}; run "
                  "python scripts/benchmark_table.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(updated[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
