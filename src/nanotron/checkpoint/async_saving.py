"""Checkpoints written in a background thread while training goes on (``checkpoints.async_save: true``).

A save blocks training only for its snapshot (``saving.take_snapshot``: gathering optimizer state, copying this
rank's part to pinned host memory); the files are then written, checksummed and completed by a thread, exactly as a
foreground save would, through a gloo process group of its own (created at start-up on every rank), so that its
collectives never interleave with those of the training steps. A save waits for the previous one to finish before
it reuses the host buffers, and the end of training waits for the last one; a background failure is raised there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch.distributed as dist

from nanotron.checkpoint.saving import HostBuffers, Snapshot, write_snapshot
from nanotron.parallel.context import ParallelContext


class AsyncCheckpointer:
    def __init__(self, parallel_context: ParallelContext):
        self.pc = parallel_context
        self.group = dist.new_group(backend="gloo")  # collective: every rank creates it at the same point
        self.buffers = HostBuffers(parallel_context.device)
        self.thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    def save(self, take_snapshot: Callable[[], Snapshot], protected: set[str]) -> None:
        """Take the snapshot now (after the previous save is complete) and write it in the background."""
        self.wait()
        snapshot = take_snapshot()
        self.thread = threading.Thread(target=self._write, args=(snapshot, set(protected)), name="checkpoint-writer")
        self.thread.start()

    def _write(self, snapshot: Snapshot, protected: set[str]) -> None:
        try:
            write_snapshot(snapshot, self.pc, self.group, protected)
        except BaseException as error:  # raised in the training thread, at the next save or at the end
            self.failure = error

    def wait(self) -> None:
        """Block until the save in flight is complete; raise its failure, if any, here."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure
