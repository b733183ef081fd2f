"""The `nanotron` command: the data subcommands work end to end and bad input gives one `error:` line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.configs import short_config
from support.corpus import corpus_documents, datatrove_folder
from support.distributed import run_distributed
from support.runs import assert_user_error, cli, train_through_cli


def nanotron(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanotron", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_train_tokenizer_then_preprocess(tiny_data, tmp_path):
    made = nanotron("train-tokenizer", "--input", str(tiny_data["corpus"]), "--vocab-size", "300",
                    "--output", str(tmp_path / "tok"))
    assert made.returncode == 0, made.stderr
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    assert json.loads(tokenizer.read_text())["model"]["type"] == "BPE"

    done = nanotron("preprocess", "--input", str(tiny_data["corpus"]), "--tokenizer", str(tokenizer),
                    "--output-folder", str(tmp_path / "data"), "--num-workers", "1")
    assert done.returncode == 0, done.stderr
    metadata = json.loads((tmp_path / "data" / "metadata.json").read_text())
    assert metadata["num_documents"] == 400 and metadata["tokenizer"]["vocab_size"] == 300


@pytest.mark.slow
def test_user_errors_are_one_line_with_status_2(tmp_path):
    missing = tmp_path / "missing.txt"
    result = nanotron("preprocess", "--input", str(missing), "--tokenizer", "x", "--output-folder", str(tmp_path / "o"))
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and str(missing) in result.stderr and "Traceback" not in result.stderr

    result = nanotron("train", "--config-file", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "nope.yaml" in result.stderr


def test_train_frees_its_process_groups_before_returning(tiny_data, tmp_path, monkeypatch):
    """A gloo group joins its threads only when freed; the trainer's groups sit in reference cycles, and left to the
    interpreter's exit they were torn down beside its finalisation (a finished rank once aborted there)."""
    import gc
    import weakref

    import torch.distributed as dist

    from nanotron.cli import main
    from support.configs import tiny_config_dict, write_config

    created = []
    new_group = dist.new_group

    def recorded(*args, **kwargs):
        group = new_group(*args, **kwargs)
        created.append(weakref.ref(group))
        return group

    monkeypatch.setattr(dist, "new_group", recorded)
    config = tiny_config_dict(tiny_data, tmp_path / "run")
    config["tokens"]["train_steps"] = 1
    gc.disable()  # no collection but the command's own: the test tells its collection from a chance one
    try:
        main(["train", "--config-file", str(write_config(tmp_path / "config.yaml", config))])
        alive = sum(ref() is not None for ref in created)
    finally:
        gc.enable()
    assert created and alive == 0, f"{alive} of {len(created)} process groups still alive"


# --- Options: each numeric option has a range, each output path is checked, before any work -------------------------


def _options(parser=None, command: str = "nanotron"):
    """(command, action) of every option of every subcommand."""
    import argparse

    from nanotron.cli import build_parser

    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _options(subparser, f"{command} {name}")
        else:
            yield command, action


def test_every_numeric_option_declares_its_range():
    unchecked = [f"{command} {action.option_strings[0]}" for command, action in _options()
                 if action.type in (int, float) and action.dest != "seed"]
    assert not unchecked, f"give these options a type with a range (cli.at_least, positive, probability): {unchecked}"


NOWHERE = "no-such-path"
OUT_OF_RANGE = [  # the command's required options, the bad option and value, what the error line says
    (("generate", "--ckpt-path", NOWHERE, "--prompt", "a", "--sampler", "top-k"), ("--top-k", "0"), "at least 1"),
    (("generate", "--ckpt-path", NOWHERE, "--prompt", "a", "--sampler", "top-p"), ("--top-p", "0"), "above 0"),
    (("generate", "--ckpt-path", NOWHERE, "--prompt", "a", "--sampler", "top-p"), ("--top-p", "1.5"), "at most 1"),
    (("generate", "--ckpt-path", NOWHERE, "--prompt", "a", "--sampler", "top-k"), ("--temperature", "0"), "above 0"),
    (("generate", "--ckpt-path", NOWHERE, "--prompt", "a"), ("--max-new-tokens", "0"), "at least 1"),
    (("generate", "--ckpt-path", NOWHERE, "--prompt", "a"), ("--tp", "0"), "at least 1"),
    (("eval", "--ckpt-path", NOWHERE, "--data", NOWHERE), ("--sequence-length", "0"), "at least 1"),
    (("eval", "--ckpt-path", NOWHERE, "--data", NOWHERE), ("--batch-size", "-2"), "at least 1"),
    (("eval", "--ckpt-path", NOWHERE, "--data", NOWHERE), ("--pp", "two"), "expected a whole number"),
    (("eval", "--ckpt-path", NOWHERE, "--tasks", NOWHERE), ("--num-fewshot", "-1"), "at least 0"),
    (("preprocess", "--input", NOWHERE, "--tokenizer", NOWHERE, "--output-folder", "out"), ("--num-workers", "0"),
     "at least 1"),
    (("train-tokenizer", "--input", NOWHERE, "--output", "out"), ("--vocab-size", "100"), "at least 257"),
    (("train-tokenizer", "--input", NOWHERE, "--output", "out", "--vocab-size", "300"), ("--min-frequency", "0"),
     "at least 1"),
    (("plot", "--metrics", NOWHERE, "--output", "c.png"), ("--smooth", "0"), "at least 1"),
    (("estimate-memory", "--config-file", NOWHERE), ("--gpu-memory-gb", "-1"), "above 0"),
]


@pytest.mark.parametrize("command, option, expected", OUT_OF_RANGE,
                         ids=[f"{c[0]}{o[0]}={o[1]}" for c, o, _ in OUT_OF_RANGE])
def test_an_option_out_of_its_range_is_one_error_line_naming_it(command, option, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_user_error(cli(*command, *option), f"argument {option[0]}: ", expected, option[1])
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("arguments, expected", [
    (("eval", "--data", NOWHERE), "the following arguments are required: --ckpt-path"),
    (("evaluate",), "invalid choice: 'evaluate'"),
    (("generate", "--ckpt-path", NOWHERE, "--sampler", "nucleus"), "argument --sampler: invalid choice"),
], ids=["missing", "unknown-command", "bad-choice"])
def test_a_malformed_command_line_is_one_error_line(arguments, expected):
    outcome = cli(*arguments)
    assert_user_error(outcome, expected)
    assert "usage:" not in outcome.stderr


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory) -> Path:
    """A run folder trained one step with the tiny config (its checkpoint holds the tiny tokenizer)."""
    root = tmp_path_factory.mktemp("run")
    train_through_cli(short_config(tiny_data, root / "run", train_steps=1), root / "config.yaml")
    return root / "run"


@pytest.fixture
def no_model_loaded(monkeypatch):
    """Commands that load a checkpoint's model fail the test if they do."""
    import nanotron.generation.evaluate
    import nanotron.generation.generate

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the command line was checked")

    for module in (nanotron.generation.evaluate, nanotron.generation.generate):
        monkeypatch.setattr(module, "load_model", load_model)


def _output_commands(run: Path, tiny_data: dict, output: Path) -> dict[str, tuple]:
    """Every command writing a file or folder, with ``output`` as that path."""
    history = run.parent / "domain_weights.jsonl"
    history.write_text('{"step": 1, "weights": {"a": 0.25, "b": 0.75}}\n')
    return {
        "eval": ("eval", "--ckpt-path", run, "--data", tiny_data["tokenized"], "--sequence-length", 16,
                 "--max-windows", 2, "--output", output),
        "doremi average": ("doremi", "average", "--history", history, "--output", output),
        "train-tokenizer": ("train-tokenizer", "--input", tiny_data["corpus"], "--vocab-size", 300, "--output",
                            output),
        "preprocess": ("preprocess", "--input", tiny_data["corpus"], "--tokenizer", tiny_data["tokenizer"],
                       "--output-folder", output, "--num-workers", 1),
        "convert": ("convert", "nanotron-to-hf", "--ckpt-path", run, "--save-path", output),
    }


@pytest.mark.parametrize("command", ["eval", "doremi average", "train-tokenizer", "preprocess", "convert"])
def test_an_output_path_that_cannot_be_written_is_one_error_line_before_any_work(command, run, tiny_data, tmp_path,
                                                                                 no_model_loaded, monkeypatch):
    """Inside a file, in a folder this user may not write in, or a folder where a file is written: refused while
    the command line is parsed, before any data is read or model loaded."""
    option = {"convert": "--save-path", "preprocess": "--output-folder"}.get(command, "--output")
    blocker, locked = tmp_path / "a-file", tmp_path / "locked"
    blocker.write_text("kept")
    locked.mkdir()
    assert_user_error(cli(*_output_commands(run, tiny_data, blocker / "out.json")[command]),
                      f"argument {option}: ", f"{blocker} is a file, not a folder")
    with monkeypatch.context() as patch:
        access = os.access
        patch.setattr(os, "access", lambda path, mode: Path(path) != locked and access(path, mode))
        assert_user_error(cli(*_output_commands(run, tiny_data, locked / "out.json")[command]),
                          f"argument {option}: ", f"this user may not write in {locked}")
    assert blocker.read_text() == "kept" and list(locked.iterdir()) == []


@pytest.mark.parametrize("command", ["eval", "doremi average"])
def test_a_results_file_must_be_a_json_file(command, run, tiny_data, tmp_path, no_model_loaded):
    folder = tmp_path / "results.json"
    folder.mkdir()
    assert_user_error(cli(*_output_commands(run, tiny_data, folder)[command]),
                      f"argument --output: {folder} is a folder, not a file")
    assert_user_error(cli(*_output_commands(run, tiny_data, tmp_path / "results.txt")[command]),
                      "argument --output: ", "results.txt does not end in .json, the format this command writes")
    assert list(folder.iterdir()) == [] and not (tmp_path / "results.txt").exists()


@pytest.mark.parametrize("command", ["eval", "doremi average"])
def test_a_results_file_goes_into_new_folders_and_replaces_an_earlier_one(command, run, tiny_data, tmp_path):
    output = tmp_path / "new" / "folders" / "results.json"
    for earlier in (None, "an earlier file"):
        if earlier is not None:
            output.write_text(earlier)
        outcome = cli(*_output_commands(run, tiny_data, output)[command])
        assert outcome.code == 0, outcome.stderr[-3000:]
    results = json.loads(output.read_text())
    if command == "eval":
        assert results["tokenized"]["tokens"] == 2 * 16 and 3.0 < results["tokenized"]["loss"] < 7.0
    else:
        assert results == {"a": 0.25, "b": 0.75}


def test_train_tokenizer_never_replaces_a_tokenizer_or_writes_into_a_file(tiny_data, tmp_path):
    existing = tmp_path / "tokenizer.json"
    existing.write_text("{}")
    for output in (existing, tmp_path):  # the file itself, or the folder holding it
        assert_user_error(cli("train-tokenizer", "--input", tiny_data["corpus"], "--vocab-size", 300, "--output",
                              output), f"{existing} already exists", "choose another path or delete it")
    assert existing.read_text() == "{}"
    assert_user_error(cli("train-tokenizer", "--input", tiny_data["corpus"], "--vocab-size", 300, "--output",
                          existing / "tok"), f"{existing} is a file, not a folder to write {existing / 'tok'}")


# --- eval reads every source training reads --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """The tiny corpus as upstream users hold it: datatrove folders (the documents in order in one file; shuffled
    into files of at most 1500 tokens) and a save_to_disk DatasetDict (train: the first 300 documents, validation:
    the other 100)."""
    datasets = pytest.importorskip("datasets", reason='Hugging Face datasets need datasets; pip install -e ".[data]"')
    root = tmp_path_factory.mktemp("sources")
    documents = corpus_documents(tiny_data["corpus"])
    datatrove_folder(root / "datatrove", documents, tiny_data["tokenizer"], shuffle_documents=False)
    datatrove_folder(root / "datatrove-files", documents, tiny_data["tokenizer"], shuffle_documents=True, seed=0,
                     max_tokens_per_file=1500)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": documents[:300]}),
                          "validation": datasets.Dataset.from_dict({"text": documents[300:]})}
                         ).save_to_disk(root / "saved")
    return {"datatrove": root / "datatrove", "datatrove-files": root / "datatrove-files", "saved": root / "saved"}


@pytest.mark.slow
def test_eval_reads_datatrove_folders_and_hugging_face_datasets(run, tiny_data, sources, tmp_path, monkeypatch):
    """The same tokens give the same loss from every kind of source: both splits of the Hugging Face dataset tokenize
    into the preprocessed folder's stream, and the datatrove folder's first window is that stream's first. A
    datatrove folder is read in training's windows (disjoint, cut file by file)."""
    from nanotron.data.datatrove_folder import DatatroveDataset

    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))

    def evaluate(*data, windows: int, splits: tuple[str, ...] = ("train",)) -> dict:
        outcome = cli("eval", "--ckpt-path", run, "--data", *data, "--hf-dataset-splits", *splits,
                      "--sequence-length", 16, "--max-windows", windows, "--output", tmp_path / "results.json")
        assert outcome.code == 0, outcome.stderr[-3000:]
        return json.loads((tmp_path / "results.json").read_text())

    hf = evaluate(tiny_data["tokenized"], sources["saved"], windows=20, splits=("train", "validation"))
    assert hf["saved"] == hf["tokenized"] and hf["saved"]["tokens"] == 20 * 16
    train_split = evaluate(sources["saved"], windows=10 ** 6)["saved"]["tokens"]
    assert train_split < evaluate(sources["saved"], windows=10 ** 6, splits=("train", "validation"))["saved"]["tokens"]

    first = evaluate(tiny_data["tokenized"], sources["datatrove"], windows=1)
    assert first["datatrove"] == first["tokenized"] and 3.0 < first["datatrove"]["loss"] < 7.0
    files = sources["datatrove-files"]
    assert len(list(files.glob("*.ds"))) > 1
    windows = DatatroveDataset(files, None, 16, 0, vocab_size=384).num_windows[0]
    assert evaluate(files, windows=10 ** 6)["datatrove-files"]["tokens"] == 16 * windows


def _eval_on_rank(argv: list[str], hf_cache: str) -> None:
    import datasets

    from nanotron.cli import main

    datasets.config.HF_DATASETS_CACHE = hf_cache
    main(argv)


@pytest.mark.slow
def test_eval_of_every_kind_of_source_at_tp2_gives_the_loss_of_one_process(run, tiny_data, sources, tmp_path,
                                                                            monkeypatch):
    """Rank 0 tokenizes the Hugging Face dataset into a fresh cache and checks the datatrove ids; the other rank
    reads that cache and skips the checks."""
    datasets = pytest.importorskip("datasets")
    arguments = ["eval", "--ckpt-path", str(run), "--data", str(tiny_data["tokenized"]), str(sources["datatrove"]),
                 str(sources["saved"]), "--sequence-length", "16", "--max-windows", "12", "--batch-size", "5"]
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "one-process"))
    outcome = cli(*arguments, "--output", tmp_path / "tp1.json")
    assert outcome.code == 0, outcome.stderr[-3000:]
    run_distributed(_eval_on_rank, 2, argv=[*arguments, "--tp", "2", "--output", str(tmp_path / "tp2.json")],
                    hf_cache=str(tmp_path / "two-ranks"))
    tp1, tp2 = (json.loads((tmp_path / name).read_text()) for name in ("tp1.json", "tp2.json"))
    assert list(tp2) == list(tp1) == ["tokenized", "datatrove", "saved"]
    for name, result in tp1.items():
        assert tp2[name]["tokens"] == result["tokens"] == 12 * 16
        assert tp2[name]["loss"] == pytest.approx(result["loss"], rel=1e-5), name
    assert len(list((tmp_path / "two-ranks").rglob("metadata.json"))) == 1  # tokenized once, into its cache


def test_eval_of_a_missing_local_folder_names_it_without_asking_the_hub(run, tmp_path, no_model_loaded):
    for missing in (tmp_path / "missing", tmp_path / "missing" / "deeper"):
        assert_user_error(cli("eval", "--ckpt-path", run, "--data", missing, "--sequence-length", 16),
                          f"--data {missing} does not exist",
                          "a preprocessed or datatrove folder, or a Hugging Face dataset")
