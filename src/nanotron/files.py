"""Durable, atomic file writes: a reader sees the old file or the complete new one, never a part, even after a
crash or a power loss.

The content goes to a hidden sibling, is flushed to the disk (``fsync``), renamed over the destination, and the
folder's entry is flushed too, so that the rename itself survives. Checkpoints rely on this order: their files are
durable before ``latest.txt`` names them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


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
