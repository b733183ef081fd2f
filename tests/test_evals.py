"""Downstream evaluations: multiple-choice task files of every shape, their prompts and scores as lm-eval-harness
defines them, one ``error:`` line for a bad file, the same numbers at every layout, from the exported Hugging Face
model and from ``nanotron eval``; in the training loop, records at the interval in metrics.jsonl and TensorBoard, the
schedule kept by a resume, and a failing evaluation that does not stop the run."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

from nanotron.config import EvalTaskArgs
from nanotron.data.dataset import DataError
from nanotron.data.tokenizer import eos_token_id, load_tokenizer
from nanotron.generation.scoring import choice_metrics
from nanotron.generation.tasks import TaskRows, fewshot_context, read_examples, task_rows
from support.configs import moe_config, short_config, write_config
from support.runs import assert_user_error, cli, metrics, train_in_process, train_on_ranks, train_through_cli
from support.tasks import evals_section, lm_eval_scores, task_examples, transformers_log_likelihoods, write_task

STEPS, INTERVAL, SAVED = 5, 2, 3  # evaluations after steps 2, 4 and 5 (the last); a checkpoint at 3 to resume from


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    return write_task(tmp_path_factory.mktemp("tasks") / "animals.jsonl", task_examples())


def evals_config(tiny_data, run: Path, task: Path, steps: int = STEPS, interval: int = INTERVAL, **sections) -> dict:
    """The tiny run evaluated every ``interval`` steps, its learning rates those of a ``STEPS``-step run whatever
    ``steps`` (a shorter run evaluates as the long one did at its steps)."""
    config = short_config(tiny_data, run, steps, evals=evals_section(task, tiny_data["tokenized"], interval,
                                                                     num_fewshot=1), **sections)
    config["checkpoints"]["checkpoint_interval"] = SAVED
    config["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = STEPS - 1
    return config


@pytest.fixture(scope="module")
def evaluated(tiny_data, task, tmp_path_factory) -> dict:
    """A run of ``STEPS`` steps evaluated after steps 2, 4 and 5, logging to TensorBoard too."""
    root = tmp_path_factory.mktemp("evaluated")
    config = evals_config(tiny_data, root / "run", task, logging={"tensorboard_dir": str(root / "tb")})
    train_through_cli(config, root / "config.yaml")
    return {"run": root / "run", "config": config, "tb": root / "tb"}


def details(run: Path, step: int) -> dict:
    return json.loads((run / "evals" / f"{step}.json").read_text())


def assert_same_scores(scored: dict, reference: dict, atol: float) -> None:
    """The same accuracies of the task, its log-likelihoods and (where both have it) the held-out loss within
    ``atol``."""
    task, expected = scored["animals"], reference["animals"]
    assert (task["acc"], task["acc_norm"]) == (expected["acc"], expected["acc_norm"])
    assert torch.allclose(torch.tensor(task["loglikelihoods"]), torch.tensor(expected["loglikelihoods"]), rtol=0,
                          atol=atol)
    if "tokenized" in scored and "tokenized" in reference:
        assert scored["tokenized"]["loss"] == pytest.approx(reference["tokenized"]["loss"], abs=atol)


def eval_fields(record: dict) -> dict:
    return {key: value for key, value in record.items() if key.startswith("eval/")}


# --- task files ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parquet", pytest.param("save_to_disk", marks=pytest.mark.slow)])
def test_parquet_and_saved_datasets_read_as_the_jsonl_file(task, tmp_path, kind):
    examples = task_examples()
    lighteval = [{"query": e["context"], "choices": e["choices"], "gold_index": [e["gold"]]} for e in examples]
    path = write_task(tmp_path / ("animals.parquet" if kind == "parquet" else "animals"), lighteval, kind)
    assert read_examples(path) == read_examples(task) == read_examples(task.parent)
    assert [e.gold for e in read_examples(path)] == [e["gold"] for e in examples]


def test_fewshot_prompts_are_fixed_by_the_seed_and_never_show_the_question(task):
    examples = read_examples(task)
    settings = EvalTaskArgs(task, num_fewshot=3, fewshot_seed=5)
    prompts = [fewshot_context(examples, index, settings) for index in range(len(examples))]
    assert prompts == [fewshot_context(examples, index, settings) for index in range(len(examples))]
    other_seed = EvalTaskArgs(task, num_fewshot=3, fewshot_seed=6)
    assert prompts != [fewshot_context(examples, index, other_seed) for index in range(len(examples))]
    for index, (example, prompt) in enumerate(zip(examples, prompts)):
        shots = prompt.split("\n\n")
        assert len(shots) == 4 and shots[-1] == example.context
        solved = [f"{e.context} {e.choices[e.gold]}" for i, e in enumerate(examples) if i != index]
        assert all(shot in solved for shot in shots[:-1]), index


def test_rows_score_each_choice_after_its_context_within_the_budgets(tiny_data, task):
    tokenizer = load_tokenizer(tiny_data["tokenizer"])
    eos = eos_token_id(tokenizer)
    whole = task_rows(EvalTaskArgs(task), tokenizer, 32, eos)
    first = whole.examples[0]
    for row, choice in zip(whole.rows, first.choices):
        text = tokenizer.decode(list(row.tokens[-row.scored:]))
        assert text.strip() == choice and tokenizer.decode(list(row.tokens[:-row.scored])) == first.context
    assert whole.starts == [4 * i for i in range(len(whole.examples) + 1)]
    assert len(task_rows(EvalTaskArgs(task, max_samples=5), tokenizer, 32, eos).examples) == 5
    budget = sum(len(row.tokens) - 1 for row in whole.rows[:12])  # the first three examples' rows
    assert len(task_rows(EvalTaskArgs(task, max_tokens=budget), tokenizer, 32, eos).examples) == 3
    short = task_rows(EvalTaskArgs(task, num_fewshot=4), tokenizer, 8, eos)  # long prompts lose their start
    assert all(len(row.tokens) <= 9 for row in short.rows)


def test_acc_and_acc_norm_as_lm_eval_harness_defines_them(tiny_data, task):
    """acc: the likeliest choice; acc_norm: the likeliest per character; the first choice wins a tie."""
    examples = read_examples(task)[:3]
    examples[0] = type(examples[0])("x", ("a", "bbbb"), 1)  # -2 vs -4: acc picks a, per character bbbb (-1)
    examples[1] = type(examples[1])("x", ("a", "b"), 0)  # a tie: the first choice
    examples[2] = type(examples[2])("x", ("aa", "b"), 1)  # -1 vs -0.9
    rows = TaskRows("t", examples, [], [0, 2, 4, 6])
    scores = choice_metrics(rows, torch.tensor([-2.0, -4.0, -1.0, -1.0, -1.0, -0.9], dtype=torch.float64))
    assert scores["acc"] == pytest.approx(2 / 3) and scores["acc_norm"] == pytest.approx(1 / 3 + 1 / 3)
    assert scores["loglikelihoods"][0] == [-2.0, -4.0] and scores["gold"] == [1, 0, 1]


BAD_FILES = {
    "wrong columns": ('{"question": "q", "choices": ["a", "b"], "gold": 0}\n', "line 1 has no 'context' or 'query'"),
    "gold out of range": ('{"context": "q", "choices": ["a", "b"], "gold": 0}\n'
                          '{"context": "q", "choices": ["a", "b"], "gold": 2}\n',
                          "line 2: the gold index 2 is out of range for 2 choices"),
}


@pytest.mark.parametrize("problem", list(BAD_FILES))
def test_a_bad_row_is_refused_naming_the_file_and_row(tmp_path, problem):
    text, message = BAD_FILES[problem]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    with pytest.raises(DataError) as refused:
        read_examples(bad)
    assert f"{bad} {message}" in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("problem", list(BAD_FILES))
def test_a_bad_task_file_is_one_error_line_naming_the_file_and_row(evaluated, tmp_path, problem):
    text, message = BAD_FILES[problem]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    outcome = cli("eval", "--ckpt-path", evaluated["run"], "--tasks", bad, "--sequence-length", 32)
    assert_user_error(outcome, f"{bad} {message}")


def test_a_task_folder_that_does_not_exist_stops_training_before_it_starts(tiny_data, tmp_path):
    missing = tmp_path / "nowhere" / "arc"
    config = evals_config(tiny_data, tmp_path / "run", missing)
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, f"{missing}: no such task file or folder")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --- the same numbers everywhere -------------------------------------------------------------------------------


@pytest.mark.slow
def test_nanotron_eval_on_a_checkpoint_gives_the_loop_s_numbers(evaluated, task, tiny_data, tmp_path):
    output = tmp_path / "eval.json"
    outcome = cli("eval", "--ckpt-path", evaluated["run"] / "5", "--tasks", task, "--num-fewshot", 1,
                  "--data", tiny_data["tokenized"], "--max-windows", 4, "--sequence-length", 32, "--batch-size", 4,
                  "--output", output)
    assert outcome.code == 0, outcome.stderr[-3000:]
    assert "animals: acc " in outcome.stdout
    standalone, in_loop = json.loads(output.read_text()), details(evaluated["run"], 5)
    assert standalone.keys() == in_loop.keys() == {"animals", "tokenized"}
    assert_same_scores(standalone, in_loop, atol=1e-6)


@pytest.mark.slow
def test_the_exported_model_scored_by_transformers_gives_the_same_numbers(evaluated, task, tiny_data, tmp_path):
    pytest.importorskip("transformers")
    outcome = cli("convert", "nanotron-to-hf", "--ckpt-path", evaluated["run"] / "5", "--save-path", tmp_path / "hf")
    assert outcome.code == 0, outcome.stderr[-3000:]
    tokenizer = load_tokenizer(tiny_data["tokenizer"])
    rows = task_rows(EvalTaskArgs(task, num_fewshot=1), tokenizer, 32, eos_token_id(tokenizer))
    from_hf = choice_metrics(rows, torch.tensor(transformers_log_likelihoods(tmp_path / "hf", rows.rows),
                                                dtype=torch.float64))
    assert_same_scores({"animals": from_hf}, details(evaluated["run"], 5), atol=1e-4)


@pytest.mark.full_tier
def test_lm_eval_harness_scores_the_exported_model_as_nanotron_eval_does(evaluated, task, tmp_path):
    """Zero-shot (lm-eval-harness draws its few-shot examples otherwise); where lm-eval is installed."""
    pytest.importorskip("lm_eval")
    outcome = cli("convert", "nanotron-to-hf", "--ckpt-path", evaluated["run"] / "5", "--save-path", tmp_path / "hf")
    assert outcome.code == 0, outcome.stderr[-3000:]
    output = tmp_path / "eval.json"
    outcome = cli("eval", "--ckpt-path", evaluated["run"] / "5", "--tasks", task, "--sequence-length", 32,
                  "--output", output)
    assert outcome.code == 0, outcome.stderr[-3000:]
    theirs = lm_eval_scores(tmp_path / "hf", task, tmp_path / "lm")
    assert_same_scores({"animals": theirs}, json.loads(output.read_text()), atol=1e-4)


LAYOUTS = {  # parallelism, accumulation (the global batch of 8 stays), ZeRO stage
    "pp2": ({"pp": 2}, 2, 0),
    "tp2": ({"tp": 2, "tp_mode": "REDUCE_SCATTER"}, 2, 0),
    "dp2": ({"dp": 2}, 1, 0),
    "cp2": ({"context_parallel_size": 2}, 2, 0),
    "tp2_pp2": ({"tp": 2, "pp": 2}, 2, 0),
    "dp2_zero3": ({"dp": 2}, 1, 3),
}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow if name == "pp2"
                                                  else pytest.mark.full_tier) for name in LAYOUTS])
def test_every_layout_scores_as_one_process(evaluated, tiny_data, task, tmp_path, layout):
    """The first evaluation (after step 2) of the one-process run, at another layout; the step after it trains as
    the one-process run's did."""
    parallelism, accumulation, zero = LAYOUTS[layout]
    config = evals_config(tiny_data, tmp_path / layout, task, steps=INTERVAL + 1)
    config["parallelism"] |= parallelism
    config["tokens"]["batch_accumulation_per_replica"] = accumulation
    config["optimizer"]["zero_stage"] = zero
    ranks = 1
    for size in parallelism.values():
        ranks *= size if isinstance(size, int) else 1
    after = INTERVAL + 1  # the step trained after the evaluation
    losses = {record["step"]: record["lm_loss"] for record in train_on_ranks(config, ranks)}
    assert losses[after] == pytest.approx(metrics(evaluated["run"])[after - 1]["lm_loss"], rel=1e-5)
    assert_same_scores(details(tmp_path / layout, INTERVAL), details(evaluated["run"], INTERVAL), atol=1e-5)


@pytest.mark.full_tier
def test_expert_parallel_ranks_score_as_one_process(tiny_data, task, tmp_path):
    scored = {}
    for ep in (1, 2):
        config = moe_config(tiny_data, tmp_path / f"ep{ep}", ep=ep)
        config["tokens"]["train_steps"] = 1
        config["evals"] = evals_section(task, tiny_data["tokenized"], num_fewshot=1)
        train_on_ranks(config, ep) if ep > 1 else train_in_process(config)
        scored[ep] = details(tmp_path / f"ep{ep}", 1)
    assert_same_scores(scored[2], scored[1], atol=1e-5)


# --- in the training loop --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_records_at_the_interval_and_the_end_in_metrics_and_tensorboard(evaluated):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = {record["step"]: record for record in metrics(evaluated["run"])}
    assert [step for step, record in records.items() if eval_fields(record)] == [2, 4, 5]
    fields = eval_fields(records[4])
    assert set(fields) == {"eval/animals/acc", "eval/animals/acc_norm", "eval/tokenized/loss",
                           "eval/tokenized/perplexity"}
    assert 0 <= fields["eval/animals/acc"] <= 1 and 3 < fields["eval/tokenized/loss"] < 7
    assert records[4]["eval_time_s"] > 0 and "eval_time_s" not in records[3]
    assert fields["eval/animals/acc"] == details(evaluated["run"], 4)["animals"]["acc"]
    events = EventAccumulator(str(evaluated["tb"]))
    events.Reload()
    logged = events.Scalars("eval/animals/acc")
    assert [(e.step, e.value) for e in logged] == [(s, pytest.approx(records[s]["eval/animals/acc"]))
                                                   for s in (2, 4, 5)]


@pytest.mark.slow
def test_a_resume_keeps_the_eval_schedule(evaluated, tmp_path):
    config = copy.deepcopy(evaluated["config"])
    config["checkpoints"] |= {"checkpoints_path": str(tmp_path / "resumed"),
                              "resume_checkpoint_path": str(evaluated["run"] / str(SAVED))}
    config["logging"].pop("tensorboard_dir")
    train_through_cli(config, tmp_path / "config.yaml")
    resumed = {record["step"]: record for record in metrics(tmp_path / "resumed")}
    original = {record["step"]: record for record in metrics(evaluated["run"])}
    assert [step for step, record in resumed.items() if eval_fields(record)] == [4, 5]  # not 3 + 2
    for step in (4, 5):
        for key, value in eval_fields(resumed[step]).items():
            assert value == pytest.approx(original[step][key], abs=1e-6), (step, key)


@pytest.mark.slow
def test_evaluations_between_steps_change_neither_the_training_nor_its_step_times(tiny_data, task, tmp_path,
                                                                                   monkeypatch):
    """FP8's delayed scaling records the amaxes of every forward for the next step's scales: an evaluation's must
    not count. Each evaluation here takes 1000 s more on the clock: its time, not the steps'."""
    import time

    import nanotron.training.evals as evals

    clock, skipped, scored = time.perf_counter, [0.0], evals.evaluation_results

    def slow(*args, **kwargs):
        skipped[0] += 1000.0
        return scored(*args, **kwargs)

    monkeypatch.setattr(time, "perf_counter", lambda: clock() + skipped[0])
    monkeypatch.setattr(evals, "evaluation_results", slow)
    fp8 = {"enabled": True, "recipe": "delayed", "amax_history_length": 4}
    runs = {name: train_in_process(short_config(tiny_data, tmp_path / name, 3, fp8=fp8, evals=section))
            for name, section in (("evaluated", evals_section(task, interval=1)), ("plain", None))}
    assert [r["lm_loss"] for r in runs["evaluated"]] == [r["lm_loss"] for r in runs["plain"]]
    assert all(r["eval_time_s"] >= 1000 and r["step_time_s"] < 100 for r in runs["evaluated"])


@pytest.mark.slow
def test_an_evaluation_that_fails_is_logged_once_and_training_goes_on(tiny_data, task, tmp_path, monkeypatch):
    import nanotron.training.evals as evals

    def failing(*args, **kwargs):
        raise RuntimeError("the device ran out of memory\nsecond line")

    monkeypatch.setattr(evals, "evaluation_results", failing)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("nanotron.trainer").addHandler(handler)
    try:
        records = train_in_process(evals_config(tiny_data, tmp_path / "run", task, steps=2, interval=1))
    finally:
        logging.getLogger("nanotron.trainer").removeHandler(handler)
    assert [record["step"] for record in records] == [1, 2]
    assert not any(eval_fields(record) or "eval_time_s" in record for record in records)
    failures = [message for message in messages if "evaluation after step" in message]
    assert failures == ["the evaluation after step 1 failed and training goes on: RuntimeError: the device ran out "
                        "of memory"]
