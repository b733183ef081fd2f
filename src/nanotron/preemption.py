"""Stopping on request: SIGTERM (what schedulers and ``kill`` send) or SIGUSR1 (what Slurm's ``--signal`` sends).

Instead of dying mid-step and losing up to a checkpoint interval of work, the run finishes the step in progress,
saves a checkpoint and exits with status 0. Under torchrun every rank gets the signal, though not necessarily
during the same step; after each step the ranks take the maximum of their flags (one tiny all-reduce), so all of
them stop after the same step and save together. Each agreement reads the all-reduce of the step before: on GPUs,
reading its own would wait for the step's work to end, and the host could not queue the next step meanwhile. Data
loader workers, which schedulers and torchrun signal with their rank, ignore these signals (``data/loader.py``): one
dying of them would crash the step before the save.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from nanotron.parallel.statistics import HostCopy

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """Records stop signals while active (a context manager); ``agreed`` says whether every rank stops now."""

    def __init__(self) -> None:
        self.received: int = 0
        self._previous: dict[int, object] = {}
        self._flags: HostCopy | None = None  # the flags all-reduced at the last agreement, on their way to the host

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

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank has received a stop signal (collective when several ranks run). Several
        ranks agree on the flags they all-reduced at the previous call, a step late: every rank reads the same
        result, so they still stop after the same step."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return bool(self.received)
        flag = torch.full((1,), self.received, dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        previous, self._flags = self._flags, HostCopy({"flag": flag})
        if previous is None:
            return False
        agreed = int(previous.values()["flag"])
        # A signal handled while this rank waited in an all-reduce is not in its flag: keep it for a later agreement
        # instead of overwriting it with the other ranks' zeros, which would lose the stop request.
        self.received = self.received or agreed
        return bool(agreed)
