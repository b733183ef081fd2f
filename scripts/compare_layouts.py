"""Train one config at several parallel layouts and compare their loss curves step by step with the first layout.

    python scripts/compare_layouts.py --config-file examples/config_tiny_llama.yaml --steps 50 \\
        --layouts 1,1,1 2,2,2,z1 --tolerance 1e-3 --output parity.json [--override KEY=VALUE ...]
    python scripts/compare_layouts.py ... --layouts 2,2,2,z1 1,2,1 --resume-at 25 --output resume.json

A layout is ``dp,tp,pp`` with an optional ``,z1`` for ZeRO-1. Every layout trains the same global batch: the number
of micro-batches per replica is adjusted to the data-parallel size, so all of them see the same samples at every
step (rule 4 of docs/design.md) and their losses and gradient norms must agree up to rounding. Each run is a
``torchrun`` of ``run_train.py`` with ``dp * tp * pp`` processes (one per GPU on a CUDA machine, gloo processes on a
CPU-only one) writing to its own folder under ``--work-dir``. Exits with status 1 if a layout's loss differs from the
first's by more than ``--tolerance`` (relative) at any step, or if the first layout's loss does not fall.

The largest gradient-norm difference is reported but not checked: Adam amplifies rounding, so after some tens of
steps the norm drifts by up to ~1e-2 even between two single-process runs that only split the batch into
micro-batches differently, while the loss stays within ~1e-5.

With ``--resume-at STEP`` the first layout also saves a checkpoint at STEP, and every other layout starts from that
checkpoint instead of from scratch: its steps STEP+1.. are compared with the first layout's, which checks that a
checkpoint written at one layout continues the same loss curve at another.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero_stage: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        parts = text.split(",")
        zero = 1 if parts[-1].lower() == "z1" else 0
        dp, tp, pp = (int(p) for p in parts[: 3])
        return cls(dp, tp, pp, zero)

    @property
    def name(self) -> str:
        return f"dp{self.dp}_tp{self.tp}_pp{self.pp}_z{self.zero_stage}"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


def largest_difference(reference: list[dict], other: list[dict], keys: tuple[str, ...]) -> tuple[float, int]:
    """The largest relative difference over ``keys`` between two metric logs, and the step where it occurs."""
    if [r["step"] for r in reference] != [r["step"] for r in other]:
        raise ValueError("the runs logged different steps")
    worst, where = 0.0, 0
    for a, b in zip(reference, other):
        for key in keys:
            difference = abs(a[key] - b[key]) / max(abs(a[key]), 1e-12)
            if difference > worst:
                worst, where = difference, a["step"]
    return worst, where


def train(args, layout: Layout, accumulation: int, folder: Path, resume_from: Path | None = None) -> list[dict]:
    """Train at ``layout`` into ``folder`` (from ``resume_from`` when given) and return its per-step metrics."""
    save_at = args.resume_at if args.resume_at and resume_from is None else 1000000
    overrides = args.override + [  # the layout's own settings last: they win
        f"parallelism.dp={layout.dp}", f"parallelism.tp={layout.tp}", f"parallelism.pp={layout.pp}",
        f"optimizer.zero_stage={layout.zero_stage}", f"tokens.batch_accumulation_per_replica={accumulation}",
        f"tokens.train_steps={args.steps}", f"checkpoints.checkpoints_path={folder}",
        "checkpoints.save_final_state=false",
        f"checkpoints.checkpoint_interval={save_at}", "logging.iteration_step_info_interval=1",
    ]
    if resume_from is not None:
        overrides.append(f"checkpoints.resume_checkpoint_path={resume_from}")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={layout.world_size}",
               str(ROOT / "run_train.py"), "--config-file", str(args.config_file), "--override", *overrides]
    (folder / "metrics.jsonl").unlink(missing_ok=True)
    print(f"{folder.name}: {' '.join(command)}", flush=True)
    if subprocess.run(command).returncode != 0:
        sys.exit(f"error: the run in {folder} failed; its output is above")
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-file", type=Path, required=True)
    parser.add_argument("--layouts", nargs="+", type=Layout.parse, required=True, help="dp,tp,pp[,z1] ...")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--resume-at", type=int, help="other layouts resume from the first layout's checkpoint here")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest relative difference allowed")
    parser.add_argument("--work-dir", type=Path, default=Path("checkpoints/compare_layouts"))
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--override", nargs="*", default=[], help="config overrides for every run (section.key=value)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "src"))
    from nanotron.config import load_config

    config = load_config(args.config_file, args.override)
    if args.resume_at is not None and not 0 < args.resume_at < args.steps:
        sys.exit(f"error: --resume-at {args.resume_at} must lie between 0 and --steps {args.steps}")
    global_micro_batches = config.tokens.batch_accumulation_per_replica * config.parallelism.dp
    for layout in args.layouts:
        if global_micro_batches % layout.dp:
            sys.exit(f"error: the config's {global_micro_batches} micro-batches per step do not split over "
                     f"dp={layout.dp}")

    reference, *others = args.layouts
    reference_folder = args.work_dir / reference.name
    runs = {reference: train(args, reference, global_micro_batches // reference.dp, reference_folder)}
    checkpoint = reference_folder / str(args.resume_at) if args.resume_at else None
    for layout in others:
        folder = args.work_dir / (f"{layout.name}_from_{reference.name}" if checkpoint else layout.name)
        runs[layout] = train(args, layout, global_micro_batches // layout.dp, folder, resume_from=checkpoint)

    report = {"config": str(args.config_file), "steps": args.steps, "resume_at": args.resume_at,
              "tolerance": args.tolerance, "reference": reference.name,
              "first_and_last_loss": [runs[reference][0]["lm_loss"], runs[reference][-1]["lm_loss"]], "layouts": {}}
    losses = [r["lm_loss"] for r in runs[reference]]
    failed = not (losses[-1] < losses[0] and all(r["grad_norm"] > 0 for r in runs[reference]))
    if failed:
        print(f"the reference layout does not train (loss {losses[0]:.4f} -> {losses[-1]:.4f}): nothing to compare")
    compared = [r for r in runs[reference] if r["step"] > (args.resume_at or 0)]
    for layout in others:
        report["layouts"][layout.name] = {}
        for key in ("lm_loss", "grad_norm"):
            worst, step = largest_difference(compared, runs[layout], (key,))
            report["layouts"][layout.name][key] = {"largest_relative_difference": worst, "at_step": step}
            print(f"{layout.name} vs {reference.name}: largest relative {key} difference {worst:.2e} at step {step}")
        failed |= report["layouts"][layout.name]["lm_loss"]["largest_relative_difference"] > args.tolerance
    args.output.write_text(json.dumps(report, indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
