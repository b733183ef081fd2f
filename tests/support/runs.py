"""Training runs, one ``train_*`` per way of running: ``nanotron train`` in this process
(``train_through_cli``), the Trainer in this process (``train_in_process``, also the function each rank runs),
the Trainer on N gloo ranks (``train_on_ranks``) and ``run_train.py`` in a fresh process
(``train_in_subprocess``); the CLI's outcome, in this process or a fresh one, and the files a run writes."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from support import ROOT
from support.configs import write_config
from support.distributed import run_distributed


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def cli(*args) -> Outcome:
    """``nanotron ARGS`` in this process; its exit status, stdout and stderr.

    Undoes what a command leaves behind in the process (the variables ParallelContext sets for a world of one, the
    ``nanotron`` log handler bound to the captured stream, a process group left by a failed start-up), so that
    every call starts as a fresh ``nanotron`` process would.
    """
    from nanotron.cli import main

    environment = dict(os.environ)
    logger = logging.getLogger("nanotron")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(arg) for arg in args])
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate
    return Outcome(code, out.getvalue(), err.getvalue())


def assert_user_error(outcome: Outcome, *fragments: str) -> str:
    """Exit status 2, exactly one `error:` line containing every fragment, no traceback; returns the line."""
    assert outcome.code == 2, outcome.stderr[-3000:]
    assert len(outcome.error_lines) == 1, outcome.stderr[-3000:]
    assert "Traceback" not in outcome.stderr, outcome.stderr[-3000:]
    line = outcome.error_lines[0]
    for fragment in fragments:
        assert fragment in line, line
    return line


def train_through_cli(config: dict, path: Path) -> Outcome:
    """``nanotron train`` on ``config`` (written to ``path``) in this process (``cli``); it must succeed."""
    outcome = cli("train", "--config-file", write_config(path, config))
    assert outcome.code == 0, outcome.stderr[-3000:]
    return outcome


def train_in_process(config: dict) -> list[dict]:
    """The Trainer in this process: on a rank of ``run_distributed`` or alone; rank 0's metrics records."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()
    return trainer_metrics(trainer)


def train_on_ranks(config: dict, ranks: int) -> list[dict]:
    """The Trainer on ``ranks`` gloo ranks (``train_in_process`` on each); rank 0's metrics records."""
    return run_distributed(train_in_process, ranks, config=config)[0]


# The variables of a process group; a test process that built a trainer in-process holds its group's, which a process
# it starts must not inherit (it would join, or listen on, that group's port).
DISTRIBUTED_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def fresh_environment(**changes: str) -> dict[str, str]:
    """The environment of a process a test starts as a user would: this one's on the CPU, without the variables of
    this process's own group, with ``changes``."""
    kept = {name: value for name, value in os.environ.items() if name not in DISTRIBUTED_VARIABLES}
    return kept | {"NANOTRON_DEVICE": "cpu"} | changes


def train_in_subprocess(config_path: Path, *, launcher: list[str] | None = None, check: bool = True
                        ) -> subprocess.CompletedProcess:
    """``run_train.py`` on the CPU in a fresh process (``python``, or ``launcher`` such as torchrun's command); it
    must succeed unless not ``check``."""
    env = fresh_environment(OMP_NUM_THREADS="1")
    command = (launcher or [sys.executable]) + [str(ROOT / "run_train.py"), "--config-file", str(config_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def trainer_metrics(trainer) -> list[dict]:
    """The records a trainer wrote to its metrics.jsonl, on rank 0 (which writes them); none on the other ranks."""
    if trainer.pc.rank != 0:
        return []
    return [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]


def python_process(*args) -> Outcome:
    """``python ARGS`` in a fresh process from the repository root, on the CPU."""
    result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=fresh_environment())
    return Outcome(result.returncode, result.stdout, result.stderr)


def nanotron_process(*args) -> Outcome:
    """``python -m nanotron ARGS`` in a fresh process, on the CPU: the command as a user runs it."""
    return python_process("-m", "nanotron", *args)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_json(run: Path) -> dict:
    return json.loads((run / (run / "latest.txt").read_text().strip() / "checkpoint.json").read_text())


def checkpoint_steps(run: Path) -> list[str]:
    """The steps of the checkpoints in a run folder, oldest first."""
    return sorted((p.name for p in run.iterdir() if p.name.isdigit()), key=int)


def train_with_flops(config: dict) -> dict:
    """The run's metrics (on rank 0) and its model and hardware FLOPs per token."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()
    flops = {"model_flops": trainer.flops_per_token, "hardware_flops": trainer.step_log.hardware_flops_per_token}
    return {"metrics": trainer_metrics(trainer), **flops}


def train_fp8_model(config: dict) -> dict:
    """The run in this process: the names of the linears and expert groups the FP8 converter gave FP8 products, the
    number of range counters, the metrics records (rank 0) and this rank's amax histories."""
    from nanotron.config import config_from_dict
    from nanotron.nn.fp8 import FP8Matmul, FP8RangeCounts
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    modules = dict(trainer.model.named_modules())
    linears = {name for name, module in modules.items() if isinstance(getattr(module, "matmul", None), FP8Matmul)}
    experts = {name for name, module in modules.items()
               if isinstance(getattr(module, "expert_matmul", None), FP8Matmul)}
    counters = sum(isinstance(module, FP8RangeCounts) for module in modules.values())
    trainer.train()
    histories = {name: b.clone() for name, b in trainer.model.named_buffers() if name.endswith("fp8_amaxes.history")}
    return {"linears": linears, "experts": experts, "counters": counters, "records": trainer_metrics(trainer),
            "histories": histories}


def train_fp8_twins(config: Callable[[Path], dict], folder: Path) -> tuple[dict, dict]:
    """``config(run folder)`` (a ``tiny_config_dict``) for 4 steps of one micro-batch without and with fp8.enabled
    (``train_fp8_model`` each): the FP8 run trains within 2% of its twin at every step, the twin learns. Both
    runs' modules and records."""
    def run(name: str) -> dict:
        changed = config(folder / name)
        changed["tokens"] |= {"train_steps": 4, "batch_accumulation_per_replica": 1}
        changed["optimizer"]["learning_rate_scheduler"] |= {"lr_warmup_steps": 1, "lr_decay_steps": 3}
        return train_fp8_model(changed | {"fp8": {"enabled": name == "fp8"}})

    plain, fp8 = run("plain"), run("fp8")
    assert plain["linears"] == plain["experts"] == set()
    for a, b in zip(plain["records"], fp8["records"], strict=True):
        assert b["lm_loss"] != a["lm_loss"] and abs(b["lm_loss"] - a["lm_loss"]) <= 0.02 * a["lm_loss"], a["step"]
    assert plain["records"][-1]["lm_loss"] < plain["records"][0]["lm_loss"]
    return plain, fp8


def train_example(example: Path, tiny_data: dict, folder: Path, steps: int = 2) -> list[dict]:
    """An example config as written (checked by the strict loader, saved and read back equal), with the quickstart's
    paths swapped for the test corpus's and ``steps`` steps, trained at its own parallelism; rank 0's records."""
    import yaml

    from nanotron.config import load_config, save_config

    config = load_config(example)  # the strict loader: unknown or duplicate keys would fail here
    save_config(config, folder / "saved.yaml")
    assert load_config(folder / "saved.yaml") == config
    raw = yaml.safe_load(example.read_text())
    raw["checkpoints"]["checkpoints_path"] = str(folder / "run")
    raw["tokenizer"]["tokenizer_name_or_path"] = str(tiny_data["tokenizer"])
    raw["data_stages"][0]["data"]["dataset"]["dataset_folder"] = str(tiny_data["tokenized"])
    raw["model"]["model_config"]["vocab_size"] = 384
    raw["tokens"]["train_steps"] = steps
    raw["logging"]["iteration_step_info_interval"] = 1
    return train_on_ranks(raw, config.parallelism.world_size)
