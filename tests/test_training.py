"""End-to-end training through the command line: learning, metrics, exact resume, crash safety, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.configs import tiny_config_dict, write_config
from support.distributed import run_distributed
from support.runs import fresh_environment, metrics, train_in_subprocess


def test_tiny_model_learns_logs_and_checkpoints(tiny_data, tmp_path):
    config = tiny_config_dict(tiny_data, tmp_path / "ckpt", checkpoints={"checkpoint_interval": 10})
    result = train_in_subprocess(write_config(tmp_path / "config.yaml", config))
    assert "global batch: 8 sequences x 32 tokens = 256 tokens per step" in result.stderr
    records = metrics(tmp_path / "ckpt")
    assert [r["step"] for r in records] == list(range(1, 21))
    for key in ("lm_loss", "lr", "grad_norm", "consumed_tokens", "tokens_per_sec", "tokens_per_sec_per_gpu",
                "peak_memory_gb"):
        assert key in records[0], key
    assert records[-1]["consumed_tokens"] == 20 * 256
    assert records[0]["lm_loss"] > 5.5  # about ln(384) = 5.95 at initialisation
    assert records[-1]["lm_loss"] < records[0]["lm_loss"] - 1.5
    assert all(r["grad_norm"] > 0 for r in records)
    assert (tmp_path / "ckpt" / "latest.txt").read_text().strip() == "20"
    meta = json.loads((tmp_path / "ckpt" / "20" / "checkpoint.json").read_text())
    assert meta["step"] == 20 and meta["consumed_samples"] == {"main": 160}
    assert meta["model"]["padded_vocab_size"] == 384
    assert (tmp_path / "ckpt" / "10" / "model").is_dir()


def _schedule(train_steps: int) -> dict:
    # An explicit decay length makes the LR of steps 1..12 independent of train_steps.
    return {"learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 3, "lr_decay_steps": 9,
                                        "min_decay_lr": 3e-4}, "weight_decay": 0.01}


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.full_tier)])
@pytest.mark.slow
def test_resume_continues_bit_for_bit(tiny_data, tmp_path, dtype):
    model = tiny_config_dict(tiny_data, tmp_path)["model"] | {"dtype": dtype}
    straight = tiny_config_dict(tiny_data, tmp_path / "straight", model=model, optimizer=_schedule(12),
                                tokens={"train_steps": 12}, checkpoints={"checkpoint_interval": 100})
    train_in_subprocess(write_config(tmp_path / "straight.yaml", straight))

    first = tiny_config_dict(tiny_data, tmp_path / "resumed", model=model, optimizer=_schedule(12),
                             tokens={"train_steps": 7}, checkpoints={"checkpoint_interval": 100})
    train_in_subprocess(write_config(tmp_path / "first.yaml", first))
    second = tiny_config_dict(tiny_data, tmp_path / "resumed", model=model, optimizer=_schedule(12),
                              tokens={"train_steps": 12},
                              checkpoints={"checkpoint_interval": 100,
                                           "resume_checkpoint_path": str(tmp_path / "resumed")})
    result = train_in_subprocess(write_config(tmp_path / "second.yaml", second))
    assert "resumed from" in result.stderr

    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in b] == list(range(1, 13))  # steps logged once each, in order
    for x, y in zip(a, b):
        assert (x["step"], x["lm_loss"], x["grad_norm"], x["lr"], x["consumed_tokens"]) == (
            y["step"], y["lm_loss"], y["grad_norm"], y["lr"], y["consumed_tokens"])


CRASHING_TRAIN = """
import os, sys
import nanotron.checkpoint.saving as saving
from nanotron.cli import main

real_write = saving.write_boxes
def write_then_die(path, boxes):
    real_write(path, boxes)
    if ".tmp-6" in str(path):
        os._exit(9)  # killed in the middle of writing checkpoint 6
saving.write_boxes = write_then_die
main(["train", "--config-file", sys.argv[1]])
"""


@pytest.mark.full_tier
def test_crash_during_save_keeps_previous_checkpoint(tiny_data, tmp_path):
    config = tiny_config_dict(tiny_data, tmp_path / "ckpt", tokens={"train_steps": 8},
                              checkpoints={"checkpoint_interval": 3})
    path = write_config(tmp_path / "config.yaml", config)
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_TRAIN)
    crashed = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True,
                             env=fresh_environment(), timeout=300)
    assert crashed.returncode == 9
    assert (tmp_path / "ckpt" / "latest.txt").read_text().strip() == "3"
    assert not (tmp_path / "ckpt" / "6").exists()

    config["checkpoints"]["resume_checkpoint_path"] = str(tmp_path / "ckpt")
    result = train_in_subprocess(write_config(path, config))
    assert "at step 3" in result.stderr
    assert (tmp_path / "ckpt" / "latest.txt").read_text().strip() == "8"
    assert [r["step"] for r in metrics(tmp_path / "ckpt")] == list(range(1, 9))


def _error_line(tiny_data, tmp_path, **overrides) -> str:
    config = tiny_config_dict(tiny_data, tmp_path / "ckpt", **overrides)
    result = train_in_subprocess(write_config(tmp_path / "bad.yaml", config), check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.slow
def test_bad_inputs_fail_with_one_line_naming_the_problem(tiny_data, tmp_path):
    missing = tmp_path / "nowhere"
    stage = {"name": "main", "start_training_step": 1, "data": {"dataset": {"dataset_folder": [str(missing)]}}}
    assert str(missing) in _error_line(tiny_data, tmp_path, data_stages=[stage])

    small_vocab = tiny_config_dict(tiny_data, tmp_path)["model"]
    small_vocab["model_config"] = small_vocab["model_config"] | {"vocab_size": 100}
    assert "vocab_size" in _error_line(tiny_data, tmp_path, model=small_vocab)

    assert "no checkpoint at" in _error_line(
        tiny_data, tmp_path, checkpoints={"checkpoint_interval": 5, "resume_checkpoint_path": str(tmp_path / "empty")})

    typo = tiny_config_dict(tiny_data, tmp_path)["optimizer"] | {"wieght_decay": 0.1}
    assert "weight_decay" in _error_line(tiny_data, tmp_path, optimizer=typo)
    error = _error_line(tiny_data, tmp_path, parallelism={"expert_parallel_size": 2})
    assert "parallelism.expert_parallel_size" in error


@pytest.mark.slow
def test_divergence_stops_with_one_line_and_keeps_the_last_checkpoint(tiny_data, tmp_path):
    # An absurd learning rate makes the weights overflow after the first update: step 2's loss is not finite.
    optimizer = tiny_config_dict(tiny_data, tmp_path)["optimizer"]
    optimizer["learning_rate_scheduler"] = optimizer["learning_rate_scheduler"] | {"learning_rate": 1e30,
                                                                                   "lr_warmup_steps": 0}
    line = _error_line(tiny_data, tmp_path, optimizer=optimizer, checkpoints={"checkpoint_interval": 1})
    assert "training diverged" in line and "at step 2" in line
    assert (tmp_path / "ckpt" / "latest.txt").read_text().strip() == "1"


def _loop_calls(config: dict) -> tuple[list, list]:
    """The training loop's queueing, finishing and saving of steps, in order, and the steps its metrics logged."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    calls = []
    train_step, finish_step, save = Trainer.train_step, Trainer.finish_step, Trainer.save

    def queue(self, micro_batches, lr):
        calls.append(("queue", self.progress.step + 1))
        return train_step(self, micro_batches, lr)

    def finish(self, pending):
        calls.append(("finish", pending.step))
        return finish_step(self, pending)

    def saving(self):
        calls.append(("save", self.progress.step))
        save(self)

    Trainer.train_step, Trainer.finish_step, Trainer.save = queue, finish, saving
    trainer = Trainer(config_from_dict(config))
    try:
        trainer.train()
    finally:
        trainer.close()
    logged = [json.loads(line) for line in Path(config["logging"]["metrics_path"]).read_text().splitlines()]
    return calls, [(record["step"], record["lm_loss"] > 0, record["grad_norm"] > 0) for record in logged]


def test_the_loop_reads_a_step_back_once_the_next_is_queued_and_before_it_saves(tiny_data, tmp_path):
    """The GPU need not wait for the host between steps: the loop queues step n + 1 before it reads step n's loss and
    norm (and logs it), except where step n is saved or is the last, which it reads first."""
    config = tiny_config_dict(tiny_data, tmp_path / "run",
                              tokens={"train_steps": 5, "batch_accumulation_per_replica": 1},
                              checkpoints={"checkpoints_path": str(tmp_path / "run"), "checkpoint_interval": 2},
                              logging={"iteration_step_info_interval": 1, "metrics_path": str(tmp_path / "m.jsonl")})
    (calls, logged), = run_distributed(_loop_calls, 1, config=config)
    assert calls == [("queue", 1), ("queue", 2), ("finish", 1), ("finish", 2), ("save", 2),
                     ("queue", 3), ("queue", 4), ("finish", 3), ("finish", 4), ("save", 4),
                     ("queue", 5), ("finish", 5), ("save", 5)]
    assert logged == [(step, True, True) for step in range(1, 6)]


@pytest.mark.slow
def test_resume_options_retention_and_missing_files(tiny_data, tmp_path):
    from nanotron.checkpoint.integrity import read_metadata
    from nanotron.checkpoint.run_folder import resolve_checkpoint
    from nanotron.config import LRSchedulerArgs
    from nanotron.errors import CheckpointError
    from nanotron.optim.lr_schedule import learning_rate_at

    schedule = {"learning_rate": 3e-3, "lr_warmup_steps": 3, "min_decay_lr": 3e-4}
    first = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 6},
                             checkpoints={"checkpoint_interval": 2, "keep_last_n": 2},
                             optimizer={"learning_rate_scheduler": schedule})
    train_in_subprocess(write_config(tmp_path / "first.yaml", first))
    kept = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit())
    assert kept == ["4", "6"]  # keep_last_n: 2
    assert (tmp_path / "run" / "6" / "tokenizer" / "tokenizer.json").exists()

    fresh = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 12},
                             optimizer={"learning_rate_scheduler": schedule},
                             checkpoints={"checkpoint_interval": 100, "resume_checkpoint_path": str(tmp_path / "run"),
                                          "load_optimizer": False, "load_lr_scheduler": False})
    result = train_in_subprocess(write_config(tmp_path / "fresh.yaml", fresh))
    assert "fresh optimizer state and LR schedule" in result.stderr
    records = {r["step"]: r for r in metrics(tmp_path / "run")}
    # The schedule starts again at the resume step: warmup over 3 steps, then cosine down over the 6 remaining.
    restarted = LRSchedulerArgs(**schedule)
    assert records[7]["lr"] == pytest.approx(learning_rate_at(1, restarted, 6))
    assert records[12]["lr"] == pytest.approx(3e-4)

    checkpoint = resolve_checkpoint(tmp_path / "run")
    shard = next((checkpoint / "model").glob("*.safetensors"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        read_metadata(checkpoint)


@pytest.mark.slow
def test_compiled_model_and_loss_match_eager(tiny_data, tmp_path):
    """`model.compile` fuses the same computation: per-step loss and grad-norm equal the eager run."""
    runs = {}
    for compiled in (False, True):
        folder = tmp_path / f"compiled-{compiled}"
        config = tiny_config_dict(tiny_data, folder, tokens={"train_steps": 4},
                                  model=tiny_config_dict(tiny_data, folder)["model"] | {"compile": compiled},
                                  optimizer={"learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 2}})
        train_in_subprocess(write_config(tmp_path / f"{compiled}.yaml", config))
        runs[compiled] = metrics(folder)
    for eager, fused in zip(runs[False], runs[True], strict=True):
        assert fused["lm_loss"] == pytest.approx(eager["lm_loss"], rel=1e-5)
        assert fused["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-5)
