"""How a run ends, under torchrun or not. A stop signal saves and exits cleanly, then the run resumes, also when it
lands during the ranks' agreement to stop. With data loader workers, preempted: whoever gets the stop signal
(torchrun's agent, which passes it on to each rank's process group; every process of the job, as Slurm's scancel and
--signal do; or one rank), every rank finishes its step, saves the same step and exits 0 without a traceback, and the
resumed run trains exactly as an uninterrupted one. A loader worker that dies anyway (the out-of-memory killer) ends
its rank with one error line. An exception in a step ends its rank at once, its workers killed, and the launcher then
stops the others."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT
from support.configs import short_config, tiny_config_dict, write_config
from support.processes import (
    children,
    descendants,
    finished,
    killed_on_failure,
    running,
    signal_all,
    start_training,
    training_outcome,
)
from support.runs import checkpoint_json, fresh_environment, metrics

TIMEOUT_S = 120

# Runs a rank and writes its output and exit status to files in the folder given as $0: torchrun does not report its
# ranks' statuses when it is itself signalled. torchrun signals each rank's process group, so this shell, the process
# it starts, gets the signal with its rank; a trapped signal waits until the rank has exited, and a trap with a
# command, unlike an ignored signal, does not change how the rank handles it.
RANK_RECORDER = 'trap : INT TERM USR1; "$@" > "$0/rank-$RANK.log" 2>&1; echo $? > "$0/rank-$RANK.status"'
# As examples/slurm/train.sbatch starts the agent: ignoring Slurm's --signal=USR1, which every process of the job gets.
SLURM_AGENT = ["bash", "-c", 'trap "" USR1; exec "$@"', "agent"]


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]


def _config(tiny_data, run: Path, ranks: int, train_steps: int, **checkpoints) -> dict:
    """The tiny model with one loader worker per rank. The learning rate depends on the step alone (warmup and decay
    of fixed lengths), not on train_steps, so that runs of different lengths train alike."""
    config = tiny_config_dict(tiny_data, run, parallelism={"dp": ranks, "pp": 1, "tp": 1},
                              tokens={"micro_batch_size": 4 // ranks, "train_steps": train_steps},
                              checkpoints={"checkpoint_interval": 100_000, **checkpoints})
    config["optimizer"]["learning_rate_scheduler"] |= {"lr_warmup_steps": 1, "lr_decay_steps": 10}
    config["data_stages"][0]["data"]["num_loading_workers"] = 1
    return config


def _wait_for_steps(process: subprocess.Popen, run: Path, steps: int, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ((run / "metrics.jsonl").exists() and len(metrics(run)) >= steps):
        assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"fewer than {steps} steps after {TIMEOUT_S} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def _train(config: dict, ranks: int, path: Path) -> None:
    outcome = training_outcome(write_config(path, config), _torchrun(ranks), path.with_suffix(".log"), TIMEOUT_S)
    assert outcome.code == 0, outcome.stderr[-4000:]


def _curve(run: Path) -> list[tuple]:
    return [(r["step"], r["lm_loss"], r["grad_norm"], r["lr"]) for r in metrics(run)]


@pytest.mark.full_tier
@pytest.mark.parametrize("ranks, signum, receivers", [
    pytest.param(2, signal.SIGTERM, "every process", id="2-ranks-SIGTERM-to-every-process"),
    pytest.param(2, signal.SIGTERM, "torchrun", id="2-ranks-SIGTERM-to-torchrun", marks=pytest.mark.full_tier),
    pytest.param(2, signal.SIGTERM, "one rank", id="2-ranks-SIGTERM-to-one-rank", marks=pytest.mark.full_tier),
    pytest.param(1, signal.SIGTERM, "every process", id="1-rank-SIGTERM-to-every-process",
                 marks=pytest.mark.full_tier),
    pytest.param(1, signal.SIGTERM, "torchrun", id="1-rank-SIGTERM-to-torchrun", marks=pytest.mark.full_tier),
    pytest.param(2, signal.SIGUSR1, "slurm", id="2-ranks-slurm-SIGUSR1-to-every-process", marks=pytest.mark.full_tier),
])
def test_a_preempted_run_with_loader_workers_saves_on_every_rank_and_resumes_exactly(tiny_data, tmp_path, ranks,
                                                                                      signum, receivers):
    run, rank_logs, agent_log = tmp_path / "run", tmp_path / "ranks", tmp_path / "agent.log"
    rank_logs.mkdir()
    launcher = ((SLURM_AGENT if receivers == "slurm" else []) + _torchrun(ranks)
                + ["--no-python", "bash", "-c", RANK_RECORDER, str(rank_logs), sys.executable])
    agent = start_training(write_config(tmp_path / "config.yaml", _config(tiny_data, run, ranks, 100_000)), launcher,
                           agent_log)
    with killed_on_failure([agent]):
        _wait_for_steps(agent, run, 3, agent_log)
        rank_processes = [rank for recorder in children(agent.pid) for rank in children(recorder)]
        loader_workers = [worker for rank in rank_processes for worker in children(rank)]
        assert len(rank_processes) == len(loader_workers) == ranks
        targets = {"torchrun": [agent.pid], "one rank": rank_processes[-1:]}.get(
            receivers, [agent.pid, *descendants(agent.pid)])
        signal_all(targets, signum)
        finished(agent, agent_log, TIMEOUT_S)

    outputs = [(rank_logs / f"rank-{rank}.log").read_text() for rank in range(ranks)]
    for rank, output in enumerate(outputs):
        status = rank_logs / f"rank-{rank}.status"  # missing: the rank was killed, with its shell
        assert status.exists() and status.read_text().strip() == "0", output[-4000:]
        assert "Traceback" not in output, output[-4000:]
    if agent.pid not in targets:  # torchrun's own status when it is signalled is torchrun's
        assert agent.returncode == 0 and "Traceback" not in agent_log.read_text(), agent_log.read_text()[-4000:]
    step = checkpoint_json(run)["step"]
    assert step >= 3 and metrics(run)[-1]["step"] == step
    assert {f"rng/rank-{rank:05d}.safetensors" for rank in range(ranks)} <= set(checkpoint_json(run)["files"])
    for output in outputs:
        assert f"{signal.Signals(signum).name} received: stopped after step {step} with a checkpoint" in output

    _train(_config(tiny_data, run, ranks, step + 2, resume_checkpoint_path="auto"), ranks, tmp_path / "resume.yaml")
    _train(_config(tiny_data, tmp_path / "straight", ranks, step + 2), ranks, tmp_path / "straight.yaml")
    assert _curve(run) == _curve(tmp_path / "straight")


@pytest.mark.slow
def test_a_loader_worker_that_dies_ends_the_run_with_one_error_line(tiny_data, tmp_path):
    run, log = tmp_path / "run", tmp_path / "train.log"
    process = start_training(write_config(tmp_path / "config.yaml", _config(tiny_data, run, 1, 100_000)),
                             [sys.executable], log)
    with killed_on_failure([process]):
        _wait_for_steps(process, run, 2, log)
        [worker] = children(process.pid)
        os.kill(worker, signal.SIGKILL)  # what the out-of-memory killer does
        finished(process, log, TIMEOUT_S)
    output = log.read_text()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert process.returncode == 2 and "Traceback" not in output and len(errors) == 1, output[-4000:]
    assert f"data loader worker (pid {worker}) was killed by SIGKILL" in errors[0], errors[0]
    assert "num_loading_workers" in errors[0] and "resume_checkpoint_path: auto" in errors[0], errors[0]


# Runs the script it is given (run_train.py) with a bug in step 2 of rank $FAILING_RANK, which first writes the process
# ids of its rank's loader workers to the file $WORKER_PIDS.
FAILING_STEP = """
import multiprocessing, os, runpy, sys
from nanotron.training.step import StepProgram

run = StepProgram.run

def failing(self, micro_batches, step):
    if step == 2 and os.environ.get("RANK", "0") == os.environ["FAILING_RANK"]:
        pids = [str(child.pid) for child in multiprocessing.active_children()]
        open(os.environ["WORKER_PIDS"], "w").write(" ".join(pids))
        raise RuntimeError("a bug in step 2")
    return run(self, micro_batches, step)

StepProgram.run = failing
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_an_exception_in_a_step_ends_the_run_at_once_with_its_traceback(tiny_data, tmp_path, monkeypatch, ranks):
    """It hung: the exception's traceback kept the loader, whose workers ignore SIGTERM, alive until the interpreter's
    exit, which ends daemon processes with SIGTERM and then waits for them. Under torchrun the failing rank ends, the
    others fail in their next collective or are stopped by torchrun."""
    script, pids = tmp_path / "failing_step.py", tmp_path / "worker-pids"
    script.write_text(FAILING_STEP)
    monkeypatch.setenv("FAILING_RANK", str(ranks - 1))
    monkeypatch.setenv("WORKER_PIDS", str(pids))
    launcher = (_torchrun(ranks) if ranks > 1 else [sys.executable]) + [str(script)]
    outcome = training_outcome(write_config(tmp_path / "config.yaml", _config(tiny_data, tmp_path / "run", ranks, 10)),
                               launcher, tmp_path / "train.log", TIMEOUT_S)
    assert outcome.code == 1 and "RuntimeError: a bug in step 2" in outcome.stderr, outcome.stderr[-4000:]
    workers = [int(pid) for pid in pids.read_text().split()]
    assert len(workers) == 1 and not any(running(pid) for pid in workers), workers


@pytest.mark.parametrize("launch, signum", [("python", signal.SIGTERM),
                                            pytest.param("torchrun", signal.SIGUSR1, marks=pytest.mark.full_tier)])
def test_a_stop_signal_saves_and_exits_cleanly_then_the_run_resumes(tiny_data, tmp_path, launch, signum):
    run, log = tmp_path / "run", tmp_path / "train.log"
    parallelism = {"dp": 2} if launch == "torchrun" else {}
    config = short_config(tiny_data, run, 100_000, parallelism=parallelism)
    config["tokens"]["micro_batch_size"] = 2 if launch == "torchrun" else 4
    config["checkpoints"]["checkpoint_interval"] = 100_000
    launcher = [sys.executable] if launch == "python" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    process = start_training(write_config(tmp_path / "config.yaml", config), launcher, log)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and len(metrics(run)) >= 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    # Slurm's --signal reaches every task: under torchrun, every worker process of the agent
    for pid in [process.pid] if launch == "python" else children(process.pid):
        os.kill(pid, signum)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        for pid in children(process.pid) + [process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"the run did not stop within 120 s of {signal.Signals(signum).name}:\n"
                    + log.read_text()[-6000:])
    output = log.read_text()
    assert process.returncode == 0, output[-6000:]
    step = checkpoint_json(run)["step"]
    assert f"{signal.Signals(signum).name} received: stopped after step {step}" in output
    assert metrics(run)[-1]["step"] == step and step >= 3
    resume = config | {"tokens": config["tokens"] | {"train_steps": step + 2}}
    resume["checkpoints"] = config["checkpoints"] | {"resume_checkpoint_path": "auto"}
    command = launcher + [str(ROOT / "run_train.py"), "--config-file", str(write_config(tmp_path / "r.yaml", resume))]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              env=fresh_environment(OMP_NUM_THREADS="1"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, step + 3))


def test_a_signal_handled_during_the_stop_agreement_stops_the_next_step(monkeypatch):
    """Ranks spend much of a step waiting in collectives, the agreement's all-reduce among them: a signal handled
    there must not be overwritten by the other ranks' zeros (the run would train on and be killed later)."""
    import torch.distributed as dist

    from nanotron.preemption import StopRequests

    def all_reduce_while_signalled(flag, op, group):  # the other ranks' flags are 0; the signal lands meanwhile
        os.kill(os.getpid(), signal.SIGUSR1)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce_while_signalled)
    with StopRequests() as stop:
        assert not stop.agreed(None)  # not seen by the other ranks before the all-reduce
        monkeypatch.setattr(dist, "all_reduce", lambda flag, op, group: None)
        assert stop.agreed(None) and stop.signal_name == "SIGUSR1"
