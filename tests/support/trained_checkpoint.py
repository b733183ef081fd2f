"""A tiny run trained through ``nanotron train`` with evals after its last step, and what a user then does with its
checkpoint: ``nanotron generate`` with and without the cache, ``nanotron eval`` against the loop's scores. Each
family's tests give their own model's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.runs import cli, train_through_cli
from support.tasks import evals_section, task_examples, write_task


def train_with_evals(config: dict, tiny_data: dict, root: Path) -> dict:
    """Two steps of ``config`` (a ``tiny_config_dict``) through ``nanotron train``, a multiple-choice task and the
    held-out data scored after the last one, its checkpoint saved: the run folder and the task file."""
    task = write_task(root / "animals.jsonl", task_examples())
    config["tokens"] |= {"train_steps": 2, "batch_accumulation_per_replica": 1}
    config["optimizer"]["learning_rate_scheduler"] |= {"lr_warmup_steps": 1, "lr_decay_steps": 1}
    config["checkpoints"] |= {"save_final_state": True}
    config["evals"] = evals_section(task, tiny_data["tokenized"], num_fewshot=1)
    train_through_cli(config, root / "config.yaml")
    return {"run": Path(config["checkpoints"]["checkpoints_path"]), "task": task}


def assert_generation_is_the_same_without_the_cache(run: Path, folder: Path) -> None:
    """``nanotron generate`` on the checkpoint: two prompts of different lengths (left padding) give the same text
    through the cache and through whole recomputation."""
    prompts = folder / "prompts.txt"
    prompts.write_text("the cat\nthe quick brown dog runs over the\n")

    def completions(*options: str) -> str:
        outcome = cli("generate", "--ckpt-path", run, "--prompts-file", prompts, "--max-new-tokens", 8, *options)
        assert outcome.code == 0, outcome.stderr[-3000:]
        return outcome.stdout

    cached = completions()
    assert cached.startswith("=== the cat\n") and "=== the quick brown dog runs over the\n" in cached
    assert cached == completions("--no-cache")


def assert_eval_gives_the_in_loop_scores(trained: dict, tiny_data: dict, folder: Path) -> None:
    """``nanotron eval`` scores the task and the held-out data as the run (``train_with_evals``) scored them after
    its last step."""
    output = folder / "eval.json"
    outcome = cli("eval", "--ckpt-path", trained["run"], "--tasks", trained["task"], "--num-fewshot", 1,
                  "--data", tiny_data["tokenized"], "--max-windows", 4, "--sequence-length", 32, "--batch-size", 4,
                  "--output", output)
    assert outcome.code == 0, outcome.stderr[-3000:]
    standalone = json.loads(output.read_text())
    in_loop = json.loads((trained["run"] / "evals" / "2.json").read_text())
    assert standalone.keys() == in_loop.keys() == {"animals", "tokenized"}
    assert (standalone["animals"]["acc"], standalone["animals"]["acc_norm"]) == (in_loop["animals"]["acc"],
                                                                                 in_loop["animals"]["acc_norm"])
    torch.testing.assert_close(torch.tensor(standalone["animals"]["loglikelihoods"]),
                               torch.tensor(in_loop["animals"]["loglikelihoods"]), rtol=0, atol=1e-5)
    assert 3.0 < standalone["tokenized"]["loss"] < 7.0  # about ln(384) = 5.95 after 2 steps: a real loss
    assert standalone["tokenized"]["loss"] == pytest.approx(in_loop["tokenized"]["loss"], abs=1e-5)
