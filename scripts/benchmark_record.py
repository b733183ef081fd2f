"""The record a ``scripts/benchmark.py`` run leaves: one JSON file per run in ``benchmarks/results/``, named
``<date>-<gpu>-<name>.json``, which ``docs/benchmarks.md`` cites and ``scripts/benchmark_table.py`` turns into the
performance tables (docs/benchmarks.md, the README's headline). Everything here is pure (no GPU), so the schema
is tested on a CPU.

A record holds the run's facts (date and UTC time, preset, GPU, commit, torch, the command, the shape) and
``systems``: each measured system's ``tokens_per_sec``, ``mfu``, ``peak_memory_gb`` and, where measured,
``state_memory_gb`` (weights, gradients and optimizer state), ``activation_memory_gb`` (the peak minus that state)
and ``kept_for_backward_gb`` (what the forward holds when the backward starts, ``BackwardStart``). ``ratios`` maps
every other system to the ``reference`` system's tokens/s over its own, all from the same call. ``convention`` names
how FLOPs were counted for MFU: ``megatron`` (the LM head counted, the input-embedding lookup not).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MFU_CONVENTION = "megatron"
REQUIRED = ("date", "preset", "gpu", "commit", "torch", "command", "sequence_length", "micro_batch_size",
            "convention", "reference", "systems", "ratios")
SYSTEM_FIELDS = ("tokens_per_sec", "mfu", "peak_memory_gb")
# Environment variables that change what a run measures, kept in the recorded command.
RECORDED_ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS",
                        "NCCL_ALGO", "NCCL_PROTO")
RECORDED_ENVIRONMENT_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_")


def build_record(*, date: str, recorded_at: str, preset: str, gpu: str, world_size: int, commit: str, dirty: bool,
                 torch_version: str, versions: dict[str, str], command: str, sequence_length: int,
                 micro_batch_size: int, accumulation: int, steps: int, warmup: int, systems: dict[str, dict],
                 reference: str) -> dict:
    """The run's record; ``ratios`` are the ``reference`` system's tokens/s over each other system's."""
    missing = {name: [f for f in SYSTEM_FIELDS if f not in system] for name, system in systems.items()}
    if reference not in systems or any(missing.values()):
        raise ValueError(f"systems {sorted(systems)} (reference {reference!r}) lack fields: {missing}")
    ratios = {name: systems[reference]["tokens_per_sec"] / system["tokens_per_sec"]
              for name, system in systems.items() if name != reference}
    return {"date": date, "recorded_at": recorded_at, "preset": preset, "gpu": gpu, "world_size": world_size,
            "commit": commit, "dirty": dirty, "torch": torch_version, "versions": versions, "command": command,
            "sequence_length": sequence_length, "micro_batch_size": micro_batch_size, "accumulation": accumulation,
            "steps": steps, "warmup": warmup,
            "convention": MFU_CONVENTION, "reference": reference, "systems": systems, "ratios": ratios}


def record_problems(record: dict) -> list[str]:
    """What makes ``record`` unusable for the table, one line each (empty when it is complete)."""
    problems = [f"no {key!r}" for key in REQUIRED if key not in record]
    systems = record.get("systems", {})
    for name, system in systems.items():
        problems += [f"systems.{name} has no {field!r}" for field in SYSTEM_FIELDS if field not in system]
    if systems and record.get("reference") not in systems:
        problems.append(f"reference {record.get('reference')!r} is not among the systems {sorted(systems)}")
    problems += [f"ratios.{name} names no system" for name in record.get("ratios", {}) if name not in systems]
    return problems


def nanotron_names(first: dict, second: dict | None) -> tuple[str, str | None]:
    """Names of one or two nanotron runs of a call (each a dict with ``preset`` and ``precision``): ``nanotron``
    alone; by precision when two runs compare precisions (``nanotron-fp8`` / ``nanotron-bf16``); by the Adam
    moments' dtype when they compare those (``nanotron-bf16-moments`` / ``nanotron-fp32-moments``; runs recorded
    without ``adam_moments`` had fp32 moments); by how they hold the masters (``nanotron-remainders-masters`` /
    ``nanotron-fp32-masters``); by their attention kernels (``nanotron-fa4-attention`` /
    ``nanotron-torch-attention``; runs recorded without ``attention`` ran torch's); by their optimizer
    (``nanotron-muon`` / ``nanotron-adamw``; runs recorded without ``optimizer`` ran AdamW); else the second run is
    named for its preset (``--versus``), or ``nanotron-versus`` when only other overrides differ."""
    if second is None:
        return "nanotron", None
    if first["precision"] != second["precision"]:
        return f"nanotron-{first['precision']}", f"nanotron-{second['precision']}"
    moments = [run.get("adam_moments", "fp32") for run in (first, second)]
    if moments[0] != moments[1]:
        return f"nanotron-{moments[0]}-moments", f"nanotron-{moments[1]}-moments"
    masters = [run.get("masters", "fp32") for run in (first, second)]
    if masters[0] != masters[1]:
        return f"nanotron-{masters[0]}-masters", f"nanotron-{masters[1]}-masters"
    attention = [run.get("attention", "torch") for run in (first, second)]
    if attention[0] != attention[1]:
        return f"nanotron-{attention[0]}-attention", f"nanotron-{attention[1]}-attention"
    optimizers = [run.get("optimizer", "adamw") for run in (first, second)]
    if optimizers[0] != optimizers[1]:
        return f"nanotron-{optimizers[0]}", f"nanotron-{optimizers[1]}"
    if first["preset"] != second["preset"]:
        return "nanotron", f"nanotron-{second['preset']}"
    return "nanotron", "nanotron-versus"


def gpu_label(device_name: str) -> str:
    """The device without its vendor: ``NVIDIA H200`` -> ``H200``."""
    return re.sub(r"^(nvidia|amd)\s+", "", device_name.strip(), flags=re.IGNORECASE)


def gpu_slug(device_name: str) -> str:
    """The file-name part for a device: ``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_label(device_name).lower()).strip("-") or "gpu"


def result_path(folder: Path, date: str, gpu: str, name: str) -> Path:
    """``<date>-<gpu>-<name>.json`` in ``folder``, with ``-2``, ``-3``... when a run of that name exists: every run
    keeps its own file."""
    stem = f"{date}-{gpu_slug(gpu)}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}"
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    return path


def write_record(record: dict, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = result_path(folder, record["date"], record["gpu"], name)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def command_line(argv: list[str], environ: dict[str, str]) -> str:
    """The command as typed: the launcher (``torchrun`` with the local process count, else ``python``), the script
    and its arguments, preceded by the environment variables that change what it measures."""
    launcher = ["python"]
    if "TORCHELASTIC_RUN_ID" in environ:
        launcher = ["torchrun", f"--nproc_per_node={environ.get('LOCAL_WORLD_SIZE', '1')}"]
        if int(environ.get("GROUP_WORLD_SIZE", "1")) > 1:
            launcher.insert(1, f"--nnodes={environ['GROUP_WORLD_SIZE']}")
    settings = [f"{key}={environ[key]}" for key in sorted(environ)
                if key in RECORDED_ENVIRONMENT or key.startswith(RECORDED_ENVIRONMENT_PREFIXES)]
    return shlex.join([*settings, *launcher, *argv])


def git_commit(root: Path = ROOT) -> tuple[str, bool] | None:
    """The checkout's commit and whether tracked files differ from it; None outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit.stdout.strip(), bool(status.stdout.strip())


def kernel_parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The arguments every kernel benchmark takes (``--repeats``, ``--output``, ``--commit``), described by the
    first line of the script's ``doc``; a script adds its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--commit", help="the commit measured, where the checkout has no git metadata")
    return parser


def kernel_record(name: str, commit: str | None, results, **fields) -> dict:
    """The record of a kernel benchmark (the ``scripts/benchmark_*.py`` that time one kernel): its ``name``, the GPU,
    torch, the commit measured (``commit`` where the checkout has no git metadata) and the command, then ``fields``
    and the ``results``."""
    import torch

    measured = (commit, False) if commit else git_commit()
    return {"name": name, "gpu": gpu_label(torch.cuda.get_device_name()), "torch": torch.__version__,
            "commit": measured[0][:7] if measured else None, "dirty": measured[1] if measured else None,
            "command": command_line(sys.argv, dict(os.environ)), **fields, "results": results}


def median_cuda_ms(step, repeats: int, warmup: int = 3) -> float:
    """The median time of ``step()`` on the current CUDA device (ms, CUDA events), after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def memory_fields(peak_bytes: int, step_start_bytes: int, baseline_bytes: int, freed_gradient_bytes: int,
                  backward_start_bytes: int | None = None) -> dict:
    """How a system's peak splits, from what was allocated: ``state_memory_gb``, its weights, gradients and optimizer
    state, is what it holds when a step starts (after the first step, so the optimizer state exists), less what was
    allocated before it was built (``baseline_bytes``: an earlier run's leftovers), plus the gradients its loop frees
    after every update (``freed_gradient_bytes``, read after a backward); ``activation_memory_gb`` is the rest of the
    peak (activations, logits, workspaces); ``kept_for_backward_gb`` (None where not read) is what was allocated when
    the step's first backward started beyond what the step started with (``BackwardStart``)."""
    state = step_start_bytes - baseline_bytes + freed_gradient_bytes
    kept = None if backward_start_bytes is None else (backward_start_bytes - step_start_bytes) / 1e9
    return {"state_memory_gb": state / 1e9,
            "activation_memory_gb": (peak_bytes - step_start_bytes - freed_gradient_bytes) / 1e9,
            "kept_for_backward_gb": kept}


class BackwardStart:
    """The bytes allocated when a step's first backward starts, read by a gradient hook on the step's first loss.

    The peak less the weights, gradients and optimizer state understates the activations of a loop that frees its
    gradients after every update (``zero_grad(set_to_none=True)``): its peak comes early in the backward, before most
    gradients exist again, yet all of them are subtracted. What is allocated when the backward starts, less what the
    step started with, is what the forward kept for the backward (activations and the loss's inputs) whatever a loop
    does with its gradients. ``new_step()`` before each step; ``watch(loss)`` on every loss the step computes.
    """

    def __init__(self, allocated):
        self.allocated = allocated  # () -> bytes allocated now, e.g. torch.cuda.memory_allocated
        self.bytes: int | None = None
        self._armed = False

    def new_step(self) -> None:
        self._armed = True

    def watch(self, loss) -> None:
        if self._armed and loss.requires_grad:
            self._armed = False
            loss.register_hook(self._record)

    def _record(self, grad) -> None:
        self.bytes = self.allocated()


def installed_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Versions of the installed distributions among ``names`` (the peers' libraries)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found
