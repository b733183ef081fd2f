"""Durable, atomic file writes: a reader sees the old file or the complete new one, never a part, even after a
crash or a power loss.

The content goes to a hidden sibling, is flushed to the disk (``fsync``), renamed over the destination, and the
folder's entry is flushed too, so that the rename itself survives. Checkpoints rely on this order: their files are
durable before ``latest.txt`` names them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file


def fsync_path(path: Path) -> None:
    """Flush a file's content, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary)`` creates the file's content; it then replaces ``path`` durably and atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def atomic_write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file written through ``atomic_write``.

    safetensors reports a failed write (a full disk, a file-size limit) as a ``SafetensorError`` whose text holds
    the OS error ("... (os error 28)"; older versions "code: 28"). It becomes the ``OSError`` a Python write would
    raise, naming ``path``, so that callers handle a full disk the same whoever wrote the bytes.
    """
    try:
        atomic_write(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))
    except SafetensorError as error:
        code = re.search(r"os error (\d+)|code: (\d+)", str(error))
        if code is None:
            raise
        number = int(code.group(1) or code.group(2))
        raise OSError(number, os.strerror(number), str(path)) from error


def output_problem(path: Path, folder: bool = False) -> str | None:
    """Why a file (``folder``: a folder) cannot be written at ``path``, or None, found before any work is done.

    ``path`` may exist as what is written there (whether it may be replaced is the command's rule), not as the other
    kind. Its missing parent folders are created when it is written (``atomic_write`` does), so the nearest one that
    exists must be a folder this process may write in.
    """
    path = Path(path)
    if path.is_dir() != folder and path.exists():
        return f"{path} is a {'file' if folder else 'folder'}, not a {'folder' if folder else 'file'}"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a folder to write {path} in"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"this user may not write in {parent}"
    return None
