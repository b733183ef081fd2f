"""The run folder (``checkpoints.checkpoints_path``): which checkpoints it holds, which is the latest, what to prune.

A checkpoint is complete once its ``checkpoint.json`` exists (it is written last, inside the temporary folder, before
the folder is renamed to its step). ``latest.txt`` names the checkpoint to resume from; when it is missing, the
most recently saved complete checkpoint is taken instead. "Recent" is the save order recorded in checkpoint.json
(``saved_at``), not the step number: after a rollback (resuming from an older checkpoint into the same folder) the
new checkpoints have lower steps than the abandoned ones, and they are the ones to keep.

The run's metrics file belongs to the run too: an existing one is continued only by a run that resumes the run that
wrote it (``check_metrics_file``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import yaml

from nanotron.config import ConfigError
from nanotron.errors import CheckpointError
from nanotron.files import atomic_write_text

logger = logging.getLogger(__name__)

LATEST = "latest.txt"
METADATA = "checkpoint.json"
METRICS = "metrics.jsonl"  # the default logging.metrics_path, in the run folder
PARTIAL_PREFIX = ".tmp-"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints of ``root``, oldest save first."""
    def saved_at(folder: Path) -> tuple[float, int]:
        try:
            recorded = json.loads((folder / METADATA).read_text()).get("saved_at")
        except (OSError, ValueError):
            recorded = None
        when = recorded if isinstance(recorded, (int, float)) else (folder / METADATA).stat().st_mtime
        return when, int(folder.name)

    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.isdigit() and (p / METADATA).exists()), key=saved_at)


def write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST, name + "\n")


def prune(root: Path, keep_last_n: int | None, keep: set[str]) -> None:
    """Delete all but the ``keep_last_n`` most recently saved checkpoints, never one named in ``keep``.

    checkpoint.json goes first: a folder whose deletion stops halfway is no longer taken for a complete checkpoint. A
    folder that cannot be deleted (read-only, busy) is kept with a warning: a run never stops over old checkpoints.
    """
    if keep_last_n is None:
        return
    for folder in complete_checkpoints(root)[:-keep_last_n]:
        if folder.name in keep:
            continue
        try:
            (folder / METADATA).unlink()
            shutil.rmtree(folder)
        except OSError as error:
            logger.warning(f"checkpoints.keep_last_n: could not delete the old checkpoint {folder} "
                           f"({error.strerror or error}: {error.filename}); training goes on, delete it by hand")


def remove_partial_saves(root: Path) -> None:
    """Delete what interrupted saves left (``.tmp-<step>`` folders): they are never complete checkpoints."""
    if root.is_dir():
        for partial in root.glob(f"{PARTIAL_PREFIX}*"):
            shutil.rmtree(partial, ignore_errors=True)
            logger.warning(f"removed {partial}, left by an interrupted save")


def describe_existing_run(root: Path) -> str | None:
    """What an earlier run left in ``root`` (its latest checkpoint), or None when there is none to lose."""
    if (root / LATEST).exists():
        return f"{LATEST} names checkpoint {(root / LATEST).read_text().strip()!r}"
    complete = complete_checkpoints(root)
    return f"it holds checkpoint {complete[-1].name!r}" if complete else None


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint folder that ``path`` designates: a run folder (via ``latest.txt``) or a checkpoint itself.

    Asking to resume from a path without a checkpoint is an error: a typo must never start a run from scratch.
    """
    path = Path(path)
    if (path / LATEST).exists():
        name = (path / LATEST).read_text().strip()
        if not name.isdigit():
            raise CheckpointError(f"{path / LATEST} names {name!r}, which is not a checkpoint of this folder (a step "
                                  "number); fix or delete the file")
        target = path / name
        if not (target / METADATA).exists():
            raise CheckpointError(f"{path / LATEST} points at {target}, which is not a complete checkpoint")
        return target
    if (path / METADATA).exists():
        return path
    complete = complete_checkpoints(path)
    if complete:
        logger.warning(f"{path / LATEST} is missing: resuming from {complete[-1]}, the most recently saved "
                       "complete checkpoint")
        return complete[-1]
    raise CheckpointError(
        f"no checkpoint at {path} (expected {LATEST} or {METADATA}); fix checkpoints.resume_checkpoint_path "
        "or set it to null to start from scratch"
    )


def metrics_file_of(checkpoint: Path) -> Path:
    """The metrics file of the run that saved ``checkpoint``: ``logging.metrics_path`` of the config saved with it,
    else (null) the metrics file of the run folder holding it, wherever that folder has been moved."""
    try:
        saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
        path = saved["logging"]["metrics_path"]
    except (OSError, yaml.YAMLError, TypeError, KeyError):
        path = None
    return Path(path) if path else checkpoint.parent / METRICS


def check_metrics_file(metrics: Path, root: Path, resumed: Path | None) -> None:
    """Refuse to write over another run's metrics file (``metrics``, which holds records).

    It is continued when this run resumes (from checkpoint ``resumed``) the run that wrote it, and started over when
    it is the run folder's own file and nothing is resumed (the folder holds no checkpoint then, or the run would
    have been refused: a run that stopped before its first save starts again). Anything else is another run's file.
    """
    if not metrics.exists() or not metrics.read_text(errors="replace").strip():
        return
    owner = metrics_file_of(resumed) if resumed is not None else root / METRICS
    if metrics.resolve() == owner.resolve():
        return
    whose = f"the checkpoint {resumed} logs to {owner}" if resumed is not None else "this run resumes no checkpoint"
    raise ConfigError(f"logging.metrics_path {metrics} already holds another run's metrics ({whose}); point "
                      "logging.metrics_path at a new file (or delete this one), or resume the run that wrote it")
