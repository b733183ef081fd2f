"""The step-hook interface (``training/hooks.py``): a feature defined here gets its calls in order at every step,
adds its metrics to metrics.jsonl, and has its state saved in checkpoints and given back on a resume; its step terms
and batch transforms reach the step; the trainer's modules import no feature by name, and the trainer names no
objective, batch transform, feature or family."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from nanotron.training.hooks import Feature
from support.configs import tiny_config_dict
from support.distributed import run_distributed

SOURCE = Path(__file__).resolve().parents[1] / "src" / "nanotron"


class Recorder(Feature):
    """Records every hook call; its state is the number of steps it has seen, across resumes."""

    def __init__(self):
        self.calls: list = []
        self.steps = 0

    def load_state_dict(self, checkpoint, metadata):
        self.steps = metadata["recorder"]["steps"]
        self.calls.append(("load_state_dict", self.steps))

    def start(self, run):
        assert run.folder == run.config.checkpoints.checkpoints_path and run.model is not None and run.pc is not None
        self.calls.append(("start", run.progress.step))

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


@pytest.mark.slow
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


class FirstTargetLeftOut:
    """A batch transform: every sample's first target leaves the objective (as a loss mask would)."""

    def prepare(self, batch):
        mask = batch.label_mask.clone()
        mask[:, 0] = False
        return dataclasses.replace(batch, label_mask=mask)

    def model_inputs(self, batch):
        return {}


class TargetCount:
    """A step term: no loss, a statistic (the targets the last stage trained on) and a metric."""

    def template(self):
        return {"targets": ()}

    def compute(self, stage, batch):
        return None, {"targets": batch.label_mask.sum().double()} if stage.last else {}

    def metrics(self, sums):
        return {"targets": int(sums["targets"].item())}


class CountedTargets(Feature):
    def step_terms(self):
        return [TargetCount()]

    def batch_transforms(self):
        return [FirstTargetLeftOut()]


def _train_with(config: dict, features: list) -> list[dict]:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config), features=features)
    try:
        trainer.train()
    finally:
        trainer.close()
    return [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]


@pytest.mark.slow
def test_a_features_step_term_and_batch_transform_reach_the_step_and_metrics_jsonl(tiny_data, tmp_path):
    """8 samples of 32 tokens a step, each with its first target left out by the feature's transform before the step
    counts them: its term reports 8 x 31 targets a step in metrics.jsonl, and the loss is the mean over those."""
    calls = [{"config": tiny_config_dict(tiny_data, tmp_path / name, tokens={"train_steps": 2}), "features": features}
             for name, features in (("counted", [CountedTargets()]), ("plain", []))]
    counted, plain = (run_distributed(_train_with, 1, **call)[0] for call in calls)
    assert [record["targets"] for record in counted] == [8 * 31, 8 * 31]
    assert "targets" not in plain[0] and counted[0]["lm_loss"] != plain[0]["lm_loss"]


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


def test_the_trainer_names_no_objective_batch_transform_feature_or_family():
    """Objectives and batch transforms are handed in (``training/step.py``): adding a loss term or a transform
    touches no line of the trainer, whose names say nothing of the z-loss, the context-parallel split, any loss,
    feature or family; it keeps to set-up, loop, saves and closing, in at most 300 lines."""
    path = SOURCE / "trainer.py"
    assert len(path.read_text().splitlines()) <= 300
    tree = ast.parse(path.read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    names = {name.lower() for name in names}
    assert names & {"cp", "z_loss", "loss_chunk_tokens"} == set()
    fragments = ("z_loss", "contextparallel", "split", "cross_entropy", "head", "router", "moe", "attention",
                 "doremi", "fp8", "llama", "qwen", "mamba")
    assert not [name for name in names if any(fragment in name for fragment in fragments)]
