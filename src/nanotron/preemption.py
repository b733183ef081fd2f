"""Stopping on request: SIGTERM (what schedulers and ``kill`` send) or SIGUSR1 (what Slurm's ``--signal`` sends).

Instead of dying mid-step and losing up to a checkpoint interval of work, the run finishes the step in progress,
saves a checkpoint and exits with status 0. Under torchrun every rank gets the signal, though not necessarily
during the same step; after each step the ranks take the maximum of their flags (one tiny all-reduce), so all of
them stop after the same step and save together. The all-reduce runs over gloo on the host, so that it does not wait
for the GPU to finish the step while the host could queue the next one. Data loader workers, which schedulers and
torchrun signal with their rank, ignore these signals (``data/loader.py``): one dying of them would crash the step
before the save.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """Records stop signals while active (a context manager); ``agreed`` says whether every rank stops now."""

    def __init__(self) -> None:
        self.received: int = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _record(self, number: int, frame) -> None:
        self.received = number

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else "none"

    def agreed(self, group: dist.ProcessGroup | None) -> bool:
        """True on every rank once any rank has received a stop signal (collective when several ranks run, over
        ``group``: a gloo group of all of them, ``ParallelContext.host_group``)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return bool(self.received)
        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        agreed = int(flag.item())
        # A signal handled while this rank waited in the all-reduce is not in ``flag``: keep it for the next step's
        # agreement instead of overwriting it with the other ranks' zeros, which would lose the stop request.
        self.received = self.received or agreed
        return bool(agreed)
