"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

The ranks start from a fork server that imported torch and nanotron once, for the whole test session: a fresh
interpreter per rank spends over two seconds importing them, most of a small multi-rank test's time on two cores.
Each rank takes the caller's environment of the moment (the server's is that of its start)."""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queues
import signal
import socket
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "nanotron.trainer", "nanotron.cli", "support.runs",
                                "support.parity", "support.grad_norms"])


def _worker(rank: int, world_size: int, port: int, environment: dict, call: bytes, queue) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), NANOTRON_DEVICE="cpu", OMP_NUM_THREADS="1",
    )
    faulthandler.enable()  # a crash prints every thread's stack
    faulthandler.register(signal.SIGUSR1)  # so does the parent's signal when the run hangs
    try:
        # Plain pickle copies tensors by value, both ways: shared-memory handles would die with this process, and
        # the fork server passes at most a few hundred of them to a rank ("too many fds").
        fn, kwargs = pickle.loads(call)
        queue.put((rank, "ok", pickle.dumps(fn(**kwargs))))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, timeout: float = 240, **kwargs) -> list:
    """``fn(**kwargs)`` on every rank (it builds its own ParallelContext); returns the results ordered by rank."""
    queue = _CONTEXT.Queue()
    port = _free_port()
    call = pickle.dumps((fn, kwargs))
    processes = [_CONTEXT.Process(target=_worker, args=(rank, world_size, port, dict(os.environ), call, queue))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, value = queue.get(timeout=1)
            except queues.Empty:
                _check_alive(processes, results, deadline, timeout)
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [results[rank] for rank in range(world_size)]


def _check_alive(processes, results: dict, deadline: float, timeout: float) -> None:
    """Fail at once when a rank died without reporting (its peers would wait for it forever), and at the deadline
    with every live rank's stack printed to stderr."""
    for rank, process in enumerate(processes):
        if rank not in results and process.exitcode not in (None, 0):
            raise AssertionError(f"rank {rank} died with exit code {process.exitcode} before reporting")
    if time.monotonic() > deadline:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGUSR1)
        time.sleep(2)
        raise AssertionError(f"the ranks did not finish in {timeout:.0f} s; their stacks are on stderr")


def _each(function, calls: list[dict]) -> list:
    return [function(**kwargs) for kwargs in calls]


def run_distributed_each(fn, world_size: int, calls: list[dict], timeout: float = 480) -> list[list]:
    """``fn(**kwargs)`` for every entry of ``calls``, one after the other in the same N processes (spawning them is
    the slow part); returns, per call, the results ordered by rank."""
    per_rank = run_distributed(_each, world_size, timeout=timeout, function=fn, calls=calls)
    return [[rank_results[i] for rank_results in per_rank] for i in range(len(calls))]
