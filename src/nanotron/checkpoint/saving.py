"""Saving a checkpoint in two phases: a snapshot of this rank's part in host memory, then the files.

The snapshot is the only phase that touches the training state: optimizer state is gathered bucket by bucket over
data-parallel ranks (a collective), this rank's unique boxes are copied to host memory, and the random generators are
read. A background save copies into pinned buffers kept from save to save (the copies run at the bus's speed and
overlap); a foreground one into transient host tensors, so that it holds no host memory between saves. Writing needs
nothing but the snapshot, so it can run in the foreground (``Trainer.save``) or in a background thread while training
goes on (``async_saving.py``). Either way the files go to ``.tmp-<step>``, each flushed to disk with its checksum
recorded; only when every rank has written does rank 0 write checkpoint.json, rename the folder and update
``latest.txt`` (where nodes have folders of their own, each folder's lowest rank does so: ``node_folders.py``). A
crash at any moment leaves the previous checkpoint intact; a failed write (a full disk, also inside safetensors) is
removed on every rank and reported as one error. Pruning old checkpoints comes after the new one is complete, and
never fails a save.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nanotron.checkpoint.integrity import file_entry
from nanotron.checkpoint.logical_tensors import write_boxes
from nanotron.checkpoint.manager import (
    TrainingProgress,
    checkpoint_metadata,
    first_problem,
    model_metadata,
    write_metadata,
)
from nanotron.checkpoint.node_folders import NODE_RANKS, FolderRanks
from nanotron.checkpoint.run_folder import PARTIAL_PREFIX, complete_checkpoints, prune, write_latest
from nanotron.config import Config, save_config
from nanotron.data.chat import TOKENIZER_CONFIG_FILE_NAME, checkpoint_tokenizer_config
from nanotron.errors import CheckpointError
from nanotron.files import fsync_path
from nanotron.layout import Axis
from nanotron.models.spec import CausalLM
from nanotron.optim.optimizer import MixedPrecisionAdamW
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.placement import get_placement, logical_buffers, logical_parameters
from nanotron.random import rng_state, write_rng_state

logger = logging.getLogger(__name__)

Box = tuple[str, tuple[int, ...], tuple[slice, ...], torch.Tensor]


def _shard_name(parallel_context: ParallelContext) -> str:
    pp, tp, ep = (parallel_context.coord(axis) for axis in (Axis.PP, Axis.TP, Axis.EP))
    return f"pp{pp:03d}-tp{tp:03d}-ep{ep:03d}"


def _unique_boxes(owners: dict[str, torch.Tensor], parallel_context: ParallelContext, tensors: dict[str, torch.Tensor],
                  folder: FolderRanks):
    """Boxes this rank must write: it holds the only copy among the replicas (every replicated axis at 0), or where
    nodes have folders of their own, the only copy among the replicas of its folder.

    ``tensors`` are keyed by logical name, or ``kind/name`` for optimizer state; ``owners`` holds the parameter or
    buffer of each name, whose placement says where the tensor lives.
    """
    coords, sizes = parallel_context.coordinates, parallel_context.sizes
    boxes = []
    for name, tensor in tensors.items():
        placement = get_placement(owners[name.split("/", 1)[-1]])
        if folder.shared and not placement.is_unique_copy(coords):
            continue
        pairs = (placement.boxes(coords, sizes, unique=True) if folder.shared
                 else folder.boxes_to_write(placement, coords, sizes))
        for local, logical in pairs:
            boxes.append((name, placement.logical_shape, logical, tensor[local]))
    return boxes


class HostBuffers:
    """Host copies of a rank's boxes, kept from one save to the next (pinned on CUDA: fast, asynchronous copies).

    They hold a rank's whole share of a checkpoint in host memory for the length of the run: background saves only.
    """

    def __init__(self, device: torch.device):
        self.pinned = device.type == "cuda"
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}

    def copy(self, file: str, box: Box) -> Box:
        name, logical_shape, logical, data = box
        key = (file, name + repr(logical))
        host = self.buffers.get(key)
        if host is None or host.shape != data.shape or host.dtype != data.dtype:
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=self.pinned)
            self.buffers[key] = host
        host.copy_(data, non_blocking=self.pinned)
        return name, logical_shape, logical, host


@dataclass
class Snapshot:
    """One rank's part of checkpoint ``step``, in host memory."""

    step: int
    files: dict[str, list[Box]]  # this rank's model and optimizer files and their boxes
    rng: tuple[dict[str, torch.Tensor], dict]
    rng_file: str
    metadata: dict  # checkpoint.json without its ``files`` entry
    config: Config
    folder: FolderRanks  # the ranks whose files go into this rank's run folder


def _transient_copy(file: str, box: Box) -> Box:
    name, logical_shape, logical, data = box
    return name, logical_shape, logical, data.detach().to("cpu", copy=True)


def take_snapshot(config: Config, model: CausalLM, optimizer: MixedPrecisionAdamW, progress: TrainingProgress,
                  parallel_context: ParallelContext, tokenizer_fingerprint: str | None,
                  buffers: HostBuffers | None = None, extra_entries: dict | None = None,
                  folder: FolderRanks | None = None) -> Snapshot:
    """Copy this rank's part of the training state to host memory, into ``buffers`` if given; ``extra_entries``:
    entries of checkpoint.json beside the training state (the data stages' record, the training features' state:
    ``Feature.state_dict``); ``folder``: the ranks sharing this rank's run folder (default: every rank). Collective
    (optimizer state is gathered)."""
    folder = folder or FolderRanks.everyone(parallel_context)
    copy = buffers.copy if buffers is not None else _transient_copy
    params, model_buffers = logical_parameters(model), logical_buffers(model)
    state = params | model_buffers
    shard = _shard_name(parallel_context)
    files: dict[str, list[Box]] = {}
    name = f"model/{shard}.safetensors"
    model_boxes = []
    # A bucket at a time, copied before the next: under ZeRO-3 each is gathered, then released.
    for tensors in itertools.chain(optimizer.buckets.whole_parameters(), [model_buffers]):
        model_boxes += [copy(name, box) for box in _unique_boxes(state, parallel_context, tensors, folder)]
    if model_boxes:
        files[name] = model_boxes
    # One bucket at a time: under ZeRO-1 the states are gathered over data-parallel ranks, a bucket's worth at once.
    for index, states in enumerate(optimizer.bucket_states()):
        tensors = {f"{kind}/{name}": tensor for name, kinds in states.items() for kind, tensor in kinds.items()}
        boxes = _unique_boxes(params, parallel_context, tensors, folder)
        if boxes:
            name = f"optimizer/{shard}-bucket{index:04d}.safetensors"
            files[name] = [copy(name, box) for box in boxes]
    if buffers is not None and buffers.pinned:
        torch.cuda.synchronize(parallel_context.device)
    metadata = checkpoint_metadata(
        step=progress.step, optimizer_step=optimizer.step_count, lr_schedule_start_step=progress.lr_schedule_start,
        consumed_samples=dict(progress.consumed_samples),
        consumed_tokens=progress.consumed_tokens,
        layout=parallel_context.layout.to_dict(),
        model=model_metadata(model.config, model.padded_vocab_size, config.model.dtype),
        tokenizer_fingerprint=tokenizer_fingerprint, files={}, optimizer=config.optimizer.name,
        **(extra_entries or {}),
        **({NODE_RANKS: list(folder.ranks)} if not folder.shared else {}),
    )
    return Snapshot(progress.step, files, rng_state(parallel_context.device, parallel_context.coordinates),
                    f"rng/rank-{parallel_context.rank:05d}.safetensors", metadata, config, folder)


def write_snapshot(snapshot: Snapshot, parallel_context: ParallelContext, group: dist.ProcessGroup | None = None,
                   protected: set[str] = frozenset()) -> Path:
    """Write checkpoint ``snapshot.step`` from the snapshots of all ranks; collective over ``group`` (all ranks;
    the default group, or a group of its own when writing in the background). ``keep_last_n`` pruning spares
    ``protected`` names and the checkpoint ``latest.txt`` names."""
    root = Path(snapshot.config.checkpoints.checkpoints_path)
    final, tmp = root / str(snapshot.step), root / f"{PARTIAL_PREFIX}{snapshot.step}"
    is_main = snapshot.folder.is_main
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        for sub in ("model", "optimizer", "rng"):
            (tmp / sub).mkdir(parents=True)
    dist.barrier(group=group)

    written, problem = _write_files(tmp, snapshot)
    all_written: list[dict[str, dict]] = [None] * parallel_context.world_size  # type: ignore[list-item]
    dist.all_gather_object(all_written, written, group=group)
    problem = first_problem(problem, parallel_context.world_size, group)
    if is_main and problem is None:
        try:
            files = {name: entry for rank in snapshot.folder.ranks for name, entry in all_written[rank].items()}
            _complete(tmp, final, snapshot, files)
        except OSError as error:
            problem = _save_failure(error, tmp, snapshot)
    problem = first_problem(problem if is_main else None, parallel_context.world_size, group)
    if problem is not None:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group=group)
        raise CheckpointError(problem)
    logger.info(f"saved checkpoint {final}")
    if is_main:  # the new checkpoint is complete: an old one that cannot be deleted is only a warning
        prune(root, snapshot.config.checkpoints.keep_last_n, keep={final.name, *protected})
    return final


def _write_files(tmp: Path, snapshot: Snapshot) -> tuple[dict[str, dict], str | None]:
    """This rank's files, with their entries, and the first write error (as a message) if any."""
    written: dict[str, dict] = {}
    try:
        for name, boxes in snapshot.files.items():
            write_boxes(tmp / name, boxes)
            written[name] = file_entry(tmp / name)
        write_rng_state(tmp / snapshot.rng_file, *snapshot.rng)
        written[snapshot.rng_file] = file_entry(tmp / snapshot.rng_file)
    except OSError as error:
        return written, _save_failure(error, tmp, snapshot)
    return written, None


# A save that fails for want of room: what happened, and the fix.
ELSEWHERE = "change checkpoints.checkpoints_path"
OUT_OF_SPACE = {errno.ENOSPC: ("no space left on the device of {root}", f"free space or {ELSEWHERE}"),
                errno.EDQUOT: ("the disk quota is exceeded on the device of {root}", f"free space or {ELSEWHERE}"),
                errno.EFBIG: ("a file is over the file-size limit (ulimit -f, or the largest file the filesystem of "
                              "{root} holds)", f"raise the limit or {ELSEWHERE}")}


def _save_failure(error: OSError, tmp: Path, snapshot: Snapshot) -> str:
    """One line for a failed write: which file, and for a lack of room, how much a checkpoint needs."""
    root, file = tmp.parent, error.filename or tmp
    if error.errno not in OUT_OF_SPACE:
        return f"cannot write checkpoint file {file}: {error.strerror or error}; the partial save was removed"
    previous = complete_checkpoints(root)
    if previous:
        size = sum(path.stat().st_size for path in previous[-1].rglob("*") if path.is_file())
        needed = f"about {_size(size)} (the size of the previous checkpoint)"
        kept = f"checkpoint {previous[-1].name} is intact and still the latest"
    else:
        size = sum(box[3].nbytes for boxes in snapshot.files.values() for box in boxes)
        needed, kept = f"more than {_size(size)} (this rank's files)", "no earlier checkpoint exists"
    what, fix = OUT_OF_SPACE[error.errno]
    return (f"{what.format(root=root)} while saving checkpoint {snapshot.step} (writing {file}): a checkpoint needs "
            f"{needed}, {_size(shutil.disk_usage(root).free)} are free. The partial save was removed and {kept}; "
            f"{fix}, then resume with checkpoints.resume_checkpoint_path: auto")


def _size(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e7 else f"{size / 1e6:.2f} MB"


def _complete(tmp: Path, final: Path, snapshot: Snapshot, files: dict[str, dict]) -> None:
    """The folder's lowest rank's part of a save: tokenizer, config and checkpoint.json, then the rename and
    ``latest.txt``."""
    config = snapshot.config
    tokenizer = _local_tokenizer_file(config.tokenizer.tokenizer_name_or_path)
    if tokenizer is not None:  # a checkpoint carries its tokenizer, so generation needs no other path
        (tmp / "tokenizer").mkdir()
        shutil.copy(tokenizer, tmp / "tokenizer" / "tokenizer.json")
        files["tokenizer/tokenizer.json"] = file_entry(tmp / "tokenizer" / "tokenizer.json")
        settings = checkpoint_tokenizer_config(config)  # with the chat template a fine-tuning run renders with
        if settings is not None:
            saved = tmp / "tokenizer" / TOKENIZER_CONFIG_FILE_NAME
            saved.write_text(json.dumps(settings, indent=2))
            files[f"tokenizer/{TOKENIZER_CONFIG_FILE_NAME}"] = file_entry(saved)
    save_config(config, tmp / "config.yaml")
    for sub in tmp.iterdir():
        fsync_path(sub)
    write_metadata(tmp, snapshot.metadata | {"files": dict(sorted(files.items()))})
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(final.parent)  # the rename is durable before latest.txt names the checkpoint
    write_latest(final.parent, final.name)


def _local_tokenizer_file(name_or_path: str | None) -> Path | None:
    if name_or_path is None:
        return None
    path = Path(name_or_path)
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if path.is_file() else None
