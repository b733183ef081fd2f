"""Save and resume complete training state, atomically.

Layout of ``<checkpoints_path>``::

    latest.txt                      name of the newest complete checkpoint (written last, atomically)
    <step>/checkpoint.json          step, consumed samples per data stage, layout, vocab, files and their sizes
    <step>/config.yaml              the run's config
    <step>/model/*.safetensors      boxes of logical weights (see logical_tensors.py)
    <step>/optimizer/*.safetensors  boxes of Adam moments and fp32 master weights, same naming
    <step>/rng/rank-<rank>.pt       every rank's random generators (world rank, 5 digits)

A save goes to ``.tmp-<step>`` first; only when every rank has finished does rank 0 rename it and update
``latest.txt``. A crash at any moment therefore leaves the previous checkpoint intact and ``latest.txt`` pointing
at it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from nanotron.checkpoint.logical_tensors import FORMAT_VERSION, CheckpointError, LogicalTensorReader, write_boxes
from nanotron.config import Config, save_config
from nanotron.files import atomic_write_text, fsync_path
from nanotron.models.registry import spec_for_config, spec_named
from nanotron.models.spec import CausalLM, ModelSpec
from nanotron.optim.optimizer import MixedPrecisionAdamW
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.placement import Placement, get_placement, logical_buffers, logical_parameters
from nanotron.random import get_rng_state, set_rng_state

logger = logging.getLogger(__name__)

LATEST = "latest.txt"
METADATA = "checkpoint.json"


@dataclass
class TrainingProgress:
    """Where training stands; everything needed to continue the data stream and the LR schedule."""

    step: int = 0
    consumed_samples: dict[str, int] = field(default_factory=dict)  # per data stage name
    lr_schedule_start: int = 0  # the schedule counts steps from here (a resume may restart it)

    @property
    def total_consumed_samples(self) -> int:
        return sum(self.consumed_samples.values())


def _shard_name(parallel_context: ParallelContext) -> str:
    c = parallel_context.coords
    return f"pp{c.pp:03d}-tp{c.tp:03d}-ep{c.ep:03d}"


def _unique_boxes(owners: dict[str, torch.Tensor], parallel_context: ParallelContext, tensors: dict[str, torch.Tensor]):
    """Boxes this rank must write: it holds the only copy among the replicas (every replicated axis at 0).

    ``tensors`` are keyed by logical name, or ``kind/name`` for optimizer state; ``owners`` holds the parameter or
    buffer of each name, whose placement says where the tensor lives.
    """
    coords, sizes = parallel_context.coordinates, parallel_context.sizes
    boxes = []
    for name, tensor in tensors.items():
        placement = get_placement(owners[name.split("/", 1)[-1]])
        if not placement.is_unique_copy(coords):
            continue
        for local, logical in placement.boxes(coords, sizes):
            boxes.append((name, placement.logical_shape, logical, tensor[local]))
    return boxes


def model_metadata(model_config, padded_vocab_size: int, dtype: str) -> dict:
    """The ``model`` entry of checkpoint.json: family, architecture, vocabulary padding and dtype."""
    return {"type": spec_for_config(model_config).name, "config": asdict(model_config),
            "vocab_size": model_config.vocab_size, "padded_vocab_size": padded_vocab_size, "dtype": dtype}


def checkpoint_metadata(*, step: int, optimizer_step: int, lr_schedule_start_step: int,
                        consumed_samples: dict[str, int], consumed_tokens: int, layout: dict, model: dict,
                        tokenizer_fingerprint: str | None, files: dict[str, int], **extra) -> dict:
    """checkpoint.json, for training checkpoints and converted ones alike."""
    return {"format_version": FORMAT_VERSION, "step": step, "optimizer_step": optimizer_step,
            "lr_schedule_start_step": lr_schedule_start_step, "consumed_samples": consumed_samples,
            "consumed_tokens": consumed_tokens, "layout": layout, "model": model,
            "tokenizer_fingerprint": tokenizer_fingerprint, "files": files, **extra}


def write_metadata(folder: Path, metadata: dict) -> None:
    atomic_write_text(folder / METADATA, json.dumps(metadata, indent=2, sort_keys=True))


def checkpoint_model(checkpoint: Path, metadata: dict) -> tuple[ModelSpec, object]:
    """The model family and config recorded in a checkpoint (checkpoints of format 1 hold Llama models)."""
    model = metadata.get("model", {})
    if "config" not in model:
        raise CheckpointError(f"{checkpoint / METADATA} has no model config: it was written by an older version")
    spec = spec_named(model.get("type", "llama"), checkpoint)
    try:
        return spec, spec.config_class(**model["config"])
    except TypeError as error:
        raise CheckpointError(f"{checkpoint / METADATA} has a {spec.name} model config this version cannot read: "
                              f"{error}") from error


def save_checkpoint(
    config: Config,
    model: CausalLM,
    optimizer: MixedPrecisionAdamW,
    progress: TrainingProgress,
    parallel_context: ParallelContext,
    tokenizer_fingerprint: str | None,
) -> Path:
    root = Path(config.checkpoints.checkpoints_path)
    final = root / str(progress.step)
    tmp = root / f".tmp-{progress.step}"
    is_main = parallel_context.rank == 0
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        for sub in ("model", "optimizer", "rng"):
            (tmp / sub).mkdir(parents=True)
    dist.barrier()

    params = logical_parameters(model)
    state = params | logical_buffers(model)
    written = []
    model_boxes = _unique_boxes(state, parallel_context, state)
    if model_boxes:
        write_boxes(tmp / "model" / f"{_shard_name(parallel_context)}.safetensors", model_boxes)
        written.append(f"model/{_shard_name(parallel_context)}.safetensors")
    # One bucket at a time: under ZeRO-1 the states are gathered over data-parallel ranks, a bucket's worth at once.
    for index, states in enumerate(optimizer.bucket_states()):
        tensors = {f"{kind}/{name}": tensor for name, kinds in states.items() for kind, tensor in kinds.items()}
        boxes = _unique_boxes(params, parallel_context, tensors)
        if boxes:
            name = f"optimizer/{_shard_name(parallel_context)}-bucket{index:04d}.safetensors"
            write_boxes(tmp / name, boxes)
            written.append(name)
    rng_file = f"rng/rank-{parallel_context.rank:05d}.pt"
    torch.save({"coords": parallel_context.coordinates, "state": get_rng_state(parallel_context.device)}, tmp / rng_file)
    written.append(rng_file)

    all_written: list[list[str]] = [None] * parallel_context.world_size  # type: ignore[list-item]
    dist.all_gather_object(all_written, written)
    dist.barrier()
    if is_main:
        files = sorted(f for rank_files in all_written for f in rank_files)
        tokenizer = _local_tokenizer_file(config.tokenizer.tokenizer_name_or_path)
        if tokenizer is not None:  # a checkpoint carries its tokenizer, so generation needs no other path
            (tmp / "tokenizer").mkdir()
            shutil.copy(tokenizer, tmp / "tokenizer" / "tokenizer.json")
            files.append("tokenizer/tokenizer.json")
        metadata = checkpoint_metadata(
            step=progress.step, optimizer_step=optimizer.step_count,
            lr_schedule_start_step=progress.lr_schedule_start, consumed_samples=progress.consumed_samples,
            consumed_tokens=progress.total_consumed_samples * config.tokens.sequence_length,
            layout={**parallel_context.sizes, "zero_stage": config.optimizer.zero_stage},
            model=model_metadata(model.config, model.padded_vocab_size, config.model.dtype),
            tokenizer_fingerprint=tokenizer_fingerprint, files={f: (tmp / f).stat().st_size for f in files},
        )
        save_config(config, tmp / "config.yaml")
        write_metadata(tmp, metadata)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(root)  # the rename is durable before latest.txt names the checkpoint
        _write_latest(root, final.name)
        _prune(root, config.checkpoints.keep_last_n)
        logger.info(f"saved checkpoint {final}")
    dist.barrier()
    return final


def _local_tokenizer_file(name_or_path: str | None) -> Path | None:
    if name_or_path is None:
        return None
    path = Path(name_or_path)
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if path.is_file() else None


def _write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST, name + "\n")


def _prune(root: Path, keep_last_n: int | None) -> None:
    if keep_last_n is None:
        return
    complete = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / METADATA).exists()))
    for step in complete[:-keep_last_n]:
        shutil.rmtree(root / str(step))


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint folder that ``path`` designates: a run folder (via ``latest.txt``) or a checkpoint itself.

    Asking to resume from a path without a checkpoint is an error: a typo must never start a run from scratch.
    """
    path = Path(path)
    if (path / LATEST).exists():
        name = (path / LATEST).read_text().strip()
        target = path / name
        if not (target / METADATA).exists():
            raise CheckpointError(f"{path / LATEST} points at {target}, which is not a complete checkpoint")
        return target
    if (path / METADATA).exists():
        return path
    raise CheckpointError(
        f"no checkpoint at {path} (expected {LATEST} or {METADATA}); fix checkpoints.resume_checkpoint_path "
        "or set it to null to start from scratch"
    )


def read_metadata(checkpoint: Path) -> dict:
    metadata = json.loads((checkpoint / METADATA).read_text())
    if metadata.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{checkpoint} was written by a newer nanotron (format {metadata['format_version']}; "
                              f"this version reads formats up to {FORMAT_VERSION}): upgrade nanotron to load it")
    for name, size in metadata["files"].items():
        file = checkpoint / name
        if not file.exists():
            raise CheckpointError(f"checkpoint file {file} is missing; the checkpoint is incomplete")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {file} has {file.stat().st_size} bytes, expected {size}: corrupt")
    return metadata


def _read_logical(reader: LogicalTensorReader, key: str, placement: Placement, out: torch.Tensor,
                  parallel_context: ParallelContext, vocab_rows: tuple[int, int] | None) -> None:
    """Fill ``out`` (this rank's part of ``placement``) from the stored logical tensor ``key``.

    ``vocab_rows`` = (padded vocabulary now, padded vocabulary in the checkpoint). Vocabulary padding depends on the
    tensor-parallel size; rows past the real vocabulary never take part in the loss, so a vocabulary-sized tensor
    stored with another padding loads its common rows and keeps its own values for the others.
    """
    stored, expected = reader.logical_shape(key), placement.logical_shape
    resizable = vocab_rows is not None and expected[0] == vocab_rows[0] and stored[0] == vocab_rows[1]
    if stored != expected and not (resizable and stored[1:] == expected[1:]):
        raise CheckpointError(
            f"{key!r} has shape {stored} in {reader.folder} but {expected} in this model: the model config does not "
            "match the checkpoint"
        )
    for local, logical in placement.boxes(parallel_context.coordinates, parallel_context.sizes):
        rows = min(logical[0].stop, stored[0]) - logical[0].start
        if rows <= 0:
            continue
        logical = (slice(logical[0].start, logical[0].start + rows), *logical[1:])
        local = (slice(local[0].start, local[0].start + rows), *local[1:])
        reader.read_into(key, logical, out[local])


def _vocab_rows(model: nn.Module, metadata: dict) -> tuple[int, int]:
    return model.padded_vocab_size, metadata["model"]["padded_vocab_size"]


def check_same_model(checkpoint: Path, metadata: dict, model_config) -> None:
    """Refuse weights of another family or architecture: a checkpoint whose tensors happen to fit (fewer layers,
    heads re-cut at the same width, a larger vocabulary taken for padding) would otherwise load silently wrong."""
    spec, saved = checkpoint_model(checkpoint, metadata)
    current = spec_for_config(model_config)
    if current is not spec:
        raise CheckpointError(f"{checkpoint} holds a {spec.name} model but model.model_config describes a "
                              f"{current.name} model")
    differences = [f"{f.name} {getattr(saved, f.name)!r} (checkpoint) vs {getattr(model_config, f.name)!r} (config)"
                   for f in fields(saved)
                   if f.name not in spec.resume_may_change and getattr(saved, f.name) != getattr(model_config, f.name)]
    if differences:
        raise CheckpointError(f"model.model_config does not match the model in {checkpoint}: {'; '.join(differences)};"
                              " set those keys to the checkpoint's values (its checkpoint.json) to load it")


@torch.no_grad()
def load_weights(checkpoint: Path, model: CausalLM, parallel_context: ParallelContext, metadata: dict) -> None:
    """Fill this rank's parameters and persistent buffers from the logical tensors of ``checkpoint`` (reading only
    the needed slices), after checking that it holds the same architecture. A buffer the checkpoint lacks keeps its
    initial value: buffers hold state of optional features (e.g. scaling statistics), which a run may switch on when
    it resumes."""
    check_same_model(checkpoint, metadata, model.config)
    reader = LogicalTensorReader(checkpoint / "model")
    for name, param in logical_parameters(model).items():
        if name not in reader.names():
            raise CheckpointError(f"parameter {name!r} is not in {checkpoint}: it was saved from another model")
        _read_logical(reader, name, get_placement(param), param, parallel_context, _vocab_rows(model, metadata))
    for name, buffer in logical_buffers(model).items():
        if name in reader.names():
            _read_logical(reader, name, get_placement(buffer), buffer, parallel_context, _vocab_rows(model, metadata))


def load_optimizer(checkpoint: Path, optimizer: MixedPrecisionAdamW, model: nn.Module,
                   parallel_context: ParallelContext, metadata: dict) -> None:
    """Restore fp32 masters and Adam moments from logical tensors, for any layout and ZeRO stage."""
    reader = LogicalTensorReader(checkpoint / "optimizer")
    params = optimizer.buckets.params

    def read(name: str, kind: str, out: torch.Tensor) -> None:
        key = f"{kind}/{name}"
        if key not in reader.names():
            raise CheckpointError(f"optimizer state {key!r} is missing from {checkpoint}")
        if kind == "master":  # rows the checkpoint lacks (other vocabulary padding) keep the loaded weights
            out.copy_(params[name])
        _read_logical(reader, key, get_placement(params[name]), out, parallel_context, _vocab_rows(model, metadata))

    optimizer.load_bucket_states(read, metadata["optimizer_step"])


def load_rng(checkpoint: Path, parallel_context: ParallelContext) -> bool:
    """Restore this rank's generators if the checkpoint has a rank with the same coordinates; else report False."""
    path = checkpoint / "rng" / f"rank-{parallel_context.rank:05d}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=False)
        if saved["coords"] == parallel_context.coordinates:
            set_rng_state(saved["state"], parallel_context.device)
            return True
    return False
