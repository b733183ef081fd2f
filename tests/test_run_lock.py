"""One run at a time per run folder (``checkpoint/run_lock.py``), and metrics files written by one run only: real
training processes started side by side, killed with SIGKILL and stopped with SIGTERM, alone and under torchrun.
Training again over a finished run is refused; with ``resume_checkpoint_path: auto`` it continues."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT
from support.configs import short_config, write_config
from support.processes import children, start_training
from support.runs import (
    assert_user_error,
    checkpoint_json,
    checkpoint_steps,
    cli,
    fresh_environment,
    metrics,
    train_through_cli,
)

LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
}
WAIT_S = 180  # generous: the machine running the tests may be loaded


def _wait_for(condition, what: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen (exit status {process.poll()}):\n" + log.read_text()[-6000:])
        time.sleep(0.2)


def _logged_steps(run: Path) -> list[int]:
    """The steps of the complete records of a run's metrics file (the last line may be in the middle of a write)."""
    file = run / "metrics.jsonl"
    text = file.read_text() if file.exists() else ""
    return [json.loads(line)["step"] for line in text[:text.rfind("\n") + 1].splitlines()]


def _end(process: subprocess.Popen) -> None:
    """Kill -9 a run: under torchrun its workers as well as the agent."""
    for pid in children(process.pid) + [process.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def _stop(process: subprocess.Popen, launch: str, log: Path) -> None:
    """SIGTERM, as a scheduler sends it to every task (under torchrun, every worker); the run saves and exits."""
    for pid in children(process.pid) if launch == "torchrun" else [process.pid]:
        os.kill(pid, signal.SIGTERM)
    try:
        process.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        _end(process)
        pytest.fail("the run did not stop on SIGTERM:\n" + log.read_text()[-6000:])


@pytest.mark.parametrize("launch", ["python", pytest.param("torchrun", marks=pytest.mark.full_tier)])
@pytest.mark.slow
def test_a_second_run_on_a_running_folder_is_refused_and_after_kill_9_the_same_command_starts(
        tiny_data, tmp_path, launch):
    run, lock = tmp_path / "run", tmp_path / "run" / "run.lock"
    config = short_config(tiny_data, run, 100_000, checkpoints={"checkpoint_interval": 2,
                                                                "resume_checkpoint_path": "auto"})
    if launch == "torchrun":
        config["parallelism"]["dp"], config["tokens"]["micro_batch_size"] = 2, 2
    path = write_config(tmp_path / "config.yaml", config)
    command = LAUNCHERS[launch] + [str(ROOT / "run_train.py"), "--config-file", str(path)]
    first_log = tmp_path / "first.log"
    first = start_training(path, LAUNCHERS[launch], first_log)
    try:
        _wait_for(lambda: (run / "latest.txt").exists() and len(_logged_steps(run)) >= 3, "a checkpoint and 3 steps",
                  first, first_log)
        try:
            second = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S,
                                    env=fresh_environment(OMP_NUM_THREADS="1"))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the second run on {run} was not refused: still running after {WAIT_S} s")
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode != 0 and len(errors) == 1, second.stderr[-3000:]
        owner = json.loads(lock.read_text())
        assert owner["host"] == socket.gethostname() and owner["pid"] in [first.pid] + children(first.pid)
        for fragment in (f"checkpoints.checkpoints_path {run} is in use by another training run",
                         f"host {owner['host']}, pid {owner['pid']}, since {owner['started']}",
                         "or train in another checkpoints_path"):
            assert fragment in errors[0], errors[0]
        assert first.poll() is None, "the first run ended when the second started"
        steps = _logged_steps(run)
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3  # its metrics were left alone
    finally:
        _end(first)
    assert json.loads(lock.read_text()) == owner  # left behind by the killed run: stale now
    resumed_step = checkpoint_json(run)["step"]

    log = tmp_path / "again.log"
    again = start_training(path, LAUNCHERS[launch], log)
    try:
        _wait_for(lambda: f"step {resumed_step + 1}/100000" in log.read_text(), "training after the resume", again, log)
    finally:
        _stop(again, launch, log)
    output = log.read_text()
    assert again.returncode == 0, output[-6000:]
    assert f"removed the lock of {run} left by pid {owner['pid']}" in output and f"resumed from {run}" in output
    assert not lock.exists()  # released after the stop signal
    steps = _logged_steps(run)
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] > resumed_step


def test_the_lock_is_held_from_set_up_to_close_and_released_when_set_up_fails(tiny_data, tmp_path):
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    run, lock = tmp_path / "run", tmp_path / "run" / "run.lock"
    config = short_config(tiny_data, run, 2)
    environment = dict(os.environ)  # a world of one sets RANK, MASTER_PORT...: later subprocesses must not inherit them
    trainer = Trainer(config_from_dict(config))
    try:
        owner = json.loads(lock.read_text())
        assert (owner["host"], owner["pid"]) == (socket.gethostname(), os.getpid())
        trainer.train()
    finally:
        trainer.close()
        os.environ.clear()
        os.environ.update(environment)
    assert not lock.exists()
    again = cli("train", "--config-file", write_config(tmp_path / "again.yaml", config))  # refused after the lock
    assert_user_error(again, f"checkpoints.checkpoints_path {run} already holds a run")
    assert not lock.exists()


def test_a_lock_held_from_another_host_is_refused_with_how_to_remove_it(tiny_data, tmp_path):
    run, lock = tmp_path / "run", tmp_path / "run" / "run.lock"
    run.mkdir()
    lock.write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "2026-01-02T03:04:05+00:00"}))
    path = write_config(tmp_path / "config.yaml", short_config(tiny_data, run, 2))
    assert_user_error(cli("train", "--config-file", path),
                      f"{run} is in use by another training run (host node-17, pid 4242, since 2026-01-02T03:04:05",
                      f"cannot be checked from {socket.gethostname()}", f"delete {lock} by hand")
    lock.unlink()
    train_through_cli(short_config(tiny_data, run, 2), tmp_path / "after.yaml")
    assert not lock.exists()


def test_a_metrics_file_of_another_run_is_refused_and_continued_only_by_resuming_that_run(tiny_data, tmp_path):
    shared = tmp_path / "metrics.jsonl"
    first = short_config(tiny_data, tmp_path / "a", 3, logging={"metrics_path": str(shared)})
    train_through_cli(first, tmp_path / "a.yaml")
    before = shared.read_text()

    from_scratch = short_config(tiny_data, tmp_path / "b", 2, logging={"metrics_path": str(shared)})
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "b.yaml", from_scratch)),
                      f"logging.metrics_path {shared} already holds another run's metrics",
                      "this run resumes no checkpoint", "point logging.metrics_path at a new file")
    elsewhere = tmp_path / "elsewhere.jsonl"  # another run's records
    elsewhere.write_text('{"step": 1, "lm_loss": 5.0}\n')
    fork = short_config(tiny_data, tmp_path / "c", 5, logging={"metrics_path": str(elsewhere)},
                        checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(tmp_path / "a")})
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "c.yaml", fork)),
                      f"logging.metrics_path {elsewhere} already holds another run's metrics",
                      f"the checkpoint {tmp_path / 'a' / '3'} logs to {shared}")
    assert elsewhere.read_text() == '{"step": 1, "lm_loss": 5.0}\n'
    assert shared.read_text() == before

    resume = short_config(tiny_data, tmp_path / "a", 5, logging={"metrics_path": str(shared)},
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": "auto"})
    assert "resumed from" in train_through_cli(resume, tmp_path / "resume.yaml").stderr
    assert [json.loads(line)["step"] for line in shared.read_text().splitlines()] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_running_again_over_a_run_is_refused_and_auto_resumes(tiny_data, tmp_path):
    run = tmp_path / "run"
    config = short_config(tiny_data, run, 3)
    train_through_cli(config, tmp_path / "config.yaml")
    before = (run / "metrics.jsonl").read_text()
    outcome = cli("train", "--config-file", write_config(tmp_path / "again.yaml", config))
    assert_user_error(outcome, f"checkpoints.checkpoints_path {run} already holds a run",
                      "latest.txt names checkpoint '3'", "resume_checkpoint_path: auto")
    assert (run / "metrics.jsonl").read_text() == before and checkpoint_steps(run) == ["3"]
    auto = short_config(tiny_data, run, 5, checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": "auto"})
    assert "resumed from" in train_through_cli(auto, tmp_path / "auto.yaml").stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]
    fresh = short_config(tiny_data, tmp_path / "fresh", 2, checkpoints={"checkpoint_interval": 1000,
                                                                        "resume_checkpoint_path": "auto"})
    # nothing there yet: from scratch
    assert "resumed from" not in train_through_cli(fresh, tmp_path / "fresh.yaml").stderr
