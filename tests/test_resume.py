"""Resuming a run: the same model shape or one clear error, a rollback keeping the newest checkpoints, a missing
``latest.txt`` or a torn metrics line survived, the random generators restored, data stages continued exactly across
their boundaries and by position when renamed, a change of data or sequence length warned before the first step,
and a run killed at any moment continuing on its uninterrupted curve."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from support.configs import resume_config, short_config, write_config
from support.corpus import write_corpus
from support.processes import start_training
from support.runs import assert_user_error, checkpoint_json, checkpoint_steps, cli, metrics, train_through_cli

# --- another model shape --------------------------------------------------------------------------------------------

MISMATCH = "model.model_config does not match the model in"


@pytest.mark.parametrize("model_config, fragments", [
    pytest.param({"hidden_size": 32}, ["hidden_size 64 (checkpoint) vs 32 (config)"], id="hidden-64-to-32"),
    pytest.param({"intermediate_size": 96}, ["intermediate_size 128 (checkpoint) vs 96"], id="intermediate-128-to-96"),
    pytest.param({"num_hidden_layers": 3}, ["num_hidden_layers 2 (checkpoint) vs 3"], id="layers-2-to-3"),
    pytest.param({"tie_word_embeddings": False}, ["tie_word_embeddings True (checkpoint) vs False"], id="untied"),
    # Shapes that happen to fit: fewer layers (the checkpoint's layers.1.* would be dropped), heads re-cut at the
    # same width (qkv rows 4*16+2*2*16 = 8*8+2*4*8), a larger vocabulary taken for padding.
    pytest.param({"num_hidden_layers": 1}, ["num_hidden_layers 2 (checkpoint) vs 1"], id="layers-2-to-1"),
    pytest.param({"num_attention_heads": 8, "num_key_value_heads": 4},
                 ["num_attention_heads 4 (checkpoint) vs 8", "num_key_value_heads 2 (checkpoint) vs 4"],
                 id="heads-4x2-to-8x4-same-shapes"),
    pytest.param({"vocab_size": 512}, ["vocab_size 384 (checkpoint) vs 512"], id="vocab-384-to-512"),
])
def test_resume_with_another_model_shape_is_one_clear_error(base, tmp_path, model_config, fragments):
    config = resume_config(base, tmp_path / "run", model_config=model_config)
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, MISMATCH, *fragments)
    assert not (tmp_path / "run" / "latest.txt").exists()  # nothing was trained or saved


def test_resume_with_the_same_model_shape_still_works(base, tmp_path):
    """The control for the cases above: the same resume with the checkpoint's own config trains on."""
    config = resume_config(base, tmp_path / "run")
    outcome = train_through_cli(config, tmp_path / "config.yaml")
    assert "resumed from" in outcome.stderr
    assert [record["step"] for record in metrics(tmp_path / "run")] == [3]


@pytest.mark.slow
def test_resume_with_another_optimizer_is_refused_by_name_unless_its_state_starts_fresh(base, tmp_path):
    """The checkpoint holds AdamW's moments: Muon cannot take them. Without optimizer state the switch is allowed."""
    config = resume_config(base, tmp_path / "run")
    config["optimizer"]["name"] = "muon"
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, "optimizer.optimizer_factory.name is muon", "holds the state of adamw",
                      "checkpoints.load_optimizer: false")
    assert not (tmp_path / "run" / "latest.txt").exists()
    config["checkpoints"]["load_optimizer"] = False
    train_through_cli(config, tmp_path / "fresh.yaml")
    assert checkpoint_json(tmp_path / "run")["optimizer"] == "muon"


# --- across a data-stage boundary -----------------------------------------------------------------------------------

STEPS, SECOND_STAGE_START = 10, 6


GLOBAL_BATCH = 8  # micro_batch_size 4 x batch_accumulation_per_replica 2


def _two_stage_config(tiny_data, run: Path, train_steps: int, **checkpoints) -> dict:
    config = short_config(tiny_data, run, train_steps, checkpoints={"checkpoint_interval": 1000, **checkpoints})
    # An explicit decay length: the LR of every step is the same whatever train_steps is.
    config["optimizer"]["learning_rate_scheduler"] |= {"lr_warmup_steps": 2, "lr_decay_steps": STEPS - 2}
    first = config["data_stages"][0]
    config["data_stages"].append({"name": "second", "start_training_step": SECOND_STAGE_START,
                                  "data": {**first["data"], "seed": 11}})
    return config


@pytest.fixture(scope="module")
def two_stage_runs(tiny_data, tmp_path_factory) -> dict:
    """Two 10-step runs of the same two-stage config: one straight, one saving a checkpoint after every step."""
    root = tmp_path_factory.mktemp("stages")
    train_through_cli(_two_stage_config(tiny_data, root / "straight", STEPS), root / "straight.yaml")
    train_through_cli(_two_stage_config(tiny_data, root / "saving", STEPS, checkpoint_interval=1), root / "saving.yaml")
    return {"root": root, "straight": root / "straight", "saving": root / "saving"}


def _assert_same_steps(reference: list[dict], records: list[dict], steps: range) -> None:
    by_step = {record["step"]: record for record in reference}
    assert [record["step"] for record in records] == list(steps)
    for record in records:
        expected = by_step[record["step"]]
        assert record["lm_loss"] == pytest.approx(expected["lm_loss"], abs=1e-6), record["step"]
        assert record["lr"] == pytest.approx(expected["lr"], abs=1e-12), record["step"]
        assert record["consumed_tokens"] == expected["consumed_tokens"], record["step"]


@pytest.mark.slow
def test_two_stage_reference_runs_switch_stage_and_agree(two_stage_runs):
    straight, saving = metrics(two_stage_runs["straight"]), metrics(two_stage_runs["saving"])
    _assert_same_steps(straight, saving, range(1, STEPS + 1))  # saving a checkpoint changes nothing
    samples = {"main": (SECOND_STAGE_START - 1) * GLOBAL_BATCH,
               "second": (STEPS - SECOND_STAGE_START + 1) * GLOBAL_BATCH}
    assert checkpoint_json(two_stage_runs["straight"])["consumed_samples"] == samples


@pytest.mark.parametrize("stop", [SECOND_STAGE_START - 2, SECOND_STAGE_START - 1, SECOND_STAGE_START],
                         ids=["before-boundary", "at-boundary", "first-step-of-second-stage"])
@pytest.mark.slow
def test_resume_across_a_data_stage_boundary_continues_exactly(tiny_data, two_stage_runs, tmp_path, stop):
    resumed = tmp_path / "resumed"
    config = _two_stage_config(tiny_data, resumed, STEPS,
                               resume_checkpoint_path=str(two_stage_runs["saving"] / str(stop)))
    outcome = train_through_cli(config, tmp_path / "resume.yaml")
    assert f"resumed from {two_stage_runs['saving'] / str(stop)} at step {stop}" in outcome.stderr
    _assert_same_steps(metrics(two_stage_runs["straight"]), metrics(resumed), range(stop + 1, STEPS + 1))
    assert checkpoint_json(resumed)["step"] == STEPS
    straight = checkpoint_json(two_stage_runs["straight"])
    assert checkpoint_json(resumed)["consumed_samples"] == straight["consumed_samples"]


def test_first_part_of_a_two_stage_run_then_resume_matches_straight(tiny_data, two_stage_runs, tmp_path):
    run, stop = tmp_path / "run", SECOND_STAGE_START - 2
    train_through_cli(_two_stage_config(tiny_data, run, stop), tmp_path / "first.yaml")
    train_through_cli(_two_stage_config(tiny_data, run, STEPS, resume_checkpoint_path=str(run)),
                      tmp_path / "second.yaml")
    _assert_same_steps(metrics(two_stage_runs["straight"]), metrics(run), range(1, STEPS + 1))
    assert checkpoint_json(run)["consumed_samples"] == checkpoint_json(two_stage_runs["straight"])["consumed_samples"]


def _renamed(config: dict, *names: str) -> dict:
    for stage, name in zip(config["data_stages"], names):
        stage["name"] = name
    return config


def test_renamed_stages_continue_their_data_by_position(tiny_data, two_stage_runs, tmp_path):
    """Stopped in the second stage, resumed with both stages renamed (same start steps): each renamed stage goes on
    where its checkpoint stage stopped, as the straight run does, and the warnings say so before the first step."""
    resumed, stop = tmp_path / "resumed", SECOND_STAGE_START
    config = _renamed(_two_stage_config(tiny_data, resumed, STEPS,
                                        resume_checkpoint_path=str(two_stage_runs["saving"] / str(stop))),
                      "warmup", "stable")
    log = train_through_cli(config, tmp_path / "resume.yaml").stderr
    for old, new, samples in (("main", "warmup", (SECOND_STAGE_START - 1) * GLOBAL_BATCH),
                              ("second", "stable", GLOBAL_BATCH)):
        warning = f"data stage '{old}' of {two_stage_runs['saving'] / str(stop)} is '{new}' in data_stages"
        assert warning in log and f"'{new}' continues its {samples} consumed samples" in log, log
        assert log.index(warning) < log.index(f"step {stop + 1}/{STEPS}")
    _assert_same_steps(metrics(two_stage_runs["straight"]), metrics(resumed), range(stop + 1, STEPS + 1))
    straight = checkpoint_json(two_stage_runs["straight"])["consumed_samples"]
    assert checkpoint_json(resumed)["consumed_samples"] == {"warmup": straight["main"], "stable": straight["second"]}


def test_a_renamed_stage_that_cannot_be_matched_is_refused_naming_both_stages(tiny_data, two_stage_runs, tmp_path):
    """One stage from step 1 where the checkpoint had two: which one 'stable' continues is not for the trainer to
    guess, and starting it over at sample 0 would train on its data again."""
    checkpoint = two_stage_runs["saving"] / str(SECOND_STAGE_START - 2)
    config = short_config(tiny_data, tmp_path / "run", STEPS, checkpoints={"resume_checkpoint_path": str(checkpoint)})
    config["data_stages"][0]["name"] = "stable"
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    consumed = (SECOND_STAGE_START - 2) * GLOBAL_BATCH
    assert_user_error(outcome, f"data stage 'stable' (from step 1) has no position in {checkpoint}, which consumed "
                      f"{consumed} samples of data stage 'main' (from step 1)", "would start over at sample 0",
                      "--override data_stages.0.name=main")
    assert not (tmp_path / "run" / "latest.txt").exists()


@pytest.mark.slow
def test_a_run_of_a_v04_data_section_resumes_with_a_modern_stage_of_another_name(tiny_data, tmp_path):
    """v0.4's data section is the stage 'main'; a modern file names its one stage otherwise."""
    def config(run: Path, steps: int, **checkpoints) -> dict:
        config = short_config(tiny_data, run, steps, checkpoints={"checkpoint_interval": 1000, **checkpoints})
        config["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = 3  # the same LR whatever train_steps is
        return _renamed(config, "stable")

    train_through_cli(config(tmp_path / "straight", 4), tmp_path / "straight.yaml")
    v04 = config(tmp_path / "run", 2)
    v04["data"] = v04.pop("data_stages")[0]["data"]
    train_through_cli(v04, tmp_path / "v04.yaml")
    assert checkpoint_json(tmp_path / "run")["consumed_samples"] == {"main": 2 * GLOBAL_BATCH}
    log = train_through_cli(config(tmp_path / "run", 4, resume_checkpoint_path="auto"), tmp_path / "modern.yaml").stderr
    assert "data stage 'main' of" in log and "is 'stable' in data_stages" in log, log
    _assert_same_steps(metrics(tmp_path / "straight"), metrics(tmp_path / "run"), range(1, 5))


# --- other data: another order, another sequence length -------------------------------------------------------------

@pytest.fixture(scope="module")
def blended(tiny_data, tmp_path_factory) -> dict:
    """A run trained 2 steps on two folders blended half and half, and the second folder."""
    from nanotron.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("blended")
    other = root / "other"
    preprocess([write_corpus(root / "raw", documents=150, seed=5)], tiny_data["tokenizer"], other, num_workers=1)
    config = short_config(tiny_data, root / "run", train_steps=2)
    config["data_stages"][0]["data"]["dataset"] = {"dataset_folder": [str(tiny_data["tokenized"]), str(other)],
                                                   "dataset_weights": [0.5, 0.5]}
    train_through_cli(config, root / "config.yaml")
    return {"run": root / "run", "config": config, "folders": [str(tiny_data["tokenized"]), str(other)]}


def _changed(config: dict, change: str, folders: list[str]) -> str:
    """Makes ``change`` to the config; the warning it gives."""
    data = config["data_stages"][0]["data"]
    if change == "seed":
        data["seed"] = 5
        return "data.seed 3 is now 5: its domains are walked in another order"
    if change == "weights":
        data["dataset"]["dataset_weights"] = [0.75, 0.25]
        return "its blend weights [0.5, 0.5] are now [0.75, 0.25]: the blend's slots are recomputed"
    if change == "folder":
        data["dataset"] = {"dataset_folder": folders[:1]}
        return f"{folders[1]} was removed: the blend and the domains' orders are recomputed"
    config["tokens"]["sequence_length"] = 64
    return "tokens.sequence_length 32 is now 64: its samples are cut anew, at the new length"


@pytest.mark.parametrize("change", ["seed", "weights", "folder", "sequence_length"])
@pytest.mark.slow
def test_a_resume_on_data_in_another_order_warns_what_changed_before_the_first_step(blended, tmp_path, change):
    config = resume_config(blended, tmp_path / "run")
    expected = _changed(config, change, blended["folders"])
    log = train_through_cli(config, tmp_path / "config.yaml").stderr
    line = next((line for line in log.splitlines() if "continues at sample" in line), "")
    assert f"data stage 'main': {expected}; it continues at sample 16 of the new order, so samples already trained " \
           "on may come again and others be skipped" in line, log
    assert log.count("continues at sample") == 1 and log.index(line) < log.index("step 3/3")


def test_a_resume_on_the_same_data_and_from_a_checkpoint_without_a_record_warns_nothing_else(blended, tmp_path):
    from nanotron.checkpoint.manager import write_metadata

    log = train_through_cli(resume_config(blended, tmp_path / "same"), tmp_path / "same.yaml").stderr
    assert "resumed from" in log and "continues at sample" not in log and "records no sample order" not in log
    older = tmp_path / "older"
    shutil.copytree(blended["run"], older)
    metadata = json.loads((older / "2" / "checkpoint.json").read_text())
    write_metadata(older / "2", {key: value for key, value in metadata.items() if key != "data_stages"})
    config = resume_config({"run": older, "config": blended["config"]}, tmp_path / "run")
    config["data_stages"][0]["data"]["seed"] = 5
    log = train_through_cli(config, tmp_path / "config.yaml").stderr
    assert "records no sample order of its data stages (saved by an earlier version)" in log
    assert "continues at sample" not in log


def test_consumed_tokens_add_up_across_a_change_of_sequence_length(base, tmp_path):
    """2 steps of 8 sequences of 32 tokens, then 2 of 8 of 64: 512 + 1024 tokens, not 32 samples x 64."""
    config = resume_config(base, tmp_path / "run", train_steps=4)
    config["tokens"]["sequence_length"] = 64
    train_through_cli(config, tmp_path / "config.yaml")
    assert [(r["step"], r["consumed_tokens"]) for r in metrics(tmp_path / "run")] == [(3, 1024), (4, 1536)]
    saved = checkpoint_json(tmp_path / "run")
    assert (saved["consumed_samples"], saved["consumed_tokens"]) == ({"main": 32}, 1536)


# --- rollbacks, automatic resumes and what a resume restores --------------------------------------------------------

@pytest.mark.slow
def test_keep_last_n_keeps_the_newest_checkpoints_after_a_rollback(tiny_data, tmp_path):
    run = tmp_path / "run"
    train_through_cli(short_config(tiny_data, run, 10, checkpoints={"checkpoint_interval": 2, "keep_last_n": 2}),
                      tmp_path / "a.yaml")
    assert checkpoint_steps(run) == ["8", "10"]
    # Roll back to step 8 and save at step 9 with keep_last_n 1: step 9 is the newest, though 10 is higher.
    rollback = short_config(tiny_data, run, 9, checkpoints={"checkpoint_interval": 1, "keep_last_n": 1,
                                                            "resume_checkpoint_path": str(run / "8")})
    train_through_cli(rollback, tmp_path / "b.yaml")
    assert checkpoint_steps(run) == ["9"] and (run / "latest.txt").read_text().strip() == "9"
    train_through_cli(short_config(tiny_data, run, 10, checkpoints={"checkpoint_interval": 1,
                                                                    "resume_checkpoint_path": "auto"}),
                      tmp_path / "c.yaml")
    assert checkpoint_json(run)["step"] == 10


def test_partial_saves_are_removed_and_a_missing_latest_falls_back(saved, tiny_data, tmp_path):
    run = saved["run"]
    (run / ".tmp-7" / "model").mkdir(parents=True)
    (run / "latest.txt").unlink()
    resume = short_config(tiny_data, run, 3, checkpoints={"checkpoint_interval": 1000,
                                                          "resume_checkpoint_path": "auto"})
    outcome = train_through_cli(resume, tmp_path / "resume.yaml")
    assert "latest.txt is missing: resuming from" in outcome.stderr and "resumed from" in outcome.stderr
    assert not (run / ".tmp-7").exists() and checkpoint_json(run)["step"] == 3


def test_a_torn_metrics_line_is_dropped_on_resume(saved, tiny_data, tmp_path):
    with open(saved["run"] / "metrics.jsonl", "a") as file:
        file.write('{"step": 3, "lm_lo')
    resume = short_config(tiny_data, saved["run"], 3, checkpoints={"checkpoint_interval": 1000,
                                                                   "resume_checkpoint_path": "auto"})
    outcome = train_through_cli(resume, tmp_path / "resume.yaml")
    assert "dropped 1 line(s) that are not step records" in outcome.stderr
    assert [r["step"] for r in metrics(saved["run"])] == [1, 2, 3]


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


@pytest.mark.full_tier
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
