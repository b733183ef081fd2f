"""Negative and boundary cases of resume, eval, generate and convert: one `error:` line and status 2 for bad
checkpoints, and exact results where a layout or a data-stage boundary must not matter.

Commands run in this process through ``nanotron.cli.main`` (fast: no interpreter or torch start-up), except
``run_generate.py`` (a subprocess, to see the real stderr) and the pp=2 evaluation (two gloo ranks).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanotron.checkpoint.logical_tensors import FORMAT_VERSION
from nanotron.cli import main
from support import ROOT
from support.configs import short_config, write_config
from support.corpus import write_corpus
from support.distributed import run_distributed
from support.runs import Outcome, assert_user_error, checkpoint_json, cli, metrics, train_through_cli


@pytest.fixture(scope="module")
def base(tiny_data, tmp_path_factory) -> dict:
    """A run folder trained 2 steps with the tiny config (hidden 64, 2 layers, 4/2 heads, vocab 384, tied)."""
    root = tmp_path_factory.mktemp("base")
    config = short_config(tiny_data, root / "run", train_steps=2)
    train_through_cli(config, root / "config.yaml")
    assert (root / "run" / "latest.txt").read_text().strip() == "2"
    return {"run": root / "run", "config": config}


def _resume_config(base: dict, run: Path, train_steps: int = 3, model_config: dict | None = None) -> dict:
    config = copy.deepcopy(base["config"])
    config["model"]["model_config"] |= model_config or {}
    config["checkpoints"] |= {"checkpoints_path": str(run), "resume_checkpoint_path": str(base["run"])}
    config["tokens"]["train_steps"] = train_steps
    return config


# --- a. resuming with another model shape -----------------------------------------------------------------------

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
    config = _resume_config(base, tmp_path / "run", model_config=model_config)
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, MISMATCH, *fragments)
    assert not (tmp_path / "run" / "latest.txt").exists()  # nothing was trained or saved


def test_resume_with_the_same_model_shape_still_works(base, tmp_path):
    """The control for the cases above: the same resume with the checkpoint's own config trains on."""
    config = _resume_config(base, tmp_path / "run")
    outcome = train_through_cli(config, tmp_path / "config.yaml")
    assert "resumed from" in outcome.stderr
    assert [record["step"] for record in metrics(tmp_path / "run")] == [3]


# --- b. a checkpoint written by a newer nanotron ---------------------------------------------------------------

@pytest.fixture
def newer(base, tmp_path) -> Path:
    """A copy of the base run whose checkpoint.json claims the next format version."""
    run = tmp_path / "newer"
    shutil.copytree(base["run"], run)
    metadata_file = run / "2" / "checkpoint.json"
    metadata = json.loads(metadata_file.read_text())
    metadata["format_version"] = FORMAT_VERSION + 1
    metadata_file.write_text(json.dumps(metadata, indent=2, sort_keys=True))
    return run


def _newer_fragments(newer: Path) -> tuple[str, ...]:
    return str(newer / "2"), "newer nanotron", f"format {FORMAT_VERSION + 1}"


def test_resume_from_a_newer_checkpoint_format_is_refused(base, newer, tmp_path):
    config = _resume_config(base, tmp_path / "run")
    config["checkpoints"]["resume_checkpoint_path"] = str(newer)
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, *_newer_fragments(newer))
    assert not (tmp_path / "run" / "latest.txt").exists()


def test_eval_of_a_newer_checkpoint_format_is_refused(tiny_data, newer, tmp_path):
    outcome = cli("eval", "--ckpt-path", newer, "--data", tiny_data["tokenized"], "--sequence-length", 16,
                  "--max-windows", 2, "--output", tmp_path / "eval.json")
    assert_user_error(outcome, *_newer_fragments(newer))
    assert not (tmp_path / "eval.json").exists()


def test_run_generate_of_a_newer_checkpoint_format_is_refused(newer):
    result = subprocess.run(
        [sys.executable, str(ROOT / "run_generate.py"), "--ckpt-path", str(newer), "--prompt", "the cat",
         "--max-new-tokens", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "NANOTRON_DEVICE": "cpu"})
    assert_user_error(Outcome(result.returncode, result.stdout, result.stderr), *_newer_fragments(newer))
    assert "===" not in result.stdout  # nothing was generated


def test_convert_of_a_newer_checkpoint_format_is_refused(newer, tmp_path):
    outcome = cli("convert", "nanotron-to-hf", "--ckpt-path", newer, "--save-path", tmp_path / "hf")
    assert_user_error(outcome, *_newer_fragments(newer))
    assert not (tmp_path / "hf").exists()


# --- c. eval at pp=2 ---------------------------------------------------------------------------------------------

def _cli_on_rank(argv: list[str]) -> None:
    main(argv)


EVAL_ARGS = ("--sequence-length", "16", "--max-windows", "10", "--batch-size", "4")  # batches of 4, 4 and 2


@pytest.mark.slow
def test_eval_at_pp2_gives_the_loss_of_pp1(base, tiny_data, tmp_path):
    data = str(tiny_data["tokenized"])
    single = cli("eval", "--ckpt-path", base["run"], "--data", data, *EVAL_ARGS, "--output", tmp_path / "pp1.json")
    assert single.code == 0, single.stderr[-3000:]
    run_distributed(_cli_on_rank, 2, argv=["eval", "--ckpt-path", str(base["run"]), "--data", data, *EVAL_ARGS,
                                           "--pp", "2", "--output", str(tmp_path / "pp2.json")])
    pp1 = json.loads((tmp_path / "pp1.json").read_text())["tokenized"]
    pp2 = json.loads((tmp_path / "pp2.json").read_text())["tokenized"]
    assert pp1["tokens"] == pp2["tokens"] == 10 * 16
    assert 3.0 < pp1["loss"] < 7.0  # about ln(384) = 5.95 after 2 steps: a real loss, not 0 or NaN
    assert pp2["loss"] == pytest.approx(pp1["loss"], rel=1e-6, abs=1e-6)
    assert pp2["perplexity"] == pytest.approx(pp1["perplexity"], rel=1e-6)


def test_eval_of_folders_of_one_name_reports_each(base, tiny_data, tmp_path):
    """The second overwrote the first: both were "tokenized"."""
    folders = [tmp_path / "a" / "tokenized", tmp_path / "b" / "tokenized"]
    for folder in folders:
        shutil.copytree(tiny_data["tokenized"], folder)
    outcome = cli("eval", "--ckpt-path", base["run"], "--data", *folders, *EVAL_ARGS, "--output", tmp_path / "e.json")
    assert outcome.code == 0, outcome.stderr[-3000:]
    results = json.loads((tmp_path / "e.json").read_text())
    assert list(results) == ["a/tokenized", "b/tokenized"] and results["a/tokenized"] == results["b/tokenized"]


# --- d. resume across a data-stage boundary ---------------------------------------------------------------------

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


def test_two_stage_reference_runs_switch_stage_and_agree(two_stage_runs):
    straight, saving = metrics(two_stage_runs["straight"]), metrics(two_stage_runs["saving"])
    _assert_same_steps(straight, saving, range(1, STEPS + 1))  # saving a checkpoint changes nothing
    samples = {"main": (SECOND_STAGE_START - 1) * GLOBAL_BATCH,
               "second": (STEPS - SECOND_STAGE_START + 1) * GLOBAL_BATCH}
    assert checkpoint_json(two_stage_runs["straight"])["consumed_samples"] == samples


@pytest.mark.parametrize("stop", [SECOND_STAGE_START - 2, SECOND_STAGE_START - 1, SECOND_STAGE_START],
                         ids=["before-boundary", "at-boundary", "first-step-of-second-stage"])
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


# --- e. resuming with other data: another order, another sequence length ----------------------------------------


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
def test_a_resume_on_data_in_another_order_warns_what_changed_before_the_first_step(blended, tmp_path, change):
    config = _resume_config(blended, tmp_path / "run")
    expected = _changed(config, change, blended["folders"])
    log = train_through_cli(config, tmp_path / "config.yaml").stderr
    line = next((line for line in log.splitlines() if "continues at sample" in line), "")
    assert f"data stage 'main': {expected}; it continues at sample 16 of the new order, so samples already trained " \
           "on may come again and others be skipped" in line, log
    assert log.count("continues at sample") == 1 and log.index(line) < log.index("step 3/3")


def test_a_resume_on_the_same_data_and_from_a_checkpoint_without_a_record_warns_nothing_else(blended, tmp_path):
    from nanotron.checkpoint.manager import write_metadata

    log = train_through_cli(_resume_config(blended, tmp_path / "same"), tmp_path / "same.yaml").stderr
    assert "resumed from" in log and "continues at sample" not in log and "records no sample order" not in log
    older = tmp_path / "older"
    shutil.copytree(blended["run"], older)
    metadata = json.loads((older / "2" / "checkpoint.json").read_text())
    write_metadata(older / "2", {key: value for key, value in metadata.items() if key != "data_stages"})
    config = _resume_config({"run": older, "config": blended["config"]}, tmp_path / "run")
    config["data_stages"][0]["data"]["seed"] = 5
    log = train_through_cli(config, tmp_path / "config.yaml").stderr
    assert "records no sample order of its data stages (saved by an earlier version)" in log
    assert "continues at sample" not in log


def test_consumed_tokens_add_up_across_a_change_of_sequence_length(base, tmp_path):
    """2 steps of 8 sequences of 32 tokens, then 2 of 8 of 64: 512 + 1024 tokens, not 32 samples x 64."""
    config = _resume_config(base, tmp_path / "run", train_steps=4)
    config["tokens"]["sequence_length"] = 64
    train_through_cli(config, tmp_path / "config.yaml")
    assert [(r["step"], r["consumed_tokens"]) for r in metrics(tmp_path / "run")] == [(3, 1024), (4, 1536)]
    saved = checkpoint_json(tmp_path / "run")
    assert (saved["consumed_samples"], saved["consumed_tokens"]) == ({"main": 32}, 1536)
