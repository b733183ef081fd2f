"""Training reads each data stage from the source its config names: a Hugging Face dataset (also in upstream's DoReMi
layout, one save_to_disk folder per domain) and synthetic tokens; a Hugging Face dataset without text is refused.
Its domains keep apart in the metrics and on the step line, also folders of one name."""

import shutil

import pytest

from support.configs import tiny_config_dict, write_config
from support.corpus import corpus_documents
from support.runs import assert_user_error, cli, metrics, train_through_cli


@pytest.fixture
def domains_on_disk(tiny_data, tmp_path, monkeypatch):
    """Two domains saved by ``datasets`` under one folder, as upstream's DoReMi examples keep theirs."""
    datasets = pytest.importorskip("datasets", reason='the Hugging Face readers need it: pip install -e ".[data]"')
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    documents = corpus_documents(tiny_data["corpus"])
    for name, part in (("Wikipedia (en)", documents[::2]), ("Github", documents[1::2])):
        datasets.Dataset.from_dict({"text": part}).save_to_disk(tmp_path / "domains" / name)
    return tmp_path / "domains"


def test_a_hugging_face_dataset_per_domain_trains_with_its_domains(tiny_data, domains_on_disk, tmp_path):
    run = tmp_path / "run"
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": 2}, doremi={  # mixed by weight, no proxy
        "domain_names": "Wikipedia (en), Github", "domain_weights": [0.75, 0.25]})
    config["data_stages"][0]["data"]["dataset"] = {"hf_dataset_or_datasets": str(domains_on_disk),
                                                   "hf_dataset_splits": "train", "text_column_name": "text"}
    train_through_cli(config, tmp_path / "config.yaml")
    records = metrics(run)
    assert [record["step"] for record in records] == [1, 2]
    assert set(records[0]["domain_losses"]) == {"Wikipedia (en)", "Github"}, records[0]
    assert all(loss > 0 for loss in records[-1]["domain_losses"].values())


def test_a_null_dataset_trains_on_synthetic_tokens(tiny_data, tmp_path):
    run = tmp_path / "run"
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": 2})
    config["data_stages"][0]["data"]["dataset"] = None
    train_through_cli(config, tmp_path / "config.yaml")
    assert [record["step"] for record in metrics(run)] == [1, 2]


def test_a_hugging_face_dataset_whose_texts_are_all_null_is_refused(tiny_data, tmp_path, monkeypatch):
    """It trained on end-of-document ids alone, and exited 0."""
    datasets = pytest.importorskip("datasets", reason='the Hugging Face readers need it: pip install -e ".[data]"')
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    folder = tmp_path / "null_texts"
    datasets.Dataset.from_dict({"text": [None] * 3000}, features=datasets.Features(
        {"text": datasets.Value("string")})).save_to_disk(folder)
    config = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 2})
    config["data_stages"][0]["data"]["dataset"] = {"hf_dataset_or_datasets": str(folder), "text_column_name": "text"}
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                      f"no row of the Hugging Face dataset {folder} has text in column 'text' (all 3,000 are null or "
                      "empty); set text_column_name to its text column")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_folders_of_one_name_are_apart_in_the_metrics_and_on_the_step_line(tiny_data, tmp_path):
    """They were one domain, "web", their losses merged."""
    folders = [tmp_path / "a" / "web", tmp_path / "b" / "web"]
    for folder in folders:
        shutil.copytree(tiny_data["tokenized"], folder)
    run = tmp_path / "run"
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": 2})
    config["data_stages"][0]["data"]["dataset"] = {"dataset_folder": [str(folder) for folder in folders]}
    outcome = train_through_cli(config, tmp_path / "config.yaml")
    assert all(set(record["domain_losses"]) == {"a/web", "b/web"} for record in metrics(run)), metrics(run)
    step_lines = [line for line in outcome.stderr.splitlines() if "| a/web " in line and "| b/web " in line]
    assert len(step_lines) == 2, outcome.stderr[-3000:]
