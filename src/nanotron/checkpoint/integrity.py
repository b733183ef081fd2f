"""Checking a checkpoint before anything is loaded from it: its metadata, and every file's size and checksum.

checkpoint.json itself carries a checksum of its own content (``manifest_sha256``, from format 3): a hand edit of the
step, the data position or the model config would otherwise be taken as the truth by every loader. Its file list may
name only regular files inside the checkpoint folder, so that a load reads nothing but what the save wrote.

Each file's CRC-32 is recorded in checkpoint.json when it is saved (computed from the page cache right after the
write, at about 2 GB/s: a small part of a save). A loader compares sizes (free) and checksums (a read of every file)
before it builds anything, so a corrupt file is named instead of loading as a NaN loss, empty generations or a
"divergence". Several ranks share the reading: each verifies every ``world``-th file.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import zlib
from pathlib import Path

from nanotron.checkpoint.logical_tensors import FORMAT_VERSION
from nanotron.checkpoint.run_folder import METADATA
from nanotron.errors import CheckpointError

CHUNK_BYTES = 16 * 2**20
REQUIRED = {"format_version": int, "step": int, "optimizer_step": int, "lr_schedule_start_step": int,
            "consumed_samples": dict, "consumed_tokens": int, "layout": dict, "model": dict, "files": dict}
MANIFEST_CHECKSUM = "manifest_sha256"
FIRST_SEALED_FORMAT = 3  # format 2 has no manifest checksum and loads unchecked
# Format 1 (no model family recorded) never left development: it is refused.
OLDEST_FORMAT = 2


def manifest_checksum(metadata: dict) -> str:
    """sha256 of checkpoint.json's canonical content: every key but the checksum, sorted, as compact JSON."""
    content = {key: value for key, value in metadata.items() if key != MANIFEST_CHECKSUM}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(metadata: dict) -> dict:
    """``metadata`` as JSON reads it back, with its ``manifest_sha256``: what checkpoint.json holds."""
    content = json.loads(json.dumps({key: value for key, value in metadata.items() if key != MANIFEST_CHECKSUM}))
    return content | {MANIFEST_CHECKSUM: manifest_checksum(content)}


def file_checksum(path: Path) -> str:
    checksum = 0
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            checksum = zlib.crc32(chunk, checksum)
    return f"{checksum:08x}"


def file_entry(path: Path) -> dict:
    """What checkpoint.json records of a file: its size and checksum."""
    return {"bytes": path.stat().st_size, "crc32": file_checksum(path)}


def _file_entry_problem(path: Path, name: str, entry) -> str | None:
    """Why a ``files`` entry of checkpoint.json is not ``{bytes, crc32}`` (None if it is)."""
    if isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("crc32"), str):
        return None
    return f"{path}: the 'files' entry of {name!r} is not {{bytes, crc32}} (got {entry!r}); the checkpoint is corrupt"


def read_metadata(checkpoint: Path) -> dict:
    """checkpoint.json, validated, with every listed file present at its recorded size."""
    path = checkpoint / METADATA
    try:
        metadata = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}; the checkpoint is corrupt (resume from another one)") \
            from error
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path} is not a JSON object; the checkpoint is corrupt")
    for key, kind in REQUIRED.items():
        if not isinstance(metadata.get(key), kind) or isinstance(metadata.get(key), bool):
            raise CheckpointError(f"{path}: {key!r} is missing or not a{'n' if kind is int else ''} "
                                  f"{kind.__name__} (got {metadata.get(key)!r}); the checkpoint is corrupt")
    version = metadata["format_version"]
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{checkpoint} was written by a newer nanotron (format {version}; this version reads "
                              f"formats up to {FORMAT_VERSION}): upgrade nanotron to load it")
    if version < OLDEST_FORMAT:
        raise CheckpointError(f"{checkpoint} has format {version}, written by a development version of nanotron that "
                              f"was never released; this version reads formats {OLDEST_FORMAT} to {FORMAT_VERSION}: "
                              "train the model again")
    _check_manifest_checksum(path, metadata)
    for name, entry in metadata["files"].items():
        problem = _file_entry_problem(path, name, entry)
        if problem is not None:
            raise CheckpointError(problem)
        status, size = _regular_file_inside(checkpoint, name), entry["bytes"]
        if status.st_size != size:
            raise CheckpointError(f"checkpoint file {checkpoint / name} has {status.st_size} bytes, expected {size}: "
                                  "corrupt")
    return metadata


def _check_manifest_checksum(path: Path, metadata: dict) -> None:
    recorded = metadata.get(MANIFEST_CHECKSUM)
    if recorded is None and metadata["format_version"] < FIRST_SEALED_FORMAT:
        return
    if recorded != manifest_checksum(metadata):
        found = "has no" if recorded is None else "does not match its"
        raise CheckpointError(f"{path} was modified after it was saved (it {found} {MANIFEST_CHECKSUM}): loading it "
                              "would use edited values (step, data position, model config); restore the original "
                              "file or load another checkpoint, and change values through the config instead")


def _regular_file_inside(checkpoint: Path, name: str) -> os.stat_result:
    """The status of the file ``name`` of checkpoint.json, which must be a regular file inside ``checkpoint``: no path
    elsewhere (``../x``, ``/dev/zero``), no symbolic link, no device or pipe (reading one never ends)."""
    file = checkpoint / name
    if not file.resolve().is_relative_to(checkpoint.resolve()):
        problem = f"it resolves to {file.resolve()}, outside the checkpoint folder"
    else:
        try:
            status = os.lstat(file)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {file} is missing; the checkpoint is incomplete") from None
        if stat.S_ISREG(status.st_mode):
            return status
        problem = "it is a symbolic link" if stat.S_ISLNK(status.st_mode) else "it is not a regular file"
    raise CheckpointError(f"{checkpoint / METADATA} lists {name!r}, which is not a regular file inside {checkpoint} "
                          f"({problem}); a checkpoint holds only the files its save wrote: the checkpoint is corrupt")


def verify_checksums(checkpoint: Path, metadata: dict, rank: int = 0, world: int = 1) -> str | None:
    """This rank's share of the checksum check: the first mismatch as a message, or None."""
    for name in sorted(metadata["files"])[rank::world]:
        expected = metadata["files"][name]["crc32"]
        if file_checksum(checkpoint / name) != expected:
            return (f"checkpoint file {checkpoint / name} does not match its checksum (crc32 {expected} recorded at "
                    "save): the file is corrupt; resume from another checkpoint")
    return None


def verify_checkpoint(checkpoint: Path, metadata: dict) -> None:
    """Every file's checksum, in this process (conversion, ``nanotron checkpoint verify``)."""
    problem = verify_checksums(checkpoint, metadata)
    if problem is not None:
        raise CheckpointError(problem)
