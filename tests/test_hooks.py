"""The step-hook interface (``training/hooks.py``): a feature defined here gets its calls in order at every step,
adds its metrics to metrics.jsonl, and has its state saved in checkpoints and given back on a resume; the trainer's
modules import no feature by name."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from distributed import run_distributed
from helpers import tiny_config_dict
from nanotron.training.hooks import Feature

SOURCE = Path(__file__).resolve().parents[1] / "src" / "nanotron"


class Recorder(Feature):
    """Records every hook call; its state is the number of steps it has seen, across resumes."""

    def __init__(self):
        self.calls: list = []
        self.steps = 0

    def load_state_dict(self, checkpoint, metadata):
        self.steps = metadata["recorder"]["steps"]
        self.calls.append(("load_state_dict", self.steps))

    def start(self, trainer):
        self.calls.append(("start", trainer.progress.step))

    def before_forward_backward(self, micro_batches):
        self.calls.append(("before_forward_backward", len(micro_batches)))

    def after_optimizer_step(self, skipped):
        self.calls.append(("after_optimizer_step", skipped))

    def after_step(self, step, statistics, skipped):
        self.steps += 1
        self.calls.append(("after_step", step, skipped, "lm_loss" in statistics))

    def metrics(self):
        self.calls.append(("metrics",))
        return {"recorded_steps": self.steps}

    def state_dict(self):
        self.calls.append(("state_dict", self.steps))
        return {"recorder": {"steps": self.steps}}

    def after_training(self):
        self.calls.append(("after_training",))


def _train_with_recorder(config: dict) -> dict:
    from nanotron.config import config_from_dict
    from nanotron.features import features_for
    from nanotron.trainer import Trainer

    parsed, recorder = config_from_dict(config), Recorder()
    trainer = Trainer(parsed, features=[*features_for(parsed), recorder])
    try:
        trainer.train()
    finally:
        trainer.close()
    metrics = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    return {"calls": recorder.calls, "metrics": metrics}


def _step_calls(step: int) -> list:
    return [("before_forward_backward", 2), ("after_optimizer_step", False), ("after_step", step, False, True),
            ("metrics",), ("state_dict", step)]


def test_a_feature_gets_its_hooks_in_order_and_its_state_back_on_resume(tiny_data, tmp_path):
    run = tmp_path / "run"
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": 2})
    config["checkpoints"] |= {"checkpoint_interval": 1, "resume_checkpoint_path": "auto"}
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    first = run_distributed(_train_with_recorder, 1, config=config)[0]
    assert first["calls"] == [("start", 0), *_step_calls(1), *_step_calls(2), ("after_training",)]
    assert [record["recorded_steps"] for record in first["metrics"]] == [1, 2]
    assert json.loads((run / "2" / "checkpoint.json").read_text())["recorder"] == {"steps": 2}

    config["tokens"]["train_steps"] = 3
    resumed = run_distributed(_train_with_recorder, 1, config=config)[0]
    assert resumed["calls"] == [("load_state_dict", 2), ("start", 2), *_step_calls(3), ("after_training",)]
    assert [record["recorded_steps"] for record in resumed["metrics"]] == [1, 2, 3]
    assert json.loads((run / "3" / "checkpoint.json").read_text())["recorder"] == {"steps": 3}


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code (names imported from a package included)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return modules


def test_the_trainer_imports_no_feature_by_name():
    """The loop and its pieces reach FP8 and DoReMi only through the hooks and ``features_for``."""
    trainer_files = [SOURCE / "trainer.py", *sorted((SOURCE / "training").glob("*.py"))]
    assert len(trainer_files) > 1
    specifics = ("nanotron.nn.fp8", "nanotron.features.fp8", "nanotron.features.doremi", "nanotron.doremi")
    for path in trainer_files:
        imported = _imported_modules(path)
        assert not [m for m in imported if m.startswith(specifics)], path
