"""Training processes a test steers: started in the background, signalled, waited for, and stopped with
every process they started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support import ROOT
from support.runs import Outcome, fresh_environment


def start_training(config_path: Path, launcher: list[str], log: Path | None = None) -> subprocess.Popen:
    """Start a training run; its output goes to ``log`` (a file: a pipe nobody reads while the test waits would
    stall the run once full)."""
    env = fresh_environment(OMP_NUM_THREADS="1")
    with open(log or os.devnull, "w") as output:
        return subprocess.Popen(launcher + [str(ROOT / "run_train.py"), "--config-file", str(config_path)],
                                stdout=output, stderr=subprocess.STDOUT, text=True, env=env)


def children(pid: int) -> list[int]:
    listing = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(child) for child in listing.split()]


def descendants(pid: int) -> list[int]:
    """Every process started by ``pid``, depth first (a child, then what it started)."""
    return [d for child in children(pid) for d in (child, *descendants(child))]


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def kill_with_descendants(processes: list[subprocess.Popen]) -> None:
    """Those still running, with everything they started: torchrun's workers run in sessions of their own and
    would outlive their agent (or the script that started it) if only that were killed."""
    for process in processes:
        if process.poll() is None:
            signal_all([*descendants(process.pid), process.pid], signal.SIGKILL)
            process.wait()


def wait_for_all(processes: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> None:
    """Every process exits 0; as soon as one fails (or the time is up) the others are stopped, not waited for."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in processes) and not any(p.poll() for p in processes):
            assert time.monotonic() < deadline, f"still running after {timeout_s} s"
            time.sleep(0.2)
    finally:
        kill_with_descendants(processes)
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log.read_text()[-4000:]


@contextlib.contextmanager
def killed_on_failure(processes: list[subprocess.Popen]):
    try:
        yield
    except BaseException:
        kill_with_descendants(processes)
        raise


def finished(process: subprocess.Popen, log: Path, timeout_s: float) -> Outcome:
    """The exit status and output (``log``, all in ``stderr``) of ``process`` once it ends; one still running after
    ``timeout_s`` fails the test (inside ``killed_on_failure``, which then stops it with everything it started)."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout_s} s:\n{log.read_text()[-4000:]}")
    return Outcome(process.returncode, "", log.read_text())


def training_outcome(config_path: Path, launcher: list[str], log: Path, timeout_s: float) -> Outcome:
    """A training run (``start_training``) to its end, within ``timeout_s`` (``finished``)."""
    process = start_training(config_path, launcher, log)
    with killed_on_failure([process]):
        return finished(process, log, timeout_s)


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, which only waits to be reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
