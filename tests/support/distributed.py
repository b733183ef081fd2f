"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

The ranks start from a fork server that imported torch and nanotron once, for the whole test session: a fresh
interpreter per rank spends over two seconds importing them, most of a small multi-rank test's time on two cores.
Each rank takes the caller's environment of the moment (the server's is that of its start)."""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "nanotron.trainer", "nanotron.cli", "support.runs",
                                "support.parity"])


def _worker(rank: int, world_size: int, port: int, environment: dict, fn, kwargs: dict, queue) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), NANOTRON_DEVICE="cpu", OMP_NUM_THREADS="1",
    )
    try:
        # Plain pickle copies tensors by value: shared-memory handles would die with this process.
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
    processes = [_CONTEXT.Process(target=_worker, args=(rank, world_size, port, dict(os.environ), fn, kwargs, queue))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [results[rank] for rank in range(world_size)]


def _each(function, calls: list[dict]) -> list:
    return [function(**kwargs) for kwargs in calls]


def run_distributed_each(fn, world_size: int, calls: list[dict], timeout: float = 480) -> list[list]:
    """``fn(**kwargs)`` for every entry of ``calls``, one after the other in the same N processes (spawning them is
    the slow part); returns, per call, the results ordered by rank."""
    per_rank = run_distributed(_each, world_size, timeout=timeout, function=fn, calls=calls)
    return [[rank_results[i] for rank_results in per_rank] for i in range(len(calls))]
