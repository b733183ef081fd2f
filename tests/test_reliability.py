"""Surviving faults without losing data: rollback retention, re-runs over a run, corrupt files, planted pickles,
stop signals, other tokenizers, torn metrics, full disks, partial saves and stray ``latest.txt`` files."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT
from support.configs import short_config, write_config
from support.corpus import without_id_ranges, write_corpus
from support.processes import children, start_training
from support.runs import assert_user_error, checkpoint_json, cli, metrics, train_through_cli


def _steps(run: Path) -> list[str]:
    return sorted((p.name for p in run.iterdir() if p.name.isdigit()), key=int)


def test_keep_last_n_keeps_the_newest_checkpoints_after_a_rollback(tiny_data, tmp_path):
    run = tmp_path / "run"
    train_through_cli(short_config(tiny_data, run, 10, checkpoints={"checkpoint_interval": 2, "keep_last_n": 2}),
                      tmp_path / "a.yaml")
    assert _steps(run) == ["8", "10"]
    # Roll back to step 8 and save at step 9 with keep_last_n 1: step 9 is the newest, though 10 is higher.
    rollback = short_config(tiny_data, run, 9, checkpoints={"checkpoint_interval": 1, "keep_last_n": 1,
                                                            "resume_checkpoint_path": str(run / "8")})
    train_through_cli(rollback, tmp_path / "b.yaml")
    assert _steps(run) == ["9"] and (run / "latest.txt").read_text().strip() == "9"
    train_through_cli(short_config(tiny_data, run, 10, checkpoints={"checkpoint_interval": 1,
                                                                    "resume_checkpoint_path": "auto"}),
                      tmp_path / "c.yaml")
    assert checkpoint_json(run)["step"] == 10


def test_running_again_over_a_run_is_refused_and_auto_resumes(tiny_data, tmp_path):
    run = tmp_path / "run"
    config = short_config(tiny_data, run, 3)
    train_through_cli(config, tmp_path / "config.yaml")
    before = (run / "metrics.jsonl").read_text()
    outcome = cli("train", "--config-file", write_config(tmp_path / "again.yaml", config))
    assert_user_error(outcome, f"checkpoints.checkpoints_path {run} already holds a run",
                      "latest.txt names checkpoint '3'", "resume_checkpoint_path: auto")
    assert (run / "metrics.jsonl").read_text() == before and _steps(run) == ["3"]
    auto = short_config(tiny_data, run, 5, checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": "auto"})
    assert "resumed from" in train_through_cli(auto, tmp_path / "auto.yaml").stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]
    fresh = short_config(tiny_data, tmp_path / "fresh", 2, checkpoints={"checkpoint_interval": 1000,
                                                                        "resume_checkpoint_path": "auto"})
    # nothing there yet: from scratch
    assert "resumed from" not in train_through_cli(fresh, tmp_path / "fresh.yaml").stderr


@pytest.fixture
def saved(tiny_data, tmp_path) -> dict:
    run = tmp_path / "run"
    config = short_config(tiny_data, run, 2)
    train_through_cli(config, tmp_path / "config.yaml")
    return {"run": run, "checkpoint": run / "2", "config": config}


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_same_size_corruption_is_named_by_every_loader(saved, tiny_data, tmp_path):
    weights = next((saved["checkpoint"] / "model").glob("*.safetensors"))
    assert cli("checkpoint", "verify", saved["run"]).code == 0
    _flip_a_byte(weights)
    expected = (str(weights), "does not match its checksum")
    assert_user_error(cli("checkpoint", "verify", saved["run"]), *expected)
    resume = short_config(tiny_data, tmp_path / "resumed", 3,
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])})
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "resume.yaml", resume)), *expected)
    assert_user_error(cli("eval", "--ckpt-path", saved["run"], "--data", tiny_data["tokenized"],
                          "--sequence-length", "16"), *expected)
    assert_user_error(cli("generate", "--ckpt-path", saved["run"], "--prompt", "the"), *expected)
    assert_user_error(cli("convert", "nanotron-to-hf", "--ckpt-path", saved["run"], "--save-path", tmp_path / "hf"),
                      *expected)


def test_corrupt_optimizer_state_is_named_not_reported_as_divergence(saved, tiny_data, tmp_path):
    state = next((saved["checkpoint"] / "optimizer").glob("*.safetensors"))
    _flip_a_byte(state)
    resume = short_config(tiny_data, tmp_path / "resumed", 3,
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])})
    line = assert_user_error(cli("train", "--config-file", write_config(tmp_path / "resume.yaml", resume)),
                             str(state), "checksum")
    assert "learning_rate" not in line


class _Payload:
    """Unpickling this creates a file: proof that a load executed code from the checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_is_never_loaded(saved, tiny_data, tmp_path):
    from nanotron.checkpoint.manager import write_metadata

    rng = saved["checkpoint"] / "rng"
    marker = tmp_path / "executed"
    for file in rng.iterdir():  # a pickled rng file with a payload, and no other rng state
        file.unlink()
    (rng / "rank-00000.pt").write_bytes(pickle.dumps({"coords": {}, "state": _Payload(marker)}))
    metadata = json.loads((saved["checkpoint"] / "checkpoint.json").read_text())
    metadata["files"] = {name: entry for name, entry in metadata["files"].items() if not name.startswith("rng/")}
    write_metadata(saved["checkpoint"], metadata)
    resume = short_config(tiny_data, tmp_path / "resumed", 3,
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])})
    outcome = train_through_cli(resume, tmp_path / "resume.yaml")
    assert not marker.exists()
    assert "random states re-derived from the seed" in outcome.stderr


def test_resume_restores_the_random_generators_from_safetensors(saved):
    import random

    import numpy as np
    import torch

    from nanotron.random import load_rng_state, rng_state, write_rng_state

    coords = {"pp": 0, "dp": 0, "ep": 0, "tp": 0}
    write_rng_state(saved["run"] / "rng.safetensors", *rng_state(torch.device("cpu"), coords))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    assert not load_rng_state(saved["run"] / "rng.safetensors", torch.device("cpu"), coords | {"tp": 1})
    assert not load_rng_state(saved["run"] / "rng.safetensors", torch.device("cpu"), coords | {"cp": 1})
    assert load_rng_state(saved["run"] / "rng.safetensors", torch.device("cpu"), coords | {"cp": 0})  # saved before cp
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.parametrize("launch, signum", [("python", signal.SIGTERM),
                                            pytest.param("torchrun", signal.SIGUSR1, marks=pytest.mark.slow)])
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
                              env={**os.environ, "NANOTRON_DEVICE": "cpu", "OMP_NUM_THREADS": "1"})
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


def test_resuming_on_data_from_another_tokenizer_is_refused_unless_asked(saved, tiny_data, tmp_path):
    from nanotron.data.preprocess import preprocess
    from nanotron.data.tokenizer import train_tokenizer

    corpus = write_corpus(tmp_path / "raw", documents=100, seed=5)
    other = train_tokenizer([corpus], 300, tmp_path / "other.json")
    preprocess([corpus], other, tmp_path / "other_data", num_workers=1)
    stage = {"name": "main", "start_training_step": 1,
             "data": {"seed": 3, "num_loading_workers": 0,
                      "dataset": {"dataset_folder": [str(tmp_path / "other_data")]}}}
    checkpoints = {"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])}
    resume = short_config(tiny_data, tmp_path / "resumed", 3, data_stages=[stage], checkpoints=checkpoints,
                          tokenizer={"tokenizer_name_or_path": None})
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "resume.yaml", resume)),
                      str(tmp_path / "other_data"), "another tokenizer", "checkpoints.allow_tokenizer_change")
    resume["checkpoints"]["allow_tokenizer_change"] = True
    assert "resumed from" in train_through_cli(resume, tmp_path / "allowed.yaml").stderr


@pytest.mark.parametrize("damage, fragment", [
    (lambda m: "{not json", "cannot read"),
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "consumed_samples"}), "'consumed_samples' is missing"),
    (lambda m: json.dumps(m | {"step": "two"}), "'step' is missing or not an int (got 'two')"),
], ids=["bad-json", "missing-key", "step-not-an-integer"])
def test_a_corrupt_checkpoint_json_is_one_error(saved, tiny_data, tmp_path, damage, fragment):
    file = saved["checkpoint"] / "checkpoint.json"
    file.write_text(damage(json.loads(file.read_text())))
    resume = short_config(tiny_data, tmp_path / "resumed", 3,
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])})
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "resume.yaml", resume)), fragment)
    assert_user_error(cli("eval", "--ckpt-path", saved["run"], "--data", tiny_data["tokenized"]), fragment)


def test_out_of_vocabulary_ids_in_a_shard_are_one_error(tiny_data, tmp_path):
    import numpy as np

    data = tmp_path / "data"
    shutil.copytree(tiny_data["tokenized"], data)
    metadata = json.loads((data / "metadata.json").read_text())
    shard = data / metadata["shards"][0]["tokens"]
    vocab = metadata["tokenizer"]["vocab_size"]
    tokens = np.load(shard, mmap_mode="r+")
    tokens[::16] = vocab  # one id past the vocabulary in every training window
    tokens.flush()
    (data / "metadata.json").write_text(json.dumps(without_id_ranges(metadata)))  # edited: the shard is read
    stage = {"name": "main", "start_training_step": 1,
             "data": {"seed": 3, "num_loading_workers": 0, "dataset": {"dataset_folder": [str(data)]}}}
    config = short_config(tiny_data, tmp_path / "run", 4, data_stages=[stage])
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                      str(data), f"token id {vocab} at token", f"outside the vocabulary of its tokenizer ({vocab} ids)")


def test_a_torn_metrics_line_is_dropped_on_resume(saved, tiny_data, tmp_path):
    with open(saved["run"] / "metrics.jsonl", "a") as file:
        file.write('{"step": 3, "lm_lo')
    resume = short_config(tiny_data, saved["run"], 3, checkpoints={"checkpoint_interval": 1000,
                                                                   "resume_checkpoint_path": "auto"})
    outcome = train_through_cli(resume, tmp_path / "resume.yaml")
    assert "dropped 1 line(s) that are not step records" in outcome.stderr
    assert [r["step"] for r in metrics(saved["run"])] == [1, 2, 3]


def _save_into_a_full_disk(config: dict) -> dict:
    import nanotron.files as files
    from nanotron.config import config_from_dict
    from nanotron.errors import CheckpointError
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()  # saves step 2 normally

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    files.save_file = full
    trainer.progress.step = 3
    try:
        trainer.save()
        trainer.wait_for_saves()  # an asynchronous save reports its failure here
        message = None
    except CheckpointError as error:
        message = str(error)
    return {"message": message}


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["foreground", "background"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_how_much_is_needed(tiny_data, tmp_path, async_save):
    from support.distributed import run_distributed

    run = tmp_path / "run"
    config = short_config(tiny_data, run, 2, parallelism={"dp": 2})
    config["checkpoints"]["async_save"] = async_save
    config["tokens"]["micro_batch_size"] = 2
    results = run_distributed(_save_into_a_full_disk, 2, config=config)
    for result in results:  # every rank reports the same error instead of waiting for the others
        assert "no space left on the device" in result["message"] and "(the size of the previous" in result["message"]
    assert _steps(run) == ["2"] and not list(run.glob(".tmp-*"))
    assert (run / "latest.txt").read_text().strip() == "2"


def test_an_unwritable_checkpoint_folder_is_refused_before_training(tiny_data, tmp_path):
    (tmp_path / "file").write_text("")
    config = short_config(tiny_data, tmp_path / "file" / "run", 2)
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                      "checkpoints.checkpoints_path", "is not writable")


def test_partial_saves_are_removed_and_a_missing_latest_falls_back(saved, tiny_data, tmp_path):
    run = saved["run"]
    (run / ".tmp-7" / "model").mkdir(parents=True)
    (run / "latest.txt").unlink()
    resume = short_config(tiny_data, run, 3, checkpoints={"checkpoint_interval": 1000,
                                                          "resume_checkpoint_path": "auto"})
    outcome = train_through_cli(resume, tmp_path / "resume.yaml")
    assert "latest.txt is missing: resuming from" in outcome.stderr and "resumed from" in outcome.stderr
    assert not (run / ".tmp-7").exists() and checkpoint_json(run)["step"] == 3


def test_latest_pointing_outside_the_run_folder_is_refused(saved, tiny_data, tmp_path):
    (saved["run"] / "latest.txt").write_text("../../elsewhere\n")
    assert_user_error(cli("checkpoint", "verify", saved["run"]), "latest.txt names '../../elsewhere'")


def test_bad_step_guard_judges_non_finite_values_and_spikes():
    from nanotron.divergence import BadStepGuard

    guard = BadStepGuard(skip_limit=1, spike_factor=1.5)
    assert [guard.judge(loss, 1.0) for loss in (4.0, 4.1, 3.9)] == [None, None, None]
    assert "more than optimizer.loss_spike_factor=1.5 times" in guard.judge(6.5, 1.0) and not guard.exhausted
    assert "not finite" in guard.judge(4.0, float("nan")) and guard.exhausted  # two bad steps in a row
    assert guard.judge(4.0, 1.0) is None and guard.bad_in_a_row == 0
    assert "not finite" in BadStepGuard(0, None).judge(float("inf"), 1.0)


def test_a_loss_spike_is_skipped_then_stops_and_the_checkpoint_before_it_survives(tiny_data, tmp_path):
    """From step 31 on the data is characters the corpus never has: the loss jumps well above the recent mean. Steps
    31 and 32 are skipped (skip_bad_steps 2), step 33 stops the run; keep_last_n 1 would prune checkpoint 30, the
    newest before the spike, when 32 is saved, but it is kept."""
    import random

    from nanotron.data.preprocess import preprocess

    rng = random.Random(0)
    noise = tmp_path / "noise.jsonl"
    noise.write_text("".join(json.dumps({"text": "".join(rng.choice("QXZJ#@%&") for _ in range(400))}) + "\n"
                             for _ in range(200)))
    preprocess([noise], tiny_data["tokenizer"], tmp_path / "noise", num_workers=1)
    stages = [{"name": name, "start_training_step": start,
               "data": {"seed": 3, "num_loading_workers": 0, "dataset": {"dataset_folder": [str(folder)]}}}
              for name, start, folder in (("main", 1, tiny_data["tokenized"]), ("noise", 31, tmp_path / "noise"))]
    run = tmp_path / "run"
    config = short_config(tiny_data, run, 40, data_stages=stages,
                          checkpoints={"checkpoint_interval": 2, "keep_last_n": 1})
    config["optimizer"] |= {"skip_bad_steps": 2, "loss_spike_factor": 1.3}
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    line = assert_user_error(outcome, "at step 33", "loss_spike_factor=1.3", "after 2 skipped step(s)")
    assert "training diverged" in line
    assert "step 31: loss" in outcome.stderr and "update skipped (1 in a row" in outcome.stderr
    records = metrics(run)
    assert [r["step"] for r in records if r.get("skipped_update")] == [31, 32]
    assert _steps(run) == ["30", "32"]  # 30 is protected; 32 holds the weights of step 30 (both updates skipped)


@pytest.mark.slow
def test_kill_9_at_any_moment_then_auto_resume_gives_the_uninterrupted_curve(tiny_data, tmp_path):
    """Fault injection: SIGKILL at random moments of a run that saves every step (so often inside a save), then the
    same command with resume_checkpoint_path: auto, until it finishes; the losses equal the uninterrupted run's."""
    import random

    steps = 24

    def config(run: Path) -> dict:
        return short_config(tiny_data, run, steps, checkpoints={"checkpoint_interval": 1, "keep_last_n": 2,
                                                                 "resume_checkpoint_path": "auto"})

    train_through_cli(config(tmp_path / "straight"), tmp_path / "straight.yaml")
    run, rng, kills = tmp_path / "killed", random.Random(0), 0
    path = write_config(tmp_path / "killed.yaml", config(run))
    for target in sorted(rng.sample(range(2, steps - 2), 3)):
        process = start_training(path, [sys.executable])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None and not (
                (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= target):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.05))  # somewhere in the step or the save that follows it
        process.kill()
        process.wait()
        kills += process.returncode == -signal.SIGKILL
    train_through_cli(config(run), tmp_path / "final.yaml")
    assert kills == 3
    straight = {r["step"]: r["lm_loss"] for r in metrics(tmp_path / "straight")}
    assert {r["step"]: r["lm_loss"] for r in metrics(run)} == straight


def test_background_saves_write_the_same_checkpoints_as_foreground_ones(tiny_data, tmp_path):
    runs = {}
    for async_save in (False, True):
        run = tmp_path / f"async-{async_save}"
        train_through_cli(short_config(tiny_data, run, 6, checkpoints={"checkpoint_interval": 2,
                                                                       "async_save": async_save}),
                          tmp_path / f"{async_save}.yaml")
        runs[async_save] = run
    assert _steps(runs[True]) == ["2", "4", "6"] and cli("checkpoint", "verify", runs[True]).code == 0
    for step in ("2", "4", "6"):
        files = [json.loads((runs[a] / step / "checkpoint.json").read_text())["files"] for a in (False, True)]
        tensors = {name: entry["crc32"] for name, entry in files[0].items() if name.startswith(("model/", "optim"))}
        assert tensors and tensors == {name: files[1][name]["crc32"] for name in tensors}
