"""Checkpoints of the training state: what checkpoint.json holds, and resuming from one at any layout.

Layout of ``<checkpoints_path>``::

    latest.txt                      name of the newest complete checkpoint (written last, atomically)
    run.lock                        host, pid and start of the run using the folder (``run_lock.py``)
    <step>/checkpoint.json          step, consumed samples and tokens, what defines each data stage's order,
                                    layout, vocab, files and their sizes
    <step>/config.yaml              the run's config
    <step>/model/*.safetensors      boxes of logical weights (see logical_tensors.py)
    <step>/optimizer/*.safetensors  boxes of Adam moments and fp32 master weights, same naming
    <step>/rng/rank-<rank>.safetensors  every rank's random generators (world rank, 5 digits; no pickle)

Saving is ``saving.py`` (and ``async_saving.py`` in the background); loading starts with the integrity checks of
``integrity.py``; the folder's bookkeeping (latest, pruning, partial saves) is ``run_folder.py``, its lock
``run_lock.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from nanotron.checkpoint.integrity import sealed, verify_checksums
from nanotron.checkpoint.logical_tensors import FORMAT_VERSION, LogicalTensorReader
from nanotron.checkpoint.node_folders import NODE_RANKS, node_checkpoint_problem
from nanotron.checkpoint.run_folder import METADATA
from nanotron.config import ConfigError, model_config_from_dict
from nanotron.errors import CheckpointError
from nanotron.files import atomic_write_text
from nanotron.models.registry import spec_for_config, spec_named
from nanotron.models.spec import CausalLM, ModelSpec
from nanotron.optim.optimizer import MixedPrecisionAdamW
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.placement import Placement, get_placement, logical_buffers, logical_parameters
from nanotron.random import load_rng_state


@dataclass
class TrainingProgress:
    """Where training stands; everything needed to continue the data stream and the LR schedule."""

    step: int = 0
    consumed_samples: dict[str, int] = field(default_factory=dict)  # per data stage name
    lr_schedule_start: int = 0  # the schedule counts steps from here (a resume may restart it)
    # Added up step by step and carried by checkpoints: samples of an earlier sequence length held other token counts.
    consumed_tokens: int = 0

    @property
    def total_consumed_samples(self) -> int:
        return sum(self.consumed_samples.values())


def model_metadata(model_config, padded_vocab_size: int, dtype: str) -> dict:
    """The ``model`` entry of checkpoint.json: family, architecture, vocabulary padding and dtype."""
    return {"type": spec_for_config(model_config).name, "config": asdict(model_config),
            "vocab_size": model_config.vocab_size, "padded_vocab_size": padded_vocab_size, "dtype": dtype}


def checkpoint_metadata(*, step: int, optimizer_step: int, lr_schedule_start_step: int,
                        consumed_samples: dict[str, int], consumed_tokens: int, layout: dict, model: dict,
                        tokenizer_fingerprint: str | None, files: dict[str, dict], **extra) -> dict:
    """checkpoint.json, for training checkpoints and converted ones alike; ``files`` maps each file to its
    ``integrity.file_entry``."""
    return {"format_version": FORMAT_VERSION, "step": step, "optimizer_step": optimizer_step,
            "lr_schedule_start_step": lr_schedule_start_step, "consumed_samples": consumed_samples,
            "consumed_tokens": consumed_tokens, "layout": layout, "model": model,
            "tokenizer_fingerprint": tokenizer_fingerprint, "files": files, "saved_at": time.time(), **extra}


def write_metadata(folder: Path, metadata: dict) -> None:
    """checkpoint.json, with the checksum of its content that every loader checks."""
    atomic_write_text(folder / METADATA, json.dumps(sealed(metadata), indent=2, sort_keys=True))


def checkpoint_model(checkpoint: Path, metadata: dict) -> tuple[ModelSpec, object]:
    """The model family and config recorded in a checkpoint."""
    model = metadata.get("model", {})
    if "config" not in model:
        raise CheckpointError(f"{checkpoint / METADATA} has no model config: it was written by an older version")
    family = model.get("type")
    if family is None:
        raise CheckpointError(f"{checkpoint / METADATA} names no model family (model.type): the file was edited or "
                              "truncated; restore it from the run's other copy or an earlier checkpoint")
    spec = spec_named(family, checkpoint)
    try:
        return spec, model_config_from_dict(spec.config_class, model["config"])
    except ConfigError as error:
        raise CheckpointError(f"{checkpoint / METADATA} has a {spec.name} model config this version cannot read: "
                              f"{'; '.join(error.problems)}") from None


def first_problem(problem: str | None, world_size: int, group: dist.ProcessGroup | None = None) -> str | None:
    """The first problem any rank of ``group`` reported (None where it had none), on every rank: all of them raise
    together instead of some waiting forever for the others."""
    problems: list[str | None] = [None] * world_size
    dist.all_gather_object(problems, problem, group=group)
    return next((p for p in problems if p is not None), None)


def verify_on_all_ranks(checkpoint: Path, metadata: dict, parallel_context: ParallelContext) -> None:
    """Every file's checksum, the reading shared by all ranks that see the folder (by the ranks of its node, for a
    checkpoint holding only its node's files, which must be this rank's at this layout); all of them raise if any
    file is corrupt."""
    pc = parallel_context
    ranks = metadata.get(NODE_RANKS, range(pc.world_size))
    problem = node_checkpoint_problem(checkpoint, metadata, pc.rank, pc.layout)
    if problem is None:
        problem = verify_checksums(checkpoint, metadata, ranks.index(pc.rank), len(ranks))
    problem = first_problem(problem, parallel_context.world_size)
    if problem is not None:
        raise CheckpointError(problem)


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
                   if f.name not in saved.resume_may_change and getattr(saved, f.name) != getattr(model_config, f.name)]
    if differences:
        raise CheckpointError(f"model.model_config does not match the model in {checkpoint}: {'; '.join(differences)};"
                              " set those keys to the checkpoint's values (its checkpoint.json) to load it")


@torch.no_grad()
def load_weights(checkpoint: Path, model: CausalLM, parallel_context: ParallelContext, metadata: dict,
                 parameter_groups: Iterable[dict[str, torch.Tensor]] | None = None) -> None:
    """Fill this rank's parameters and persistent buffers from the logical tensors of ``checkpoint`` (reading only
    the needed slices), after checking that it holds the same architecture. A buffer the checkpoint lacks keeps its
    initial value: buffers hold state of optional features (e.g. scaling statistics), which a run may switch on when
    it resumes. ``parameter_groups`` hands the parameters over a group at a time (ZeRO-3: a bucket gathered, then
    its shard kept: ``GradientBuckets.whole_parameters``); by default all at once."""
    check_same_model(checkpoint, metadata, model.config)
    reader = LogicalTensorReader(checkpoint / "model")
    for params in parameter_groups if parameter_groups is not None else [logical_parameters(model)]:
        for name, param in params.items():
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
        _read_logical(reader, key, get_placement(params[name]), out, parallel_context, _vocab_rows(model, metadata))

    optimizer.load_bucket_states(read, metadata["optimizer_step"])


def load_rng(checkpoint: Path, parallel_context: ParallelContext) -> bool:
    """Restore this rank's generators if the checkpoint has a rank with the same coordinates; else report False.
    They are read from safetensors only: no file is unpickled, since unpickling runs code."""
    path = checkpoint / "rng" / f"rank-{parallel_context.rank:05d}.safetensors"
    return path.exists() and load_rng_state(path, parallel_context.device, parallel_context.coordinates)
